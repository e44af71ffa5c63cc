"""The training pipeline's benchmark: feature-producer vs trainer throughput, the trainers' data wait,
and the disk an offline feature cache would have needed against what the run wrote.

    python -m pipelines.bench pipeline [--config FILE] [key=value ...]

Runs pipelines/train.py's job (the embedded default unless told otherwise) under a fresh run name,
then prints the figures as markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import os
import platform
import time

import torch
from pyarrow import fs

from domino.errors import DominoError
from pipelines.training.config import PipelineConfig, command_line, parse_args
from pipelines.training.features import DTYPES
from pipelines.train import RunOutcome, run


def cache_bytes_per_token(cfg: PipelineConfig, drafter) -> int:
    """What an offline cache stores per token: the features (and final hidden states when distilling)
    in the transport dtype, the token id (int32) and its loss-mask flag."""
    vectors = len(drafter.target_layer_ids) + (1 if cfg.distill else 0)
    return vectors * drafter.target_hidden_size * DTYPES[cfg.feature_dtype].itemsize + 4 + 1


def bytes_under(uri: str) -> int:
    filesystem, path = fs.FileSystem.from_uri(uri)
    infos = filesystem.get_file_info(fs.FileSelector(path, recursive=True, allow_not_found=True))
    return sum(i.size for i in infos if i.type == fs.FileType.File)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def report(cfg: PipelineConfig, outcome: RunOutcome, seconds: float) -> str:
    """The benchmark's markdown: throughput, data wait, and disk."""
    m = outcome.metrics
    per_token = cache_bytes_per_token(cfg, outcome.drafter)
    written = bytes_under(f"{cfg.storage_uri}/{cfg.run_name}")
    producer = m["run_feature_tokens_per_s"]
    lines = [
        f"Run `{cfg.run_name}`: {cfg.steps} steps, {cfg.num_workers} trainer(s) x batch {cfg.batch_size}, "
        f"{cfg.feature_actors} feature actor(s), {outcome.epoch_tokens} tokens per epoch, "
        f"{m['run_tokens']:.0f} tokens trained on after the first batch, {seconds / 60:.1f} min end to end; "
        f"first batch {m['first_batch_s']:.0f} s after the trainers started.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| feature producer, one actor (tokens / s of target time) | {producer:.0f} |",
        f"| feature producers, all {cfg.feature_actors} actor(s) | {producer * cfg.feature_actors:.0f} |",
        f"| trainers, all {cfg.num_workers} (tokens / s of wall time) | {m['run_train_tokens_per_s']:.0f} |",
        f"| producer capacity / trainer demand | {producer * cfg.feature_actors / max(m['run_train_tokens_per_s'], 1e-9):.2f} |",
        "| data wait per trainer (share of wall time after the first batch) | "
        + ", ".join(f"{w:.1%}" for w in m["run_data_wait"]) + " |",
        f"| offline cache: bytes per token | {per_token} |",
        f"| offline cache for one epoch ({outcome.epoch_tokens} tokens) | {gib(per_token * outcome.epoch_tokens)} |",
        f"| features streamed through memory ({m['run_tokens']:.0f} tokens) | {gib(per_token * m['run_tokens'])} |",
        f"| written by the run: checkpoints in storage_path | {gib(written)} |",
        "| written by the run: features, caches, spilled objects | 0 (what tests/test_pipeline_ray.py checks) |",
    ]
    if outcome.tau:
        lines += ["", "| drafter | prompts | tau (mean) |", "| --- | --- | --- |"]
        lines += [f"| {r['drafter']} | {r['prompts']} | {r['tau']:.2f} |" for r in outcome.tau]
    return "\n".join(lines)


def benchmark(argv: list[str]) -> None:
    cfg = parse_args([f"run_name=benchmark-{time.strftime('%Y%m%d-%H%M%S')}", *argv])
    print(f"# machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    outcome = run(cfg)
    if outcome.metrics is None:
        raise DominoError(f"run '{cfg.run_name}' was already trained: benchmark a fresh run_name")
    print(report(cfg, outcome, time.perf_counter() - start))


def main(argv: list[str]) -> int:
    return command_line(__doc__, argv, benchmark)

