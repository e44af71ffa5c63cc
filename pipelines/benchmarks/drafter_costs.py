"""What a drafter costs on the embedded target: parameters per head kind, and the time of one draft
forward against one target decode step and one target verification of a whole block.

    python -m pipelines.benchmarks.drafter_costs [--target smollm2-135m] [--layers 2] [--block-size 16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from domino.config import HEAD_KINDS, DrafterConfig
from domino.drafter import ContextCache, Drafter
from domino.sampling import GREEDY, RowSampling
from domino.target import DEFAULT_TARGET, Target


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--layers", type=int, default=2, help="draft layers")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rank", type=int, nargs="+", default=[64, 256], help="head ranks to count")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the caches")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    target = Target.load(args.target)
    print(f"# target {args.target}: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}")
    print(f"# machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("\n| head | rank | drafter parameters | of which head | head vs backbone |")
    print("| --- | --- | --- | --- | --- |")
    for rank in args.rank:
        for head in HEAD_KINDS:
            config = DrafterConfig.for_target(target, num_layers=args.layers, block_size=args.block_size,
                                              head=head, rank=rank)
            drafter = Drafter(config, target.embed_tokens, target.lm_head)
            total = sum(p.numel() for p in drafter.parameters())
            in_head = sum(p.numel() for p in drafter.head.parameters()) if drafter.head is not None else 0
            print(f"| {head} | {rank} | {total / 1e6:.2f} M | {in_head / 1e6:.2f} M | +{100 * in_head / (total - in_head):.0f} % |")

    # timing, at a context of args.context tokens
    ids = torch.randint(0, target.vocab_size, (1, args.context))
    config = DrafterConfig.for_target(target, num_layers=args.layers, block_size=args.block_size, head="domino", rank=64)
    drafter = Drafter(config, target.embed_tokens, target.lm_head).eval()
    cache = target.new_cache()
    features = target.forward(ids, cache, layer_ids=config.target_layer_ids).features
    context = ContextCache()
    with torch.no_grad():
        drafter.extend_context(context, features, torch.arange(args.context)[None])
    anchor = ids[:, -1]
    one, block = ids[:, :1], ids[:, : args.block_size + 1]

    def target_step(tokens):
        target.forward(tokens, cache, layer_ids=config.target_layer_ids)
        cache.crop(-tokens.shape[1])

    timings = {
        "draft one block (backbone + Domino head, greedy)": median_seconds(lambda: drafter.draft(context, anchor, RowSampling([GREEDY], [None])), args.repeats),
        "target decode step (1 token)": median_seconds(lambda: target_step(one), args.repeats),
        f"target verify ({args.block_size + 1} tokens)": median_seconds(lambda: target_step(block), args.repeats),
    }
    step = timings["target decode step (1 token)"]
    print(f"\n| operation (context {args.context}) | median ms | vs decode step |")
    print("| --- | --- | --- |")
    for name, seconds in timings.items():
        print(f"| {name} | {1000 * seconds:.1f} | {seconds / step:.2f}x |")


if __name__ == "__main__":
    main()
