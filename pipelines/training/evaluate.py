"""The closing measurement: tau of the exported drafter against an untrained one, on held-out prompts,
with the project's speculative decoder (greedy, so the output is the target's own)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import ray
import ray.train
import torch

from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.drafter import Drafter
from domino.sampling import SamplingParams
from domino.target import Target
from pipelines.training.checkpoints import RunState
from pipelines.training.config import PipelineConfig


def measure_tau(target_path: str, drafter_uri: str, prompts: list[str], max_new_tokens: int, device: str,
                lookup_ngram: int | None = None, initial_seed: int | None = None) -> list[float]:
    """tau per prompt for the drafter exported at `drafter_uri` (local path or s3://). With `initial_seed`,
    for the drafter its training started from instead: the same shape and draft vocabulary, its weights
    drawn again as the trainer drew them. `lookup_ngram` overrides the drafter's context lookup (0: the
    learned drafter alone)."""
    torch.set_num_threads(1)
    target = Target.load(target_path, device=device)
    with ray.train.Checkpoint(drafter_uri).as_directory() as folder:
        drafter = Drafter.from_pretrained(Path(folder), target)
    if initial_seed is not None:
        vocabulary = drafter.draft_to_target if drafter.config.draft_vocab_size else None
        drafter = Drafter.initial(drafter.config, target, initial_seed, vocabulary).to(target.device).eval()
    if lookup_ngram is not None:
        drafter.set_lookup(lookup_ngram)
    decoder = SpeculativeDecoder(target, drafter)
    generation = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingParams())
    return [decoder.generate(target.encode_prompt(json.loads(p)), generation).stats.tau for p in prompts]


def evaluate(cfg: PipelineConfig, target_path: str, state: RunState, prompts: list[str]) -> list[dict]:
    """The exported drafter against the one its training started from (untrained), and, with context lookup,
    without it: one Ray task per row, side by side (one CPU each, and the feature actors' GPU share)."""
    task = ray.remote(measure_tau).options(num_cpus=1, num_gpus=cfg.feature_gpus)
    device = "cuda" if cfg.feature_gpus else "cpu"
    rows = {"untrained": dict(initial_seed=cfg.seed), f"trained (step {state.step})": {}}
    if cfg.lookup_ngram:  # what the learned drafter does alone, without copies from the text
        rows["trained, no context lookup"] = dict(lookup_ngram=0)
    pending = {name: task.remote(target_path, state.drafter_uri, prompts, cfg.eval_max_new_tokens, device, **options)
               for name, options in rows.items()}
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
