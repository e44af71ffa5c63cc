"""Decoding methods side by side on real prompt sets (`python -m pipelines.bench run` and `ablation`).

    python -m pipelines.bench run --datasets humaneval mt-bench gsm --methods autoregressive hf-generate \\
        prompt-lookup oracle domino=$HOME/domino-runs/smollm2-sharegpt/step_000320/drafter --prompts 10 --max-new-tokens 128 --out results/bench

Every method sees the same target, prompts and limits in one run; speedups are against plain
autoregressive decoding from the same run. Greedy by default, where "lossless" says whether a
method's outputs equal plain decoding's; `--temperature 1` samples instead (speculative sampling,
seeded per turn), where outputs differ from plain decoding's by design and exactness is the
statistical tests' job (tests/test_sampling*.py).
Writes results.json, results.md and two plots (acceptance by position, speedup per dataset).

`ablation` first trains, through the training pipeline, one drafter per variant of Domino's ablation
(heads none, markov, rnn, domino, and domino without the base-anchored curriculum) on the same data
and budget, then benchmarks them together, without context lookup unless `--lookup N` asks for it (the
copies would hide the heads). `--train key=value ...` sets that budget with the pipeline's own config
keys (python pipelines/train.py --help), e.g. --train steps=120.
"""

from __future__ import annotations

import argparse
import shlex

from tqdm.auto import tqdm

from domino.config import DEFAULT_BLOCK_SIZE
from domino.errors import DominoError
from domino.sampling import SamplingParams
from domino.scheduler import POLICIES
from domino.target import DEFAULT_TARGET, Target
from pipelines.benchmarks import TARGET_HELP, HelpFormatter, rotated
from pipelines.benchmarks.methods import BUILTIN, Method, check_unique_names, make_methods
from pipelines.benchmarks.prompts import EMBEDDED, PromptSet, load_prompt_set
from pipelines.benchmarks.report import BASELINE, Row, compare_with_baseline, markdown, output_folder, write


def parse_args(argv: list[str], ablation: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m pipelines.bench {'ablation' if ablation else 'run'}",
                                     description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mt-bench", "gsm"],
                        help=f"embedded sets ({', '.join(EMBEDDED)}) or turns-JSONL files")
    parser.add_argument("--methods", nargs="+", default=["autoregressive", "hf-generate", "prompt-lookup", "oracle"],
                        help=f"{', '.join(BUILTIN)}, or drafter checkpoints as PATH or NAME=PATH")
    parser.add_argument("--prompts", type=int, default=10, help="conversations per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per turn")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="for the oracle")
    parser.add_argument("--verify", choices=POLICIES, nargs="+", default=["full"],
                        help="how many of its drafts a drafter's round verifies (threshold and confidence need "
                             "a confidence head; gated and confidence profile the target's steps per second "
                             "first and draft only while drafting pays); several: each drafter once per policy")
    # the ablation compares heads: copies from the text would hide them
    parser.add_argument("--lookup", type=int, default=0 if ablation else None, metavar="N",
                        help="override the drafters' context lookup: copy drafts after repeats of up to N tokens "
                             "(0: the learned drafter alone" + (")" if ablation else "; left out: each checkpoint's own setting)"))
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample (seeded)")
    parser.add_argument("--seed", type=int, default=0, help="with --temperature: turn t of conversation c samples with seed + 100 c + t")
    parser.add_argument("--out", default="results/bench", help="output folder")
    if ablation:
        parser.add_argument("--train", nargs="*", default=[], metavar="KEY=VALUE",
                            help="training-pipeline config for the ablation (same for every variant)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be positive")
    try:
        args.sampling = SamplingParams(temperature=args.temperature)
    except DominoError as error:
        parser.error(str(error))
    return args


# Domino's ablation: the same backbone, data and budget; only the head (and the curriculum) differ.
ABLATION = {
    "head-none": {"head": "none"},
    "head-markov": {"head": "markov"},
    "head-rnn": {"head": "rnn"},
    "head-domino": {"head": "domino"},
    "domino-no-curriculum": {"head": "domino", "curriculum_fraction": 0.0},
}


