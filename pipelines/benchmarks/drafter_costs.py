"""What a drafter costs on the embedded target: parameters per head kind, and the time of one draft
forward per head kind against one target decode step and one target verification of a whole block, the
drafter's and the target's linear layers packed for oneDNN (as float32 models loaded on a CPU run) and, last,
the target's dense. The drafter's shape defaults to the training pipeline's default
(pipelines/training/config.py); drafts are timed with the target's whole vocabulary and with the reduced
draft vocabulary, per head kind.

    python -m pipelines.bench drafter-costs [--target smollm2-135m] [--layers 1] [--block-size 8]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time

import torch

from domino.config import HEAD_KINDS, DrafterConfig
from domino.drafter import ContextCache, Drafter
from domino.errors import DominoError
from domino.packed_linear import pack_linear_layers, unpack_linear_layers
from domino.sampling import GREEDY, RowSampling
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks import TARGET_HELP, HelpFormatter
from pipelines.training.config import PipelineConfig


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench drafter-costs", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    default = PipelineConfig()
    parser.add_argument("--layers", type=int, default=default.draft_layers, help="draft layers")
    parser.add_argument("--block-size", type=int, default=default.block_size, help="tokens per drafted block")
    parser.add_argument("--rank", type=int, nargs="+", default=[default.rank, 256], help="head ranks to count")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[0, default.draft_vocab_size],
                        help="draft vocabulary sizes to time (0: the target's whole vocabulary)")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the caches")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each piece")
    args = parser.parse_args(argv)
    if min(args.layers, args.block_size, args.context, args.repeats, *args.rank) < 1 or min(args.draft_vocab) < 0:
        parser.error("--layers, --block-size, --rank, --context and --repeats must be positive, --draft-vocab not negative")

    torch.manual_seed(0)
    target = Target.load(args.target)
    if args.context + args.block_size + 1 > target.max_length:
        raise DominoError(f"--context {args.context} and a verify of {args.block_size + 1} tokens pass the target's "
                          f"{target.max_length}-token context")
    # every drafter shape below is checked first, so that a bad one is not found with a table half printed
    for head, rank, vocab in itertools.product(HEAD_KINDS, args.rank, args.draft_vocab):
        DrafterConfig.for_target(target, num_layers=args.layers, block_size=args.block_size, head=head, rank=rank,
                                 draft_vocab_size=vocab)
    print(f"# target {args.target}: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}")
    print(f"# machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("\n| head | rank | drafter parameters | of which head | head vs backbone |")
    print("| --- | --- | --- | --- | --- |")
    for rank in args.rank:
        for head in HEAD_KINDS:
            config = DrafterConfig.for_target(target, num_layers=args.layers, block_size=args.block_size,
                                              head=head, rank=rank, draft_vocab_size=args.draft_vocab[-1])
            drafter = Drafter(config, target.embed_tokens, target.lm_head)
            total = sum(p.numel() for p in drafter.parameters())
            in_head = sum(p.numel() for p in drafter.head.parameters()) if drafter.head is not None else 0
            print(f"| {head} | {rank} | {total / 1e6:.2f} M | {in_head / 1e6:.2f} M | +{100 * in_head / (total - in_head):.0f} % |")

    # timing, at a context of args.context tokens
    ids = torch.randint(0, target.vocab_size, (1, args.context))
    layer_ids = DrafterConfig.for_target(target, num_layers=args.layers).target_layer_ids
    cache = target.new_cache()
    features = target.forward(ids, cache, layer_ids=layer_ids).features
    anchor = ids[:, -1]
    one, block = ids[:, :1], ids[:, : args.block_size + 1]

    def target_step(tokens):
        target.forward(tokens, cache, layer_ids=layer_ids)
        cache.crop(-tokens.shape[1])

    def draft_seconds(head: str, vocab: int) -> float:
        config = DrafterConfig.for_target(target, num_layers=args.layers, block_size=args.block_size, head=head,
                                          rank=args.rank[0], draft_vocab_size=vocab)
        drafter = Drafter(config, target.embed_tokens, target.lm_head).eval()
        pack_linear_layers(drafter)  # as a loaded drafter runs
        context = ContextCache()
        with torch.no_grad():
            drafter.extend_context(context, features, torch.arange(args.context)[None])
        return median_seconds(lambda: drafter.draft(context, anchor, RowSampling([GREEDY], [None])), args.repeats)

    timings = {"target decode step (1 token)": median_seconds(lambda: target_step(one), args.repeats),
               f"target verify ({args.block_size + 1} tokens)": median_seconds(lambda: target_step(block), args.repeats)}
    for head in HEAD_KINDS:
        for vocab in args.draft_vocab:
            name = f"draft one block of {args.block_size}: head {head}, " + (f"draft vocabulary {vocab}" if vocab else "whole vocabulary")
            print(f"  timing: {name}", file=sys.stderr, flush=True)  # the table waits for every timing
            timings[name] = draft_seconds(head, vocab)
    if unpack_linear_layers(target.model):
        timings["target decode step (1 token), dense weights"] = median_seconds(lambda: target_step(one), args.repeats)
        timings[f"target verify ({args.block_size + 1} tokens), dense weights"] = median_seconds(lambda: target_step(block), args.repeats)
    step = timings["target decode step (1 token)"]
    print(f"\n| operation (context {args.context}, {args.layers} draft layer(s), rank {args.rank[0]}) | median ms | vs decode step |")
    print("| --- | --- | --- |")
    for name, seconds in timings.items():
        print(f"| {name} | {1000 * seconds:.1f} | {seconds / step:.2f}x |")

