"""Every benchmark, one command: `python -m pipelines.bench COMMAND [options]` (COMMAND --help for each).

Speed and memory are measured here, never asserted in tests; docs/benchmarks.md records what each
command printed, with the machine it ran on.
"""

from __future__ import annotations

import importlib
import sys

from pipelines.training.errors import exit_status

# command -> (module under pipelines.benchmarks, its function taking the command's arguments, what it measures)
COMMANDS = {
    "run": ("side_by_side", "run", "decoding methods side by side on prompt sets: tokens/s, tau, lossless"),
    "ablation": ("side_by_side", "ablation", "train Domino's head ablation with the pipeline, then run its drafters"),
    "engine": ("engine", "main", "the decoding loop alone at batch 1: plain, oracle drafts and drafter checkpoints"),
    "batching": ("batching", "main", "continuous batching of concurrent requests against one at a time"),
    "prefill": ("prefill", "main", "short requests beside a long prompt: chunked prefill against all at once"),
    "load": ("load", "main", "concurrent OpenAI clients against live Serve endpoints: latency and errors"),
    "pipeline": ("pipeline", "main", "the training pipeline's throughput and memory (no feature cache)"),
    "drafter-costs": ("drafter_costs", "main", "one draft against one target decode step"),
    "dflash-race": ("dflash_race", "main", "our engine against z-lab's dflash_generate on one DFlash checkpoint"),
    "learning-curve": ("learning_curve", "main", "held-out tau against training minutes, one variant at a time"),
    "gpu-check": ("gpu_check", "main", "the pipeline on one GPU with a random Qwen3-shaped target"),
    "gpu-drafter": ("gpu_drafter", "main", "the pipeline's drafter trained for minutes on one GPU, for CPU benchmarks"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()]
    return __doc__ + "\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown benchmark '{command}'\n\n{usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[command]
    # bad input named in one line, and Ctrl-C, whichever benchmark met them
    return exit_status(lambda: getattr(importlib.import_module(f"pipelines.benchmarks.{module}"), function)(rest))


if __name__ == "__main__":
    sys.exit(main())
