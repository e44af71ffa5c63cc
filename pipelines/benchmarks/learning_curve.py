"""How much a drafter learns per CPU minute: held-out tau against training cost, one variant at a time.

    python -m pipelines.bench learning-curve [--variants base vocab-full ...] [--steps 300]
        [--conversations 1200] [--out docs/img/learning-curve.png]
    python -m pipelines.bench learning-curve --checkpoints ~/domino-runs/NAME/step_*/drafter

Every variant trains on the same embedded ShareGPT conversations in the same order with the same seed,
in one process (the library's objective and loop, no Ray), and changes one thing against `base`. The
cost axis is what a variant spends on one core, measured: the target's forward for its features (and
its labels), the regeneration of answers when the variant trains on them, and the drafter's steps.
Features of a data set are computed once and reused by the variants that read the same layers, each
charged the measured time. Held-out tau is the greedy acceptance at every position of answers the
target wrote to held-out ShareGPT prompts (domino.acceptance): what verification would accept there;
it is measured again with each text's features shuffled by position, which shows whether the drafter
reads the target's states one by one or only as a bag. `--checkpoints` measures drafters a training
run saved (keep_checkpoints bounds how many it keeps) on the same held-out answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from domino.acceptance import greedy_accepted
from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.objective import DraftingObjective, ObjectiveConfig, curriculum_lambda
from domino.target import DEFAULT_TARGET, Target, resolve_target
from domino.training import AdamWStep, MetricsWindow, TrainConfig
from domino.vocabulary import count_tokens, most_frequent
from pipelines.benchmarks import TARGET_HELP, HelpFormatter
from pipelines.benchmarks.report import output_folder
from pipelines.training.data import TOO_LONG, embedded_sharegpt, embedded_sharegpt_tail, tokenize_batch
from pipelines.training.features import Regenerate, TargetFeatures
from pipelines.training.config import PipelineConfig
from pipelines.training.trainer import PadCollate


# every measurement also reports tau with the pipeline's default context lookup (domino.lookup), which
# needs no training: the drafter alone is what the variants change
LOOKUP_NGRAM = PipelineConfig.model_fields["lookup_ngram"].default


@dataclass(frozen=True)
class Variant:
    name: str
    data: str = "text"  # "text": ShareGPT's own answers; "regenerated": the target's answers to the first prompts
    labels: str = "target"  # "data": the text's next token; "target": the target's greedy choice there
    layer_ids: tuple[int, ...] = (27,)  # SmolLM2-135M's third-from-last of 30, as the variants' ids are its own
    anchors: int = 64
    head: str = "none"
    curriculum_fraction: float = 0.5
    draft_vocab_size: int = 8192
    block_size: int = 8
    lr: float = 2e-3
    distill: bool = False
    epochs: int = 1  # passes over fewer sequences in the same steps (the pipeline's `replay`)
    from_target: bool = False  # the draft layer starts as the target's layer after the feature layer
    compute_dtype: str = "float32"  # of the target making features and of the drafter's steps (autocast)


BASE = Variant("base")
VARIANTS = {v.name: v for v in [
    BASE,
    dataclasses.replace(BASE, name="vocab-full", draft_vocab_size=0),
    dataclasses.replace(BASE, name="vocab-4096", draft_vocab_size=4096),
    dataclasses.replace(BASE, name="anchors-16", anchors=16),
    dataclasses.replace(BASE, name="anchors-all", anchors=256),
    dataclasses.replace(BASE, name="labels-data", labels="data"),
    dataclasses.replace(BASE, name="regenerated", data="regenerated", labels="data"),
    dataclasses.replace(BASE, name="layer-14", layer_ids=(14,)),
    dataclasses.replace(BASE, name="layers-20-28", layer_ids=(20, 28)),
    dataclasses.replace(BASE, name="domino", head="domino"),
    dataclasses.replace(BASE, name="domino-no-curriculum", head="domino", curriculum_fraction=0.0),
    dataclasses.replace(BASE, name="markov", head="markov"),
    dataclasses.replace(BASE, name="markov-no-curriculum", head="markov", curriculum_fraction=0.0),
    dataclasses.replace(BASE, name="rnn", head="rnn"),
    dataclasses.replace(BASE, name="distill", distill=True, labels="data"),
    dataclasses.replace(BASE, name="lr-6e-4", lr=6e-4),
    dataclasses.replace(BASE, name="block-16", block_size=16),
    dataclasses.replace(BASE, name="epochs-3", epochs=3),
    dataclasses.replace(BASE, name="from-target", from_target=True),
    dataclasses.replace(BASE, name="bf16", compute_dtype="bfloat16"),
]}


@dataclass
class Sequences:
    """Training sequences of one data kind with what they cost to make (regeneration)."""
    ids: list[np.ndarray]
    masks: list[np.ndarray]
    seconds_each: float = 0.0


@dataclass
class Curve:
    variant: Variant
    points: list[dict] = field(default_factory=list)  # minutes, tokens, steps, tau


def sharegpt_rows(target_path: str, count: int, max_length: int) -> dict[str, list]:
    """The first `count` embedded ShareGPT conversations, tokenised as the training pipeline does."""
    return tokenize_batch(pa.table({"json_line": embedded_sharegpt(count)}), target_path, max_length)


def text_sequences(rows: dict[str, list]) -> Sequences:
    """The conversations fit to train on, as they are."""
    usable = [i for i, error in enumerate(rows["error"]) if not error]
    return Sequences([rows["input_ids"][i] for i in usable], [rows["loss_mask"][i] for i in usable])


def first_prompts(rows: dict[str, list]) -> list[str]:
    """The prompt before the first answer of every well-formed conversation (the target answers it)."""
    return [prompt for prompt, error in zip(rows["prompt"], rows["error"]) if error in ("", TOO_LONG)]


def object_column(values: list) -> np.ndarray:
    """A numpy object array of `values`, the form Ray Data hands the actors and the collate."""
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def regenerated_sequences(target_path: str, prompts: list[str], max_length: int, new_tokens: int) -> Sequences:
    regenerate = Regenerate(target_path, cpus=1, gpus=0, max_length=max_length, max_new_tokens=new_tokens)
    ids, masks, start = [], [], time.perf_counter()
    for i in range(0, len(prompts), 16):
        out = regenerate({"prompt": np.asarray(prompts[i:i + 16], dtype=object)})
        ids += out["input_ids"]
        masks += out["loss_mask"]
        print(f"  regenerated {len(ids)}/{len(prompts)} answers", flush=True)
    return Sequences(ids, masks, (time.perf_counter() - start) / max(len(ids), 1))


class FeatureStore:
    """Features (and target labels) of each sequence for one set of layers, made when a variant first
    reads them and then kept, with the seconds each sequence cost (target forward + regeneration)."""

    def __init__(self, target_path: str, sequences: Sequences, layer_ids: tuple[int, ...], target_labels: bool,
                 final_hidden: bool, compute_dtype: str):
        self.sequences = sequences
        self.actor = TargetFeatures(target_path, cpus=1, gpus=0, layer_ids=list(layer_ids), final_hidden=final_hidden,
                                    dtype="bfloat16", compute_dtype=compute_dtype, target_labels=target_labels)
        self.rows: dict[int, dict] = {}
        self.seconds: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.sequences.ids)

    def batch(self, picked: list[int]) -> tuple[list[dict], float]:
        """The rows of sequences `picked` and what making them cost."""
        missing = [i for i in picked if i not in self.rows]
        if missing:
            out = self.actor({"input_ids": object_column([self.sequences.ids[i] for i in missing]),
                              "loss_mask": object_column([self.sequences.masks[i] for i in missing])})
            for j, i in enumerate(missing):
                self.rows[i] = {key: out[key][j] for key in out if key != "target_seconds"}
                self.seconds[i] = out["target_seconds"][j] + self.sequences.seconds_each
        return [self.rows[i] for i in picked], sum(self.seconds[i] for i in picked)


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """The trainers' own padding collate, over rows kept by a FeatureStore."""
    columns = {key: object_column([row[key] for row in rows]) for key in rows[0]}
    return PadCollate("bfloat16")(columns)


