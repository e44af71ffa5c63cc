"""A long prompt arriving with short requests: how long the short ones wait when the engine prefills the
long prompt in chunks (its default, `prefill_chunk`) and when it prefills it all at once. Plain
decoding on the embedded target, one engine per setting, the settings alternating repeat by repeat
after an untimed warm-up; the long prompt is ShareGPT text, the short ones the first prompts of the engine benchmark.

    python -m pipelines.bench prefill [--long-tokens 7800] [--short 2] [--max-new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from domino.engine import PREFILL_CHUNK, DecodingEngine
from domino.errors import DominoError
from domino.requests import GenerationConfig
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks import TARGET_HELP, HelpFormatter
from pipelines.benchmarks.engine import PROMPTS
from pipelines.benchmarks.prompts import load_prompt_set


def long_prompt(target: Target, tokens: int) -> list[int]:
    text = "\n\n".join(turn for conversation in load_prompt_set("sharegpt", 400).conversations for turn in conversation)
    ids = target.tokenizer(text)["input_ids"]
    if len(ids) < tokens:
        raise DominoError(f"the ShareGPT prompts hold {len(ids)} tokens, fewer than --long-tokens {tokens}")
    return ids[:tokens]


def serve_once(target: Target, chunk: int, long_ids: list[int], short: list[list[int]], new_tokens: int) -> dict:
    """The long prompt queued first, the short ones right after it; seconds from then until each
    request's first token and its last."""
    engine = DecodingEngine(target, None, prefill_chunk=chunk)
    config = GenerationConfig(max_new_tokens=new_tokens, stop_token_ids=[])
    engine.add("long", long_ids, config)
    for i, ids in enumerate(short):
        engine.add(f"short{i}", ids, config)
    start, first, done = time.perf_counter(), {}, {}
    while engine.has_work:
        for event in engine.step():
            now = time.perf_counter() - start
            if event.tokens:
                first.setdefault(event.request_id, now)
            if event.finished:
                done[event.request_id] = now
    shorts = [f"short{i}" for i in range(len(short))]
    return {"short first token": statistics.mean(first[r] for r in shorts),
            "short done": statistics.mean(done[r] for r in shorts),
            "long first token": first["long"], "all done": max(done.values())}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench prefill", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--long-tokens", type=int, default=7800, help="tokens of the long prompt")
    parser.add_argument("--short", type=int, default=2, help="short requests queued right after it")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of each setting (an even number lets each go first equally often)")
    args = parser.parse_args(argv)
    if min(args.long_tokens, args.short, args.max_new_tokens, args.repeats) < 1 or args.short > len(PROMPTS):
        parser.error(f"--long-tokens, --short, --max-new-tokens and --repeats must be positive, --short at most {len(PROMPTS)}")

    target = Target.load(args.target)
    long_ids = long_prompt(target, args.long_tokens)
    short = [target.encode_prompt(prompt) for prompt in PROMPTS[:args.short]]
    settings = {f"chunks of {PREFILL_CHUNK}": PREFILL_CHUNK, "all at once": args.long_tokens}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    serve_once(target, PREFILL_CHUNK, long_ids[:PREFILL_CHUNK], short, 4)  # untimed: allocator, caches, weights
    for repeat in range(args.repeats):
        for name, chunk in (settings.items() if repeat % 2 == 0 else reversed(settings.items())):
            runs[name].append(serve_once(target, chunk, long_ids, short, args.max_new_tokens))
            print(f"repeat {repeat + 1}, {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in runs[name][-1].items()),
                  flush=True)

    keys = list(runs[next(iter(runs))][0])
    print(f"\n# a {args.long_tokens}-token prompt and {args.short} short requests queued together, "
          f"{args.max_new_tokens} new tokens each, plain decoding; mean of {args.repeats} repeats, seconds")
    print("| prefill | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for name, results in runs.items():
        print(f"| {name} | " + " | ".join(f"{statistics.mean(r[k] for r in results):.1f}" for k in keys) + " |")
