"""Batched decoding on the embedded target at several concurrencies: (a) plain autoregressive
decoding, batched; (b) speculative decoding verifying every drafted token; (c) speculative decoding
with confidence-scheduled verification (DSpark); (d) every draft verified in the rounds a speculation
gate lets draft (the policy for drafters without a confidence head; the drafter measured here needs
one, for (c)). All requests start together; greedy.

The four engines run in lockstep, one step of each in turn (the order balanced), and each method's
clock counts only its own steps: this VM's speed drifts by 10 % and more between runs a minute apart,
and alternating steps exposes every method to the same drift. Each engine serves the workload once
cold (allocator, caches, the scheduler's gate still learning; its total is reported apart), then
`--repeats` times timed, as a server that has been running would.

    python -m pipelines.bench batching --drafter $HOME/domino-runs/smollm2-sharegpt/step_000320/drafter [--concurrency 1 4 16 32]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from domino.drafter import Drafter
from domino.engine import DecodingEngine
from domino.requests import GenerationConfig
from domino.scheduler import ConfidenceScheduler, FullVerify, GatedFullVerify, check_fits, profile_sps
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks import TARGET_HELP, HelpFormatter
from pipelines.benchmarks.engine import PROMPTS


def lockstep(engines: dict[str, DecodingEngine], prompts: list[list[int]], max_new_tokens: int, tag: str) -> dict:
    """Every engine serves the same requests, one step of each in turn. Per method: tokens, its own
    step time, each request's tokens over the method's clock when it finished, rounds, outputs."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    states = {name: [e.add(f"{tag}{i}", p, config) for i, p in enumerate(prompts)] for name, e in engines.items()}
    clock = dict.fromkeys(engines, 0.0)
    finished_at: dict[str, dict[int, float]] = {name: {} for name in engines}
    # A step runs slower right after a big one (caches, allocator), so who goes before whom matters.
    # Alternating the order a b c d / a d c b puts each method right after each other one about equally
    # often; a plain rotation (a b c / b c a / c a b) would put c after b twice as often as a.
    names = list(engines)
    orders = [names, names[:1] + names[:0:-1]]
    rounds = 0
    while any(e.has_work for e in engines.values()):
        rounds += 1
        for name in orders[rounds % 2]:
            engine = engines[name]
            if not engine.has_work:
                continue
            start = time.perf_counter()
            engine.step()
            clock[name] += time.perf_counter() - start
            for i, state in enumerate(states[name]):
                if state.finished and i not in finished_at[name]:
                    finished_at[name][i] = clock[name]
    return {name: dict(tokens=sum(len(s.tokens) for s in states[name]), seconds=clock[name],
                       per_user=[len(s.tokens) / finished_at[name][i] for i, s in enumerate(states[name])],
                       committed=sum(sum(s.stats.accept_lengths) for s in states[name]),
                       rounds=sum(s.stats.rounds for s in states[name]),
                       outputs=[s.tokens for s in states[name]])
            for name in engines}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench batching", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--drafter", required=True, help="a drafter checkpoint with a confidence head")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32],
                        help="requests decoded together, one run of each method per value")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the cold one")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        parser.error("--concurrency, --max-new-tokens and --repeats must be positive")

    target = Target.load(args.target)
    drafter = Drafter.from_pretrained(args.drafter, target)
    check_fits(ConfidenceScheduler, drafter)  # method (c)'s need, named before the target is profiled
    block = drafter.config.block_size
    sps = profile_sps(target, max_tokens=max(args.concurrency) * (block + 1))
    print(f"# {args.target} on {platform.machine()}, {torch.get_num_threads()} threads; drafter {args.drafter} "
          f"(block {block}, head {drafter.config.head}); {args.max_new_tokens} new tokens per request, greedy; "
          f"{args.repeats} timed runs after a cold one")
    print("\n| concurrency | method | total tokens/s | vs (a) | vs (a), each timed run | per-request tokens/s | tau | "
          "cold run: total tokens/s | same output as (a) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for concurrency in args.concurrency:
        engines = {"(a) autoregressive": DecodingEngine(target, None),
                   "(b) full block": DecodingEngine(target, drafter, policy=FullVerify()),
                   "(c) confidence-scheduled": DecodingEngine(target, drafter, policy=ConfidenceScheduler(sps)),
                   "(d) gated full block": DecodingEngine(target, drafter, policy=GatedFullVerify(sps))}
        prompts = [target.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(concurrency)]
        cold = lockstep(engines, prompts, args.max_new_tokens, "cold ")
        runs = [lockstep(engines, prompts, args.max_new_tokens, f"run {k} ") for k in range(args.repeats)]
        timed = {name: [run[name] for run in runs] for name in engines}

        def total(results: list[dict]) -> float:
            return sum(r["tokens"] for r in results) / sum(r["seconds"] for r in results)

        plain = timed["(a) autoregressive"]
        for name, results in timed.items():
            same = all(run[name]["outputs"] == run["(a) autoregressive"]["outputs"] for run in [cold, *runs])
            per_user = statistics.mean(speed for r in results for speed in r["per_user"])
            tau = sum(r["committed"] for r in results) / max(1, sum(r["rounds"] for r in results))
            each = [total([r]) / total([a]) for r, a in zip(results, plain)]  # the spread the VM's noise leaves
            print(f"| {concurrency} | {name} | {total(results):.1f} | {total(results) / total(plain):.2f} | "
                  f"{min(each):.2f}-{max(each):.2f} | {per_user:.1f} | {tau:.2f} | {total([cold[name]]):.1f} | {same} |",
                  flush=True)

