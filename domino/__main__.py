"""Command line: `python -m domino generate --target smollm2-135m --drafter PATH --prompt "..."`, and
`python -m domino export --drafter PATH --format dflash|sglang-domino --out DIR`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from domino.config import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE
from domino.errors import DominoError
from domino.scheduler import POLICIES, ThresholdVerify
from domino.target import DEFAULT_TARGET


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m domino", description="Domino speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser(
        "generate", help="generate text, streaming tokens as they are committed",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate with lossless speculative decoding. Prints the text as it is committed, then "
                    "tau (tokens per target forward) and tokens/s on stderr.")
    generate.add_argument("--target", default=DEFAULT_TARGET,
                          help="model folder, hub id, or the embedded default")
    generate.add_argument("--drafter", default="none",
                          help="drafter checkpoint folder; 'none' decodes without one (the baseline); "
                               "'oracle' proposes the target's own greedy output (the loop's ceiling)")
    generate.add_argument("--prompt", required=True, default=argparse.SUPPRESS,
                          help="the user message (chat models) or raw prompt")
    generate.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens holding this much probability")
    generate.add_argument("--top-k", type=int, default=0, help="0 turns top-k off")
    generate.add_argument("--seed", type=int, default=None,
                          help="seed for sampling (temperature > 0); with --verify gated or confidence, which decide "
                               "by the target's measured speed, a seed's tokens can differ from run to run")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--no-chat", action="store_true", help="feed the prompt raw, without the chat template")
    generate.add_argument("--block-size", type=int, default=None,
                          help=f"draft length for --drafter oracle ({DEFAULT_BLOCK_SIZE} when unset); a checkpoint has its own")
    generate.add_argument("--verify", choices=POLICIES, default="full",
                          help="'full': verify every draft; 'gated': every draft, but draft only while drafting "
                               "beats plain decoding (profiles the target first); 'threshold': stop where the "
                               "confidence head's estimate that the prefix survives falls below --threshold; "
                               "'confidence': DSpark's scheduling against the target's profiled speed (gated "
                               "and confidence pay on CPUs, where a verify of a few tokens costs more than one step)")
    generate.add_argument("--threshold", type=float, default=ThresholdVerify.threshold,
                          help="for --verify threshold: the survival estimate below which a row stops verifying")
    export = commands.add_parser(
        "export", help="write a drafter in DFlash's or SGLang's Domino checkpoint format",
        description="Convert a drafter trained here for other engines: 'dflash' (z-lab's DFlashDraftModel, vLLM "
                    "method dflash, SGLang --speculative-algorithm DFLASH; drafters trained with label_convention "
                    "dflash and no head) or 'sglang-domino' (SGLang's Domino head; drafters trained with head "
                    "sglang-domino). A drafter the format cannot express is refused with the reason.")
    export.add_argument("--drafter", required=True, help="drafter checkpoint folder written by training")
    export.add_argument("--format", required=True, choices=["dflash", "sglang-domino"])
    export.add_argument("--out", required=True, help="folder to write (created if missing)")
    return parser


def run_generate(args: argparse.Namespace) -> None:
    # imported here so that --help and argument errors are instant
    from domino.decoding import GenerationConfig, SpeculativeDecoder
    from domino.drafter import load_drafter
    from domino.formats import checkpoint_format
    from domino.sampling import SamplingParams
    from domino.scheduler import make_policy
    from domino.target import Target

    if not args.prompt.strip():
        raise DominoError("the prompt is empty: pass --prompt \"...\"")
    if args.threshold != ThresholdVerify.threshold and args.verify != "threshold":
        raise DominoError(f"--threshold is read by --verify threshold only, and --verify is {args.verify}")
    if args.block_size is not None and args.drafter == "none":
        raise DominoError("--block-size sets the oracle's draft length; decoding without a drafter drafts nothing")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=args.stop, seed=args.seed,
                              sampling=SamplingParams(args.temperature, args.top_p, args.top_k))
    if args.drafter not in ("none", "oracle"):  # a wrong path is named before the target loads
        checkpoint_format(Path(args.drafter).expanduser())
    target = Target.load(args.target)
    drafter = load_drafter(args.drafter, target)
    # one request verifies at most a block and its anchor: profile forwards up to that size
    policy = make_policy(args.verify, target, threshold=args.threshold, max_tokens=MAX_BLOCK_SIZE)
    decoder = SpeculativeDecoder(target, drafter, block_size=args.block_size, policy=policy)
    prompt_ids = target.encode_prompt(args.prompt, chat=False if args.no_chat else None)
    result = decoder.generate(prompt_ids, config, on_tokens=lambda tokens, text: print(text, end="", flush=True))
    print()  # the text ends its line (a file it is written to ends with a newline)
    s = result.stats
    total = max(s.total_s, 1e-9)
    print(f"[{s.new_tokens} tokens in {s.total_s:.2f} s: {s.tokens_per_second:.1f} tokens/s, tau {s.tau:.2f} "
          f"over {s.rounds} rounds; prefill {100 * s.prefill_s / total:.0f}%, draft {100 * s.draft_s / total:.0f}%, "
          f"verify {100 * s.verify_s / total:.0f}%, other {100 * s.other_s / total:.0f}%; "
          f"finish: {result.finish_reason}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "export":
            from domino.config import DrafterConfig
            from domino.export import export, lost_in_export
            from domino.formats import CONFIG_NAME

            print(f"wrote {export(args.drafter, args.format, args.out)} ({args.format})")
            for note in lost_in_export(DrafterConfig.load(Path(args.drafter) / CONFIG_NAME)):
                print(f"note: {note}")
    except DominoError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # stdout's reader stopped (`| head`): end quietly, as a program killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not raise again
        sys.exit(141)


if __name__ == "__main__":
    main()
