"""The decoding loop's speed on the embedded target: plain autoregressive decoding against the oracle
drafter (the target's own greedy continuation, so every draft is accepted) through the same loop.
Methods alternate prompt by prompt, each prompt starting with the next method, so all see the same
machine load; each method first decodes a few tokens untimed (allocator, caches, packed weights).

    python -m pipelines.bench engine [--block-size N] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from domino.config import DEFAULT_BLOCK_SIZE
from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.drafter import Drafter
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks import TARGET_HELP, HelpFormatter, rotated

PROMPTS = [
    "Write a short poem about the ocean.",
    "Explain how photosynthesis works in simple terms.",
    "Write a Python function that checks whether a number is prime.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h? Explain step by step.",
    "Give me three tips for learning a new language.",
    "Describe the water cycle.",
]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench engine", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="the oracle's draft length")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--drafter", action="append", default=[], help="also time this drafter checkpoint")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"prompts to decode (at most {len(PROMPTS)})")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")

    target = Target.load(args.target)
    methods = {"autoregressive": SpeculativeDecoder(target, None),
               f"oracle (block {args.block_size})": SpeculativeDecoder(target, "oracle", args.block_size)}
    for path in args.drafter:
        methods[f"drafter {path}"] = SpeculativeDecoder(target, Drafter.from_pretrained(path, target))
    totals = {name: dict(tokens=0, time=0.0, prefill=0.0, draft=0.0, verify=0.0, other=0.0, rounds=0, committed=0)
              for name in methods}
    outputs: dict[str, list[list[int]]] = {name: [] for name in methods}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for decoder in methods.values():  # untimed
        decoder.generate(target.encode_prompt(PROMPTS[0]), GenerationConfig(max_new_tokens=8))
    names = list(methods)
    for i, prompt in enumerate(PROMPTS[:args.prompts]):
        ids = target.encode_prompt(prompt)
        print(f"  prompt {i + 1}/{args.prompts}", file=sys.stderr, flush=True)
        for name in rotated(names, i):
            result = methods[name].generate(ids, config)
            s, t = result.stats, totals[name]
            outputs[name].append(result.tokens)
            t["tokens"] += s.new_tokens
            t["time"] += s.total_s
            t["prefill"] += s.prefill_s
            t["draft"] += s.draft_s
            t["verify"] += s.verify_s
            t["other"] += s.other_s
            t["rounds"] += s.rounds
            t["committed"] += sum(s.accept_lengths)

    print(f"# {target.name} on {platform.machine()}, {torch.get_num_threads()} threads; {args.prompts} prompts, "
          f"max {args.max_new_tokens} new tokens, greedy")
    print("\n| method | tokens/s | speedup | tau | prefill | draft | verify | other | output = baseline |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    baseline = totals["autoregressive"]["tokens"] / totals["autoregressive"]["time"]
    for name, t in totals.items():
        speed = t["tokens"] / t["time"]
        share = {k: 100 * t[k] / t["time"] for k in ("prefill", "draft", "verify", "other")}
        same = outputs[name] == outputs["autoregressive"]
        print(f"| {name} | {speed:.1f} | {speed / baseline:.2f}x | {t['committed'] / max(1, t['rounds']):.2f} | "
              f"{share['prefill']:.0f}% | {share['draft']:.0f}% | {share['verify']:.0f}% | {share['other']:.1f}% | {same} |")

