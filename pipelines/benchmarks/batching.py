"""Batched decoding on the embedded target at several concurrencies: (a) plain autoregressive
decoding, batched; (b) speculative decoding verifying every drafted token; (c) speculative decoding
with confidence-scheduled verification (DSpark). All requests start together; greedy. Each engine
runs the workload twice: the table shows the second run (steady state) and the first run's total.

    python -m pipelines.benchmarks.batching --drafter $HOME/domino-runs/smollm2-sharegpt/step_000300/drafter [--concurrency 1 4 16 32]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from domino.drafter import Drafter
from domino.engine import DecodingEngine
from domino.requests import GenerationConfig
from domino.scheduler import ConfidenceScheduler, FullVerify, profile_sps
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks.engine import PROMPTS


def run(engine: DecodingEngine, prompts: list[list[int]], max_new_tokens: int, tag: str = "r") -> dict:
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    states = [engine.add(f"{tag}{i}", p, config) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    wall = time.perf_counter() - start
    tokens = sum(len(s.tokens) for s in states)
    return dict(total=tokens / wall,
                per_user=sum(s.stats.tokens_per_second for s in states) / len(states),
                tau=sum(sum(s.stats.accept_lengths) for s in states) / max(1, sum(s.stats.rounds for s in states)),
                outputs=[s.tokens for s in states])


def steady(engine: DecodingEngine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The workload twice on one engine: the first run is a cold start (allocator, caches, the
    scheduler's gate still learning), the second what a server that has been running sees."""
    first = run(engine, prompts, max_new_tokens, tag="first ")
    return {**run(engine, prompts, max_new_tokens), "first_total": first["total"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", required=True, help="a drafter checkpoint with a confidence head")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    target = Target.load(args.target)
    drafter = Drafter.from_pretrained(args.drafter, target)
    block = drafter.config.block_size
    sps = profile_sps(target, max_tokens=max(args.concurrency) * (block + 1))
    methods = {
        "(a) autoregressive": lambda: DecodingEngine(target, None),
        "(b) full block": lambda: DecodingEngine(target, drafter, policy=FullVerify()),
        "(c) confidence-scheduled": lambda: DecodingEngine(target, drafter, policy=ConfidenceScheduler(sps)),
    }
    print(f"# {args.target} on {platform.machine()}, {torch.get_num_threads()} threads; drafter {args.drafter} "
          f"(block {block}, head {drafter.config.head}); {args.max_new_tokens} new tokens per request, greedy")
    print("\n| concurrency | method | total tokens/s | per-request tokens/s | tau | first run: total tokens/s | "
          "same output as (a) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for concurrency in args.concurrency:
        prompts = [target.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(concurrency)]
        results = {name: steady(make(), prompts, args.max_new_tokens) for name, make in methods.items()}
        baseline = results["(a) autoregressive"]["outputs"]
        for name, r in results.items():
            print(f"| {concurrency} | {name} | {r['total']:.1f} | {r['per_user']:.1f} | {r['tau']:.2f} | "
                  f"{r['first_total']:.1f} | {r['outputs'] == baseline} |", flush=True)


if __name__ == "__main__":
    main()
