"""The closing measurement: tau of the exported drafter against an untrained one, on held-out prompts,
with the project's speculative decoder (greedy, so the output is the target's own)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import ray
import ray.train
import torch

from domino.config import DrafterConfig
from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.drafter import Drafter
from domino.sampling import SamplingParams
from domino.target import Target
from pipelines.training.config import PipelineConfig


def measure_tau(target_path: str, drafter_uri: str | None, config: DrafterConfig, prompts: list[str],
                max_new_tokens: int, device: str, seed: int, lookup_ngram: int | None = None) -> list[float]:
    """tau per prompt for the drafter exported at `drafter_uri` (local path or s3://), or for an untrained
    drafter built from `config` with the trainer's seed when `drafter_uri` is None; `lookup_ngram`
    overrides the drafter's context lookup (0: the learned drafter alone)."""
    torch.set_num_threads(1)
    target = Target.load(target_path, device=device)
    if drafter_uri is None:
        torch.manual_seed(seed)
        drafter = Drafter(config, target.embed_tokens, target.lm_head).to(target.device).eval()
    else:
        with ray.train.Checkpoint(drafter_uri).as_directory() as folder:
            drafter = Drafter.from_pretrained(Path(folder), target)
    if lookup_ngram is not None:
        drafter.set_lookup(lookup_ngram)
    decoder = SpeculativeDecoder(target, drafter)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams())
    return [decoder.generate(target.encode_prompt(json.loads(p)), generation).stats.tau for p in prompts]


def evaluate(cfg: PipelineConfig, target_path: str, drafters: dict[str, tuple[str | None, int | None]],
             config: DrafterConfig, prompts: list[str]) -> list[dict]:
    """One Ray task per drafter, side by side (one CPU each, and the feature actors' GPU share); rows for
    the table. `drafters`: name -> (checkpoint URI or None for an untrained one, lookup_ngram override or None)."""
    task = ray.remote(measure_tau).options(num_cpus=1, num_gpus=cfg.feature_gpus)
    device = "cuda" if cfg.feature_gpus else "cpu"
    pending = {name: task.remote(target_path, uri, config, prompts, cfg.eval_max_new_tokens, device, cfg.seed, lookup)
               for name, (uri, lookup) in drafters.items()}
    rows = []
    for name, ref in pending.items():
        taus = ray.get(ref)
        rows.append({"drafter": name, "prompts": len(taus), "tau": statistics.fmean(taus),
                     "min": min(taus), "max": max(taus)})
    return rows


def format_table(rows: list[dict], max_new_tokens: int) -> str:
    lines = [f"tau on held-out prompts (greedy, {max_new_tokens} new tokens each):", "",
             "| drafter | prompts | tau (mean) | min | max |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['drafter']} | {r['prompts']} | {r['tau']:.2f} | {r['min']:.2f} | {r['max']:.2f} |" for r in rows]
    return "\n".join(lines)