class HeldOut:
    """Answers the target wrote to held-out prompts, with their features per set of layers (made once)."""

    def __init__(self, target: Target, sequences: Sequences):
        self.target = target
        self.texts = [(torch.from_numpy(i.astype(np.int64)), int(np.argmax(m))) for i, m in zip(sequences.ids, sequences.masks)]
        self.features: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def of_layers(self, layer_ids: list[int]) -> list[torch.Tensor]:
        key = tuple(layer_ids)
        if key not in self.features:
            self.features[key] = [self.target.forward(ids[None], layer_ids=layer_ids).features for ids, _ in self.texts]
        return self.features[key]


def held_out_acceptance(drafter: Drafter, held_out: HeldOut, shuffled: bool = False) -> tuple[float, list[float]]:
    """Over every answer position of the held-out target-written answers: tau (mean 1 + accepted
    length) and the share of rounds that accept at least k drafts, k = 1..B (acceptance by position).

    `shuffled`: each text's features in one fixed random order of positions. A drafter that reads the
    target state by state loses tau; one that reads only what the text is about, as a bag, does not."""
    drafter.eval()
    accepted = []
    for (ids, answer_start), features in zip(held_out.texts, held_out.of_layers(drafter.config.target_layer_ids)):
        if shuffled:
            features = features[:, torch.randperm(features.shape[1], generator=torch.Generator().manual_seed(0))]
        anchors = torch.arange(answer_start, ids.shape[0] - 1)
        accepted.append(greedy_accepted(drafter, features, ids, anchors))
    drafter.train()
    accepted = torch.cat(accepted)
    by_position = [float((accepted >= k).float().mean()) for k in range(1, drafter.config.num_drafts + 1)]
    return 1.0 + float(accepted.float().mean()), by_position


