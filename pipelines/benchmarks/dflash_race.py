"""Our engine against z-lab's reference loop (`dflash_generate`, PyPI dflash==0.1.0) on the same
DFlash-format checkpoint, target, prompts and limits, greedy.

Batch 1: the two loops alternate prompt by prompt (who goes first alternates too), so both see the
same machine load; each prompt's time is wall time from the prompt's ids to its last token, prefill
included. tau is tokens per verify forward. Then our engine serves 8 and 32 concurrent requests
(the same prompts, cycled) against the reference loop serving them one request after another, which
is its batch-1 rate: its loop takes one request at a time. Concurrent rounds run under each verify
policy of `--policies`: `full` verifies every draft, as the reference does; `gated` also stops
drafting while drafted rounds lose to plain ones (which a random drafter's always do).

    python -m pipelines.bench dflash-race --drafter DIR [--max-new-tokens 32] [--concurrency 8 32]
        [--policies full gated]
    python -m pipelines.bench dflash-race --make-random DIR   # then run with --drafter DIR

`--make-random` writes a random 1-layer, block-8 drafter for the target in DFlash's format (through our
export), for a machine without a published DFlash drafter for its target: its drafts are rarely
accepted, so the race then measures the two loops' own costs.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from itertools import cycle, islice
from pathlib import Path

import torch
from dflash.model import DFlashDraftModel, dflash_generate

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.engine import DecodingEngine
from domino.errors import DominoError
from domino.export import export
from domino.formats import checkpoint_format
from domino.requests import GenerationConfig
from domino.scheduler import FullVerify, GatedFullVerify, profile_sps
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks import TARGET_HELP, HelpFormatter
from pipelines.benchmarks.engine import PROMPTS


def make_random(target: Target, out: str) -> None:
    config = DrafterConfig.for_target(target, num_layers=1, block_size=8, head="none", label_convention="dflash")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as ours:
        Drafter(config, target.embed_tokens, target.lm_head).save_pretrained(ours)
        print(f"wrote {export(ours, 'dflash', out)}")


def reference(model: DFlashDraftModel, target: Target, ids: list[int], max_new_tokens: int) -> dict:
    """One request through `dflash_generate`; its verify forwards are counted with a hook (its own
    statistics need CUDA timers)."""
    forwards = []
    hook = target.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        start = time.perf_counter()
        output = dflash_generate(model, target.model, torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 stop_token_ids=target.stop_token_ids)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    tokens = output[0, len(ids):].tolist()
    return dict(tokens=tokens, seconds=seconds, rounds=len(forwards) - 1, committed=len(tokens) - 1)


def ours(engine: DecodingEngine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Requests served together by our engine until all finish."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    states = [engine.add(f"r{i}", ids, config) for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    return dict(outputs=[s.tokens for s in states], seconds=seconds, rounds=sum(s.stats.rounds for s in states),
                committed=sum(sum(s.stats.accept_lengths) for s in states))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench dflash-race", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--drafter", help="a DFlash-format drafter folder for the target")
    parser.add_argument("--make-random", metavar="DIR", help="write a random DFlash drafter for the target and stop")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"batch-1 prompts (at most {len(PROMPTS)})")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 32], help="concurrent requests of the batched runs")
    parser.add_argument("--policies", nargs="+", choices=["full", "gated"], default=["full", "gated"],
                        help="verify policies of our engine for the concurrent runs")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 on a shared machine")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(PROMPTS)}, got {args.prompts}")
    if args.max_new_tokens < 1 or min(args.concurrency, default=1) < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--max-new-tokens, --concurrency and --threads must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)

    target = Target.load(args.target)
    if args.make_random:
        make_random(target, args.make_random)
        return
    if not args.drafter:
        parser.error("pass --drafter DIR (a DFlash-format folder), or --make-random DIR to write one")
    if checkpoint_format(Path(args.drafter)) != "dflash":  # first: it also names a missing folder
        raise DominoError(f"{args.drafter} is a domino checkpoint, and z-lab's loop reads DFlash ones: "
                          f"`python -m domino export --format dflash` writes one")
    drafter = Drafter.from_pretrained(args.drafter, target)  # before z-lab's loader: it names a mismatched target
    model = DFlashDraftModel.from_pretrained(args.drafter).to(target.model.dtype).eval()
    prompts = [target.encode_prompt(p) for p in PROMPTS[:args.prompts]]

    totals = {name: dict(tokens=0, seconds=0.0, rounds=0, committed=0) for name in ("reference", "ours")}
    same, alone = True, {}
    for i, ids in enumerate(prompts):
        runs = {}
        for name in (("reference", "ours") if i % 2 == 0 else ("ours", "reference")):
            if name == "reference":
                runs[name] = reference(model, target, ids, args.max_new_tokens)
            else:
                run = ours(DecodingEngine(target, drafter), [ids], args.max_new_tokens)
                runs[name] = dict(tokens=run["outputs"][0], **{k: run[k] for k in ("seconds", "rounds", "committed")})
        print(f"prompt {i}: " + ", ".join(f"{name} {len(run['tokens']) / run['seconds']:.2f} tokens/s"
                                          for name, run in runs.items()), flush=True)
        same &= runs["reference"]["tokens"] == runs["ours"]["tokens"]
        alone[tuple(ids)] = runs["ours"]["tokens"]
        for name, run in runs.items():
            totals[name]["tokens"] += len(run["tokens"])
            for key in ("seconds", "rounds", "committed"):
                totals[name][key] += run[key]

    print(f"# {args.target} on {platform.machine()}, {torch.get_num_threads()} threads; DFlash drafter "
          f"{args.drafter} (block {drafter.config.block_size}, {drafter.config.num_layers} layers); "
          f"{len(prompts)} prompts, max {args.max_new_tokens} new tokens, greedy")
    rate = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    print("\n| loop | tokens/s | vs reference | tau | outputs equal |")
    print("| --- | --- | --- | --- | --- |")
    for name, t in totals.items():
        print(f"| {'dflash_generate' if name == 'reference' else 'our engine'} | {rate[name]:.2f} | "
              f"{rate[name] / rate['reference']:.2f}x | {t['committed'] / max(1, t['rounds']):.2f} | {same} |")

    if args.concurrency:
        print("\n| concurrent requests | our policy | our total tokens/s | reference, one after another | ratio "
              "| tau | outputs = batch 1 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        sps = profile_sps(target) if "gated" in args.policies else None  # measured once, each run gets a fresh gate
        policies = {"full": FullVerify, "gated": lambda: GatedFullVerify(sps)}
        for n in args.concurrency:
            batch = list(islice(cycle(prompts), n))
            for policy in args.policies:
                engine = DecodingEngine(target, drafter, policy=policies[policy]())
                run = ours(engine, batch, args.max_new_tokens)
                total = sum(len(o) for o in run["outputs"]) / run["seconds"]
                equal = all(out == alone[tuple(ids)] for ids, out in zip(batch, run["outputs"]))
                print(f"| {n} | {policy} | {total:.2f} | {rate['reference']:.2f} | {total / rate['reference']:.2f}x | "
                      f"{run['committed'] / max(1, run['rounds']):.2f} | {equal} |", flush=True)

