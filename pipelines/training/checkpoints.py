"""What a checkpoint holds and where it lives.

    <storage_path>/<run_name>/step_000120/
        deepspeed/...        every rank's DeepSpeed state (model, ZeRO-2 optimizer shards, LR schedule)
        latest               DeepSpeed's pointer to the tag above
        drafter/             config.json + model.safetensors: Drafter.from_pretrained(path, target)
        state.json           step, the run's length (`steps`, or what fitted its `minutes`), DeepSpeed's
                             own step count, world size and drafter config (checked before a run resumes)

Ray Train merges the files every rank reports into one folder per step and records each once every rank's
files are in; rerunning with the same run name hands the newest one it recorded back through
`ray.train.get_checkpoint()`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import ray.train
from pyarrow import fs

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.errors import DominoError
from domino.formats import DRAFTER_DIR
from pipelines.training.config import PipelineConfig

DEEPSPEED_TAG = "deepspeed"
STATE_NAME = "state.json"
TEMP_PREFIX = "domino-ckpt-"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


@contextlib.contextmanager
def saved(engine, drafter: Drafter, step: int, planned_steps: int, rank: int, world_size: int,
          cfg: PipelineConfig) -> Iterator[ray.train.Checkpoint]:
    """Write this rank's part of the checkpoint for `step` of a run of `planned_steps` into a temporary
    folder, removed once the `with` block (which reports it) ends: the only copy that stays is the one in
    storage."""
    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as folder:
        engine.save_checkpoint(folder, tag=DEEPSPEED_TAG, client_state={"step": step, "planned_steps": planned_steps})
        if rank == 0:
            drafter.save_pretrained(Path(folder) / DRAFTER_DIR)
            state = {"step": step, "planned_steps": planned_steps, "optimizer_steps": engine.global_steps,
                     "world_size": world_size, "drafter": asdict(drafter.config), "config": cfg.model_dump()}
            (Path(folder) / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")
        yield ray.train.Checkpoint.from_directory(folder)


def restore(engine) -> tuple[int, int | None]:
    """Load the newest checkpoint of this run into the engine, if there is one; return its step and the
    run's length it was written in (None without a checkpoint)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, None
    with checkpoint.as_directory() as folder:
        path, client_state = engine.load_checkpoint(folder, tag=DEEPSPEED_TAG)
    if path is None:
        raise DominoError(f"checkpoint {checkpoint.path} has no DeepSpeed state under '{DEEPSPEED_TAG}/'")
    return int(client_state["step"]), client_state.get("planned_steps")


def steps_to_finish(cfg: PipelineConfig, planned_steps: int | None) -> int:
    """The length of a run resumed from a checkpoint that planned `planned_steps`: once a time budget has
    cut the steps, the run finishes that plan; before the cut (or with no budget) it has `steps`, which a
    budget may still cut."""
    if cfg.minutes is not None and planned_steps is not None and planned_steps < cfg.steps:
        return planned_steps
    return cfg.steps


@dataclass
class RunState:
    uri: str  # the newest checkpoint folder
    step: int
    planned_steps: int | None  # the run's length when it was written: `steps`, or what fitted `minutes`
    world_size: int
    drafter: DrafterConfig
    config: dict  # the run's PipelineConfig when the checkpoint was written (empty in older checkpoints)

    def changed(self, cfg: PipelineConfig) -> str:
        """The keys this run now sets otherwise than when its checkpoint was written ('' when none)."""
        now = cfg.model_dump()
        keys = [k for k in now if k in self.config and self.config[k] != now[k]]
        return ", ".join(f"{k} {self.config[k]} -> {now[k]}" for k in keys)

    def finished(self, cfg: PipelineConfig) -> bool:
        """Whether the run has trained all it will: `steps`, or with a time budget the steps that fitted it."""
        return self.step >= steps_to_finish(cfg, self.planned_steps)

    @property
    def drafter_uri(self) -> str:
        return f"{self.uri}/{DRAFTER_DIR}"


def check_writable(cfg: PipelineConfig) -> None:
    """Make the run's folder in storage before training: a storage_path that cannot hold it fails here, in
    one line, not when the first checkpoint is written."""
    try:
        filesystem, run_path = fs.FileSystem.from_uri(f"{cfg.storage_uri}/{cfg.run_name}")
        filesystem.create_dir(run_path, recursive=True)
    except (OSError, ValueError) as error:
        raise DominoError(f"cannot write checkpoints to {cfg.storage_uri}: {str(error).splitlines()[0]}") from None


def latest(cfg: PipelineConfig) -> RunState | None:
    """The newest checkpoint of run `run_name` that Ray Train recorded, or None for a new run: the one the
    trainers resume from (`ray.train.get_checkpoint()`). A job stopped while it wrote checkpoints may leave
    newer step folders that Ray Train never recorded as complete; the resumed run writes those again."""
    run_uri = f"{cfg.storage_uri}/{cfg.run_name}"
    where = f"the checkpoints of run '{cfg.run_name}' in {cfg.storage_uri}"
    try:
        filesystem, run_path = fs.FileSystem.from_uri(run_uri)
        infos = filesystem.get_file_info(fs.FileSelector(run_path, allow_not_found=True))
        if not any(i.type == fs.FileType.Directory and i.base_name.startswith("step_") for i in infos):
            return None
        try:
            checkpoint = ray.train.Result.from_path(run_uri).checkpoint
        except RuntimeError as error:  # step folders, but not Ray Train's record of them
            raise DominoError(f"{where} are not a Ray Train run's ({str(error).splitlines()[0]}): choose a new "
                              f"run_name") from None
        if checkpoint is None:
            return None
        name = Path(checkpoint.path).name
        with filesystem.open_input_stream(f"{run_path}/{name}/{STATE_NAME}") as f:
            state = json.loads(f.read())
        return RunState(uri=f"{run_uri}/{name}", step=state["step"], planned_steps=state.get("planned_steps"),
                        world_size=state["world_size"], drafter=DrafterConfig(**state["drafter"]),
                        config=state.get("config", {}))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DominoError(f"cannot read {where}: {str(error).splitlines()[0]}") from None


def check_resumable(state: RunState, cfg: PipelineConfig, drafter: DrafterConfig) -> None:
    """Refuse to resume a run whose checkpoints another drafter or another world size wrote."""
    where = f"run '{cfg.run_name}' in {cfg.storage_uri} (checkpoint at step {state.step})"
    if state.drafter != drafter:
        theirs, mine = asdict(state.drafter), asdict(drafter)
        diffs = ", ".join(f"{k} {theirs[k]} -> {mine[k]}" for k in mine if theirs[k] != mine[k] and k != "target_name")
        raise DominoError(f"{where} trained another drafter ({diffs}): choose a new run_name to start afresh")
    if state.world_size != cfg.num_workers:
        raise DominoError(f"{where} was trained by {state.world_size} workers; ZeRO-2 optimizer shards resume only "
                          f"with num_workers={state.world_size} (or choose a new run_name)")
