"""The main job: train a Domino drafter with target features streamed from Ray Data into Ray Train.

    python pipelines/train.py [--config FILE] [key=value ...]
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python pipelines/train.py [key=value ...]
    python pipelines/train.py --help        # every config key with its default

read conversations -> tokenise (assistant-only loss) -> [target regenerates the answers] ->
target features on an actor pool -> DeepSpeed ZeRO-2 trainers -> checkpoints in storage_path ->
tau of the exported drafter vs an untrained one on held-out prompts.

With no arguments it runs the embedded default: SmolLM2-135M on ShareGPT, under 20 minutes on 2 cores.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a script: make the repository importable here and in the Ray workers it starts
    _ROOT = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

import logging  # noqa: E402
import warnings  # noqa: E402

import ray  # noqa: E402
from ray.util.annotations import RayDeprecationWarning  # noqa: E402

from domino.config import DrafterConfig  # noqa: E402
from domino.errors import DominoError  # noqa: E402
from domino.embedded import EMBEDDED_TARGETS  # noqa: E402
from domino.target import Target, resolve_target  # noqa: E402
from domino.vocabulary import coverage, most_frequent  # noqa: E402
from pipelines.training import checkpoints  # noqa: E402
from pipelines.training.config import EMBEDDED_DATA, PipelineConfig, command_line, parse_args  # noqa: E402
from pipelines.training.data import (check_survey, list_files, repeated, response_token_counts, survey,  # noqa: E402
                                     tokenized_conversations, training_rows)
from pipelines.training.errors import root_cause  # noqa: E402
from pipelines.training.evaluate import evaluate, format_table  # noqa: E402
from pipelines.training.features import regenerated, with_features  # noqa: E402
from pipelines.training.trainer import drafter_config, fit  # noqa: E402


def connect() -> bool:
    """Join the cluster this job was submitted to (RAY_ADDRESS), else start a private local one (or use the
    one this process is connected to); whether the cluster's resources are fixed: no autoscaler adds a node
    to a cluster the job was not submitted to."""
    # Set before a local cluster starts, these reach every worker too (a cluster's own are its operator's):
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # else every worker line is printed twice
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")  # not each dataset's execution plan and start and end
    # not a download bar on each worker that fetches a hub target (Target.load hides its own loading bar)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    ray.data.DataContext.get_current().enable_progress_bars = False  # bars redrawn in a log are noise
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    quiet_ray_notices()
    if os.environ.get("RAY_ADDRESS"):
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)
        return False
    if not ray.is_initialized():  # Ray Train's placement-group cleaner needs the dashboard's state API
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=True, logging_level=logging.WARNING,
                 runtime_env={"worker_process_setup_hook": quiet_ray_notices})
    return True


def check_resources(cfg: PipelineConfig) -> None:
    """On a cluster of fixed size, a job that asks for more than it holds would wait for ever."""
    have = ray.cluster_resources()
    for name, (needed, keys) in cfg.resources_at_once().items():
        if needed > have.get(name, 0) + 1e-9:
            raise DominoError(f"the job holds {needed:g} {name}s at once ({keys}), and the local Ray cluster has "
                              f"{have.get(name, 0):g}: lower those keys, or submit the job to a cluster that has them")


def kept_checkpoints(cfg: PipelineConfig) -> str:
    last = checkpoints.latest(cfg)
    if last is None:
        return "no checkpoint was written"
    return f"checkpoints up to step {last.step} are kept in {last.uri}, and the same command resumes from there"


def quiet_ray_notices() -> None:
    """Run in the driver and in every worker of the local cluster the job starts: notices a user can do
    nothing about (Ray Train's own use of an option Ray Data deprecated; that the progress bars the job
    turned off are off; that the private cluster has token authentication on, Ray's default, whose absence
    is still announced; how Ray Train starts its worker group, which the job's own "[train] N worker(s)"
    line reports, at every restart too) stay out of the job's output, and so does Ray Train's note on
    resuming, which suggests deleting the run's folder (the job's own line says which checkpoint it resumes
    from)."""
    from ray.train.torch import config as torch_backend
    from ray.train.v2._internal.execution.checkpoint import checkpoint_manager
    from ray.train.v2._internal.execution.worker_group import worker_group

    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: not record.getMessage().startswith("Token authentication is enabled"))
    # a filter, not a level: Ray Train's controller loads a logging config that resets its loggers' levels
    for module in (checkpoint_manager, worker_group, torch_backend):
        logging.getLogger(module.__name__).addFilter(lambda record: record.levelno >= logging.WARNING)
    warnings.filterwarnings("ignore", message=".*exclude_resources", category=RayDeprecationWarning)


@dataclass
class RunOutcome:
    """What the job measured."""

    drafter: DrafterConfig
    epoch_tokens: int  # tokens in one pass over the training sequences
    checkpoint: checkpoints.RunState | None = None  # the newest
    metrics: dict | None = None  # the last training report; None when this run trained nothing (already finished)
    tau: list[dict] = field(default_factory=list)  # the closing table's rows (none without held-out prompts)


def run(cfg: PipelineConfig) -> RunOutcome:
    """Run the whole job: check, survey the data, train (or resume), export, and measure tau."""
    target_path = resolve_target(cfg.target)  # what can be checked without Ray is, before it starts
    if cfg.target in EMBEDDED_TARGETS:  # tasks, actors and trainers load it by name: each node converts its own
        target_path = cfg.target  # copy, as the folder converted here lies on this node alone
    target = Target.shape_only(cfg.target)
    if cfg.max_length > target.max_length:
        raise DominoError(f"max_length {cfg.max_length} is longer than the target's context ({target.max_length} "
                          f"tokens)")
    drafter = drafter_config(cfg, target)
    cfg.deepspeed()
    if cfg.data != EMBEDDED_DATA:
        list_files(cfg.data)
    fixed_size = connect()
    if fixed_size:
        check_resources(cfg)
    state = checkpoints.latest(cfg)
    if state is not None:
        checkpoints.check_resumable(state, cfg, drafter)

    tokenized = tokenized_conversations(cfg, target_path)
    found = survey(tokenized, cfg, drafter.target_vocab_size)
    print(f"[data] {cfg.data}: {found.summary()}", flush=True)
    check_survey(found, cfg)
    checkpoints.check_writable(cfg)

    outcome = RunOutcome(drafter, found.tokens)
    changed = state.changed(cfg) if state is not None else ""
    if state is not None and state.finished(cfg):
        print(f"[train] run '{cfg.run_name}' is already trained to step {state.step}: nothing to train"
              + (f" (its checkpoint was written with other settings: {changed}; a new run_name trains with these)"
                 if changed else ""), flush=True)
    else:
        if state is not None:
            print(f"[train] resuming run '{cfg.run_name}' from its checkpoint at step {state.step}"
                  + (f"; changed since: {changed}" if changed else ""), flush=True)
        rows, count = training_rows(tokenized, found.held_out, cfg), found.trainable
        if cfg.regenerate:
            start = time.perf_counter()
            try:
                rows = regenerated(rows, cfg, target_path).materialize()  # token ids only, kept in memory
            except ray.exceptions.RayError as error:
                raise DominoError(f"the regeneration failed: {root_cause(error)}") from None
            outcome.epoch_tokens, count = rows.sum("num_tokens"), rows.count()
            print(f"[regenerate] {count} answers by the target ({outcome.epoch_tokens} tokens with their "
                  f"prompts) in {time.perf_counter() - start:.0f} s", flush=True)
        vocabulary = None
        if drafter.draft_vocab_size:  # the target's own answers, when it rewrote them, else the data's
            counts = response_token_counts(rows, drafter.target_vocab_size) if cfg.regenerate else found.response_counts
            vocabulary = most_frequent(counts, drafter.draft_vocab_size)
            print(f"[vocab] the drafter scores the {drafter.draft_vocab_size} most frequent response tokens, "
                  f"{coverage(counts, vocabulary):.1%} of the training responses", flush=True)
            vocabulary = vocabulary.tolist()
        stream = with_features(repeated(rows, count, cfg), cfg, target_path, drafter.target_layer_ids)
        try:
            result = fit(cfg, stream, target_path, vocabulary)
        except ray.train.TrainingFailedError as error:
            raise DominoError(f"training failed: {root_cause(error)} ({kept_checkpoints(cfg)})") from None
        except KeyboardInterrupt:
            print(f"[train] stopped: {kept_checkpoints(cfg)}", flush=True)
            raise
        outcome.metrics = result.metrics
        state = checkpoints.latest(cfg)
        if cfg.minutes is not None and state.planned_steps is not None and state.planned_steps < cfg.steps:
            print(f"[train] the time budget of {cfg.minutes:g} minutes kept {state.planned_steps} of the "
                  f"{cfg.steps} steps", flush=True)
    outcome.checkpoint = state
    print(f"[train] drafter {'exported to' if outcome.metrics is not None else 'of that step:'} {state.drafter_uri}", flush=True)

    if found.held_out:
        try:
            rows = evaluate(cfg, target_path, state, found.held_out)
        except ray.exceptions.RayError as error:
            raise DominoError(f"the evaluation failed: {root_cause(error)} (the drafter is kept: "
                              f"{state.drafter_uri})") from None
        print(format_table(rows, cfg.eval_max_new_tokens), flush=True)
        outcome.tau = rows
    return outcome


def main(argv: list[str] | None = None) -> int:
    return command_line(__doc__, argv, lambda args: run(parse_args(args)))


if __name__ == "__main__":
    sys.exit(main())