def train_variant(variant: Variant, target: Target, store: FeatureStore, counts: np.ndarray,
                  held_out: HeldOut, steps: int, batch_size: int, evaluations: int, seed: int = 0) -> Curve:
    config = DrafterConfig.for_target(target, num_layers=1, layer_ids=list(variant.layer_ids), block_size=variant.block_size,
                                      head=variant.head, rank=64, draft_vocab_size=variant.draft_vocab_size)
    vocabulary = most_frequent(counts, variant.draft_vocab_size) if variant.draft_vocab_size else None
    drafter = Drafter.initial(config, target, seed, vocabulary)
    if variant.from_target:
        drafter.start_from_target(target)
    train_config = TrainConfig(steps=steps, lr=variant.lr, objective=ObjectiveConfig(
        anchors_per_sequence=variant.anchors, curriculum_fraction=variant.curriculum_fraction, distill=variant.distill,
        compute_dtype=variant.compute_dtype))
    objective = DraftingObjective(drafter, train_config.objective, seed=seed)
    optimiser = AdamWStep(objective.parameters(), train_config)
    curve, spent, tokens, window = Curve(variant), 0.0, 0, MetricsWindow()
    every = max(1, steps // evaluations)
    for step in range(steps):
        distinct = min(len(store), max(batch_size, steps * batch_size // variant.epochs))
        picked = [(step * batch_size + i) % distinct for i in range(batch_size)]
        rows, made_in = store.batch(picked)
        batch = collate(rows)
        start = time.perf_counter()
        out = objective(batch, curriculum_lambda(step, steps, variant.curriculum_fraction))
        optimiser(out.loss)
        spent += time.perf_counter() - start + made_in
        tokens += int(batch["lengths"].sum())
        window.add(out.metrics)
        if (step + 1) % every == 0 or step + 1 == steps:
            point = {"step": step + 1, "minutes": spent / 60, "tokens": tokens, **held_out_measures(drafter, held_out),
                     "train_tau": window.summary()["tau"]}
            window.reset()
            curve.points.append(point)
            print(f"  {variant.name}: step {step + 1}/{steps}  {spent / 60:.1f} min  {tokens} tokens  "
                  f"held-out tau {point['tau']:.3f}, with context lookup {point['tau_lookup']:.3f}, features shuffled "
                  f"{point['tau_shuffled']:.3f}  (training, teacher-forced {point['train_tau']:.3f})", flush=True)
    return curve


def held_out_measures(drafter: Drafter, held_out: HeldOut) -> dict:
    """The curve's columns for one drafter: held-out tau of the learned drafter alone (with its acceptance
    by position), with context lookup, and with features shuffled. Leaves the drafter without lookup."""
    drafter.set_lookup(0)
    tau, by_position = held_out_acceptance(drafter, held_out)
    drafter.set_lookup(LOOKUP_NGRAM)
    tau_lookup, _ = held_out_acceptance(drafter, held_out)
    drafter.set_lookup(0)
    tau_shuffled, _ = held_out_acceptance(drafter, held_out, shuffled=True)
    return {"tau": tau, "tau_lookup": tau_lookup, "tau_shuffled": tau_shuffled, "acceptance": by_position}


def measure_checkpoints(drafters: dict[Path, Drafter], held_out: HeldOut) -> None:
    """The curve's columns for drafters a run saved (e.g. the main job's step_*/drafter folders), on the
    same held-out answers: how a long run's held-out tau grew, which its own log estimates on training data."""
    print(f"\n| checkpoint | held-out tau | with context lookup (n <= {LOOKUP_NGRAM}) | features shuffled | "
          f"held-out acceptance @1..4 |")
    print("| --- | --- | --- | --- | --- |")
    for folder, drafter in drafters.items():
        row = held_out_measures(drafter, held_out)
        print(f"| {folder} | {row['tau']:.3f} | {row['tau_lookup']:.3f} | {row['tau_shuffled']:.3f} | "
              f"{' '.join(f'{a:.2f}' for a in row['acceptance'][:4])} |", flush=True)


def plot(curves: list[Curve], path: Path, batch_size: int) -> None:
    """Held-out tau against steps (the same for every variant) and against measured cost, and each
    variant's final acceptance by block position (the suffix decay the heads are meant to cure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_cost, by_position) = plt.subplots(1, 3, figsize=(17, 5))
    for curve in curves:
        for axis, key in ((by_step, "step"), (by_cost, "minutes")):
            axis.plot([p[key] for p in curve.points], [p["tau"] for p in curve.points], marker="o", label=curve.variant.name)
        acceptance = curve.points[-1]["acceptance"]
        by_position.plot(range(1, len(acceptance) + 1), acceptance, marker="o", label=curve.variant.name)
    by_step.set_xlabel(f"drafter steps ({batch_size} sequences each)")
    by_cost.set_xlabel("cost on one core, minutes (target features + regeneration + drafter steps)")
    by_step.set_ylabel("held-out tau (greedy acceptance at every answer position)")
    by_cost.sharey(by_step)
    by_position.set_xlabel("block position k (after the last measurement)")
    by_position.set_ylabel("share of rounds accepting at least k drafts")
    for axis in (by_step, by_cost, by_position):
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench learning-curve", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--variants", nargs="+", default=["base"], choices=sorted(VARIANTS),
                        help="variants to train, each from the same seed and data")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each variant")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    parser.add_argument("--conversations", type=int, default=1200, help="ShareGPT conversations to draw from (in order, repeated when steps need more)")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per training sequence (the conversation's window)")
    parser.add_argument("--held-out", type=int, default=16, help="held-out prompts the target answers")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per target-written answer")
    parser.add_argument("--evaluations", type=int, default=5, help="held-out measurements per variant")
    parser.add_argument("--out", type=Path, default=None, help="PNG of tau against cost")
    parser.add_argument("--checkpoints", type=Path, nargs="+", default=None,
                        help="measure these saved drafters (DIR/step_*/drafter) on the held-out answers instead of training")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.conversations, args.max_length, args.held_out, args.evaluations) < 1:
        parser.error("--steps, --batch-size, --conversations, --max-length, --held-out and --evaluations must be positive")
    if args.new_tokens < 2:  # an answer of one token leaves no position to draft from
        parser.error(f"--new-tokens must be at least 2, got {args.new_tokens}")
    if args.out:  # refused now, not after hours of training
        output_folder(str(args.out.parent))

    torch.set_num_threads(1)
    target_path = resolve_target(args.target)
    target = Target.load(target_path)
    print(f"# {args.target} on {platform.processor() or platform.machine()}, 1 thread, torch {torch.__version__}")
    # a bad checkpoint is named before the held-out answers are written
    saved = {folder: Drafter.from_pretrained(folder, target) for folder in args.checkpoints or []}

    held_prompts = [json.dumps([{"role": "user", "content": p}]) for p in embedded_sharegpt_tail(args.held_out)]
    held = regenerated_sequences(target_path, held_prompts, args.max_length + args.new_tokens, args.new_tokens)
    held_out = HeldOut(target, held)
    if saved:
        measure_checkpoints(saved, held_out)
        return 0
    print(f"# {args.steps} steps x {args.batch_size} sequences per variant, seed 0", flush=True)

    rows = sharegpt_rows(target_path, args.conversations, args.max_length)
    sequences: dict[str, Sequences] = {}
    stores: dict[tuple, FeatureStore] = {}
    curves = []
    for name in args.variants:
        variant = VARIANTS[name]
        if variant.data not in sequences:
            print(f"# making the '{variant.data}' training data", flush=True)
            sequences[variant.data] = text_sequences(rows) if variant.data == "text" \
                else regenerated_sequences(target_path, first_prompts(rows), args.max_length, args.new_tokens)
        data = sequences[variant.data]
        key = (variant.data, variant.layer_ids, variant.labels == "target", variant.distill, variant.compute_dtype)
        if key not in stores:
            stores[key] = FeatureStore(target_path, data, variant.layer_ids, target_labels=key[2],
                                       final_hidden=variant.distill, compute_dtype=variant.compute_dtype)
        counts = count_tokens(zip(data.ids, data.masks), target.vocab_size)
        curves.append(train_variant(variant, target, stores[key], counts, held_out, args.steps, args.batch_size,
                                    args.evaluations))

    print(f"\n| variant | changes | minutes | tokens | held-out tau | with context lookup (n <= {LOOKUP_NGRAM}) | "
          f"features shuffled | held-out acceptance @1..4 | training tau |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for curve in curves:
        last = curve.points[-1]
        changed = {k: v for k, v in dataclasses.asdict(curve.variant).items()
                   if k != "name" and v != getattr(BASE, k)}
        print(f"| {curve.variant.name} | {changed or '-'} | {last['minutes']:.1f} | {last['tokens']} | "
              f"{last['tau']:.3f} | {last['tau_lookup']:.3f} | {last['tau_shuffled']:.3f} | {' '.join(f'{a:.2f}' for a in last['acceptance'][:4])} | {last['train_tau']:.3f} |")
    if args.out:
        plot(curves, args.out, args.batch_size)
        print(f"\nplot: {args.out}")
    return 0