def train_ablation(train_args: list[str]) -> list[str]:
    """Train every ablation variant with the pipeline; return their drafters as NAME=PATH method specs."""
    from pipelines.training import checkpoints
    from pipelines.training.config import build_config, parse_args
    from pipelines.train import run

    base = parse_args(train_args).model_dump(exclude_unset=True)
    specs = []
    for name, overrides in ABLATION.items():
        cfg = build_config({**base, **overrides, "run_name": f"{base.get('run_name', 'ablation')}-{name}",
                            "eval_prompts": 0})
        print(f"[ablation] training {name}: {overrides}", flush=True)
        run(cfg)
        uri = checkpoints.latest(cfg).drafter_uri
        if "://" in uri:
            raise DominoError(f"the ablation benchmarks drafters from local storage; {uri} is remote")
        specs.append(f"{name}={uri}")
    return specs


def run_conversation(method: Method, turns: list[str], max_new_tokens: int, seed: int) -> list:
    """Each user turn in order, with the method's own answers fed back as assistant turns; turn i
    samples with seed + i."""
    target, messages, outputs = method.target, [], []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        output = method.generate(target.encode_prompt(messages), max_new_tokens, seed + i)
        outputs.append(output)
        messages.append({"role": "assistant", "content": target.tokenizer.decode(output.tokens, skip_special_tokens=True)})
    return outputs


def benchmark(target: Target, methods: list[Method], prompt_sets: list[PromptSet], max_new_tokens: int,
              seed: int = 0) -> list[Row]:
    rows: dict[tuple[str, str], Row] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    warm_up = target.encode_prompt("Hello!")
    for method in methods:  # first calls pay one-off costs (allocations, lazy imports): not timed
        method.generate(warm_up, 4)
    total = sum(len(ps.conversations) for ps in prompt_sets) * len(methods)
    with tqdm(total=total, desc="bench", dynamic_ncols=True) as bar:
        for prompt_set in prompt_sets:
            for number, turns in enumerate(prompt_set.conversations):
                # alternate methods prompt by prompt, each prompt starting with the next one: they see the
                # same machine load, and none always runs first
                for method in rotated(methods, number):
                    key = (method.name, prompt_set.name)
                    row = rows.setdefault(key, Row(method.name, prompt_set.name))
                    for output in run_conversation(method, turns, max_new_tokens, seed + 100 * number):
                        row.add(output)
                        outputs.setdefault(key, []).append(output.tokens)
                    bar.update()
    compare_with_baseline(rows, outputs, exact=all(m.sampling.greedy for m in methods))
    return list(rows.values())


def run(argv: list[str]) -> int:
    return benchmark_command(argv, ablation=False)


def ablation(argv: list[str]) -> int:
    return benchmark_command(argv, ablation=True)


def benchmark_command(argv: list[str], ablation: bool) -> int:
    """`run` or `ablation`: (train,) benchmark, then write and print the report."""
    args = parse_args(argv, ablation)
    out = output_folder(args.out)
    prompt_sets = [load_prompt_set(spec, args.prompts) for spec in args.datasets]
    drafters = train_ablation(args.train) if ablation else []
    target = Target.load(args.target)
    specs = list(dict.fromkeys([BASELINE] + args.methods + drafters))  # plain decoding is the reference
    methods = [method for spec in specs
               for method in make_methods(spec, target, args.block_size, args.verify, args.sampling, args.lookup)]
    check_unique_names(methods)
    rows = benchmark(target, methods, prompt_sets, args.max_new_tokens, args.seed)
    command = f"python -m pipelines.bench {'ablation' if ablation else 'run'} " + shlex.join(argv)
    files = write(rows, out, command)
    print(markdown(rows))
    print("\nwrote " + ", ".join(str(p) for p in files.values()))
    return 0

