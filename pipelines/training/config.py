"""The training pipeline's configuration: one flat set of keys, validated once at the boundary.

Values come from the defaults below (the embedded default: SmolLM2-135M on ShareGPT, sized to finish
in under 20 minutes on 2 CPU cores), then a YAML/JSON file (`--config FILE`), then `key=value`
arguments. Anything wrong is reported as one line naming the key.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from domino.config import HEAD_KINDS
from domino.errors import DominoError
from domino.formats import read_json
from domino.objective import ObjectiveConfig
from domino.training import BUDGET_WARMUP, TrainConfig
from pipelines.training.errors import exit_status

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_DATA = "sharegpt"


class PipelineConfig(BaseModel):
    # a number where a string is expected (run_name=2024, from YAML or the command line) is that string
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    # -- run ----------------------------------------------------------------------------------------
    run_name: str = Field("smollm2-sharegpt", min_length=1, description="rerunning with the same name resumes from its last checkpoint")
    storage_path: str = Field("~/domino-runs", min_length=1, description="where checkpoints go: a local folder or s3://bucket/prefix")

    # -- data ---------------------------------------------------------------------------------------
    data: str = Field(EMBEDDED_DATA, min_length=1, description="'sharegpt' (embedded), or .jsonl/.json (JSON Lines, or one JSON array of conversations) or .parquet files: a file or folder, local or s3://")
    max_conversations: int = Field(1200, ge=0, description="read at most this many conversations (0: all)")
    max_length: int = Field(256, ge=16, description="tokens per training sequence (longer ones are cut)")
    max_malformed_fraction: float = Field(0.05, ge=0, le=1, description="malformed rows are skipped and counted; more than this fraction is fatal")
    eval_prompts: int = Field(8, ge=0, description="held-out conversations whose first prompt measures tau at the end (0: no evaluation)")
    eval_max_new_tokens: int = Field(64, ge=1, description="tokens generated per evaluation prompt")

    # -- regeneration: the target rewrites the first assistant turn with its own greedy output ----------
    regenerate: bool = Field(False, description="train on the target's own responses (what DFlash/Domino train on)")
    regenerate_tokens: int = Field(64, ge=1, description="most tokens the target writes per response")
    regenerate_actors: int = Field(2, ge=1, description="target actors generating responses")
    regenerate_batch_size: int = Field(16, ge=1, description="prompts per generate call")

    # -- target features ------------------------------------------------------------------------------
    target: str = Field("smollm2-135m", min_length=1, description="the frozen target: embedded name, model folder or hub id")
    feature_actors: int = Field(1, ge=1, description="actors running the target to produce features")
    feature_batch_size: int = Field(2, ge=1, description="sequences per target forward (a token's features are hundreds to thousands of times larger than its id)")
    feature_cpus: float = Field(0.75, ge=0, description="CPUs per feature or regeneration actor")
    feature_gpus: float = Field(0, ge=0, description="GPUs per feature or regeneration actor")
    feature_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="dtype features travel in")
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="dtype the feature actors run the target in and the trainers' steps compute in (autocast); "
                            "auto: bfloat16 on GPUs and on CPUs with AMX or AVX-512 BF16, float32 elsewhere (regeneration and evaluation "
                            "run the target as it is served)")
    data_cpus: float = Field(0.25, gt=0, description="CPUs per read/tokenise task")

    # -- drafter --------------------------------------------------------------------------------------
    draft_layers: int = Field(1, ge=1, description="layers of the drafter backbone")
    target_layer_ids: list[int] | None = Field([-3], description="target layers whose outputs the drafter reads (negative: from the last, -1; null: DFlash's choice, one per draft layer)")
    block_size: int = Field(8, ge=2, description="block positions drafted per round (label_convention dflash: the first, the anchor's, proposes nothing)")
    head: str = Field("markov", description=f"sequential head: {', '.join(HEAD_KINDS)} (sglang-domino: the "
                                            f"head SGLang serves, for `python -m domino export --format sglang-domino`)")
    label_convention: Literal["shifted", "dflash"] = Field(
        "shifted", description="shifted (block position k proposes the (k+1)-th token after the anchor) or dflash "
                               "(the anchor's slot proposes nothing: a DFlash checkpoint, with head none)")
    rank: int = Field(64, ge=1, description="rank of the head's logit correction")
    draft_vocab_size: int = Field(8192, ge=0, description="the drafter scores only this many of the most frequent response tokens (0: the target's whole vocabulary)")
    lookup_ngram: int = Field(3, ge=0, le=16, description="drafts also copy from the request's own text after a repeat of its last n <= this many tokens (0: the learned drafter alone)")
    lookup_min_ngram: int = Field(2, ge=1, le=16, description="the shortest repeat a copy may follow (on CPU a copy after a 1-token repeat is right too rarely to pay for its verification)")
    confidence_head: bool = Field(True, description="also train DSpark's confidence head")
    labels: Literal["data", "target"] = Field("target", description="what each position learns: the data's next token, or the target's own greedy choice there (one forward, no generation)")
    distill: bool = Field(False, description="DSpark loss: 0.1 CE + 0.9 TV to the target's distribution (streams final hidden states too)")

    # -- training ---------------------------------------------------------------------------------------
    num_workers: int = Field(1, ge=1, description="training workers (data parallel, DeepSpeed ZeRO-2)")
    use_gpu: bool = Field(False, description="one GPU per training worker (NCCL); off: CPU and gloo")
    trainer_cpus: float = Field(1, gt=0, description="CPUs per training worker")
    trainer_gpus: float = Field(1, gt=0, le=1, description="GPUs per training worker with use_gpu (below 1 shares a GPU with feature actors)")
    batch_size: int = Field(2, ge=1, description="sequences per step per worker")
    # steps and lr are the embedded recipe's (measured on 2 CPU cores); the library's TrainConfig keeps generic ones
    steps: int = Field(320, ge=1, description="optimiser steps in total (with `minutes`: at most)")
    minutes: float | None = Field(None, gt=0, description=f"wall-time budget of the training steps: the run times them (from step {BUDGET_WARMUP + 1}, refitting at every progress line) and keeps as many as fit, never more than `steps`; the schedule and curriculum span those, and checkpoints keep the count (null: all `steps`)")
    lr: float = Field(2e-3, gt=0, description="peak learning rate (cosine schedule)")
    warmup_fraction: float = Field(TrainConfig.warmup_fraction, ge=0, lt=1, description="fraction of steps warming up the learning rate")
    weight_decay: float = Field(TrainConfig.weight_decay, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(TrainConfig.grad_clip, ge=0, description="gradient norm clipping (0: off)")
    seed: int = Field(0, description="seeds the drafter's initial weights, the anchors drawn and the replay order")
    anchors_per_sequence: int = Field(ObjectiveConfig.anchors_per_sequence, ge=1, description="blocks drawn from each sequence per step")
    replay: int = Field(2, ge=1, description="steps per streamed batch: the extra ones replay batches kept in memory (features cost far more than a step)")
    replay_memory: int = Field(512, ge=1, description="streamed batches each worker keeps in host memory for replay")
    curriculum_fraction: float = Field(ObjectiveConfig.curriculum_fraction, ge=0, le=1, description="base-anchored curriculum: share of steps over which lambda falls to 0")
    decay: float | None = Field(None, gt=0, description="position-weight decay of the loss, w_k = exp(-k / decay) (null: the published value for the block size)")
    confidence_weight: float = Field(ObjectiveConfig.confidence_weight, ge=0, description="weight of the confidence head's loss")
    deepspeed_config: str = Field("cluster/deepspeed/zero2.json", description="DeepSpeed JSON (relative paths: from the repository root)")
    log_every: int = Field(20, ge=1, description="steps between progress lines")
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints (a multiple of log_every)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept in storage (the newest)")
    max_failures: int = Field(2, ge=0, description="worker-group restarts from the last checkpoint before giving up")
    fail_at_step: int = Field(0, ge=0, description="testing only: the last worker dies at this step of a run started from scratch (0: off)")

    @model_validator(mode="after")
    def _consistent(self) -> "PipelineConfig":
        if "/" in self.run_name or "\\" in self.run_name or self.run_name in (".", ".."):
            raise ValueError(f"run_name names one folder under storage_path: no '/' in it, got '{self.run_name}'")
        if self.head not in HEAD_KINDS:
            raise ValueError(f"head must be one of {', '.join(HEAD_KINDS)}, got '{self.head}'")
        if self.checkpoint_every % self.log_every:
            raise ValueError(f"checkpoint_every ({self.checkpoint_every}) must be a multiple of log_every ({self.log_every})")
        if self.fail_at_step >= self.steps:
            raise ValueError(f"fail_at_step ({self.fail_at_step}) must be below steps ({self.steps})")
        return self

    # -- derived --------------------------------------------------------------------------------------
    @property
    def storage_uri(self) -> str:
        """storage_path with ~ expanded and local paths made absolute (Ray Train needs absolute paths)."""
        if "://" in self.storage_path:
            return self.storage_path.rstrip("/")
        return str(Path(self.storage_path).expanduser().resolve())

    def resources_at_once(self) -> dict[str, tuple[float, str]]:
        """CPUs and GPUs the job's actors hold at the same time (regeneration's actors, then the trainers
        beside the feature actors), each with the keys that set it."""
        trainer_gpus = self.trainer_gpus if self.use_gpu else 0
        held = {}
        for name, trainer, actor, (trainer_key, actor_key) in [
                ("CPU", self.trainer_cpus, self.feature_cpus, ("trainer_cpus", "feature_cpus")),
                ("GPU", trainer_gpus, self.feature_gpus, ("trainer_gpus (use_gpu)", "feature_gpus"))]:
            needed = self.num_workers * trainer + self.feature_actors * actor
            keys = f"num_workers x {trainer_key} + feature_actors x {actor_key}"
            if self.regenerate:  # regeneration's actors run first, alone
                needed = max(needed, self.regenerate_actors * actor)
                keys += f", or regenerate_actors x {actor_key}"
            held[name] = (needed, keys)
        return held

    def deepspeed(self) -> dict:
        """The DeepSpeed JSON with the keys this config owns filled in, so each value lives in one place."""
        path = Path(self.deepspeed_config).expanduser()
        path = path if path.is_absolute() else REPO_ROOT / path
        try:
            ds = read_json(path)
        except DominoError as error:
            raise DominoError(f"deepspeed_config: {error}") from None
        owned = {key: ours for key, ours in DEEPSPEED_OWNED.items() if key in ds}
        owned.update({f"optimizer.params.{key}": key for key in ("lr", "weight_decay")
                      if key in ((ds.get("optimizer") or {}).get("params") or {})})
        if ds.get("gradient_accumulation_steps", 1) != 1:
            owned["gradient_accumulation_steps"] = "steps (each step is one batch per worker; raise batch_size)"
        if owned:  # set in two places, one would silently win
            raise DominoError(f"deepspeed_config: {path} sets " + ", ".join(f"{key} (the pipeline's {ours})"
                                                                          for key, ours in owned.items())
                              + ": set those pipeline keys instead")
        ds["train_micro_batch_size_per_gpu"] = self.batch_size
        ds["gradient_clipping"] = self.grad_clip
        optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
        optimizer.setdefault("params", {}).update(lr=self.lr, weight_decay=self.weight_decay)
        return ds


# DeepSpeed keys the pipeline's own keys decide: a DeepSpeed file that sets them is refused
DEEPSPEED_OWNED = {"train_micro_batch_size_per_gpu": "batch_size", "train_batch_size": "batch_size x num_workers",
                   "gradient_clipping": "grad_clip", "scheduler": "cosine schedule (lr, warmup_fraction, steps)",
                   "fp16": "compute_dtype", "bf16": "compute_dtype"}


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message} (got {item['input']!r})" if where else message)
    return "bad config: " + "; ".join(parts)


def build_config(values: dict) -> PipelineConfig:
    """Validate a mapping of config keys, naming unknown keys (with a suggestion) and bad values."""
    known = list(PipelineConfig.model_fields)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else " (python pipelines/train.py --help lists them)"
            raise DominoError(f"unknown config key '{key}'{hint}")
    try:
        return PipelineConfig(**values)
    except ValidationError as error:
        raise DominoError(_validation_message(error)) from None


def read_config_file(path: str) -> dict:
    try:
        values = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as error:
        raise DominoError(f"cannot read config file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise DominoError(f"config file {path} is not valid YAML{where}: {str(error).splitlines()[0]}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise DominoError(f"config file {path} must hold a mapping of keys to values")
    return values


def _scalar(raw: str):
    """A command-line value read as YAML ("64" -> 64, "true" -> True), else kept as the string."""
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def parse_args(argv: list[str]) -> PipelineConfig:
    """`[--config FILE] [key=value ...]`: the file's keys, then the overrides, then validation."""
    values: dict = {}
    overrides: dict = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] or (args.pop(0) if args else "")
            if not path:
                raise DominoError("--config needs a file: --config my-run.yaml")
            values.update(read_config_file(path))
        elif "=" in arg and not arg.startswith("-"):
            key, _, raw = arg.partition("=")
            overrides[key.strip()] = _scalar(raw)
        else:
            raise DominoError(f"expected key=value or --config FILE, got '{arg}' (see --help)")
    return build_config({**values, **overrides})


def help_text() -> str:
    lines = ["config keys (key=value on the command line, or a YAML file with --config FILE):", ""]
    for name, field in PipelineConfig.model_fields.items():
        lines.append(f"  {name} = {json.dumps(field.default)}" + (f"  # {field.description}" if field.description else ""))
    return "\n".join(lines)


def command_line(doc: str, argv: list[str] | None, body: Callable[[list[str]], object]) -> int:
    """A pipeline command: `--help` prints `doc` and every config key; anything else runs `body(argv)`,
    bad input ending as one line on stderr (exit status 2)."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(doc)
        print(help_text())
        return 0
    return exit_status(lambda: body(argv))
