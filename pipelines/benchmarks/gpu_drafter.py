"""Is the drafter short of compute? The pipeline's drafter trained in one process on one GPU for a fixed
time, many times the CPU recipes' steps, saving drafters that `run` and `learning-curve --checkpoints`
then measure on CPU. Two halves, because a GPU machine may have neither Ray nor the embedded data:

    python -m pipelines.bench gpu-drafter prepare --out DIR [key=value ...]    # here: data and config
    python -m pipelines.bench gpu-drafter train --data DIR --out DIR [--minutes 6] [--target PATH]

`prepare` tokenises the embedded ShareGPT conversations as the pipeline does (its `max_length` and
chat template), leaving out the first `--skip-head` (the pipeline's closing table holds out the first
prompts) and the last `--skip-tail` (the benchmarks' ShareGPT prompts come from the end), counts the
draft vocabulary, and resolves the pipeline's drafter and training config (key=value as for
pipelines/train.py). `train` imports only domino, torch and numpy: each step runs the target on a
batch for its features and greedy labels (the pipeline's `labels: target`), then one step of the
library's objective and loop under the loop's time budget: the steps, and with them the cosine schedule,
fill `--minutes`. It saves the drafter at a quarter, half and all of the steps.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.errors import DominoError
from domino.objective import DraftingObjective
from domino.target import DEFAULT_TARGET, Target, resolve_target
from domino.training import TrainConfig, train
from pipelines.benchmarks import HelpFormatter

DATA, CONFIG = "data.npz", "config.json"
MOST_STEPS = 10 ** 7  # the run's length is set by --minutes alone


def prepare(args: argparse.Namespace, overrides: list[str]) -> None:
    """Tokenised conversations and the resolved config, written where `train` reads them."""
    import pyarrow as pa

    from domino.vocabulary import count_tokens, most_frequent
    from pipelines.training.config import parse_args
    from pipelines.training.data import embedded_sharegpt, tokenize_batch
    from pipelines.training.trainer import drafter_config, train_config

    cfg = parse_args(overrides)
    target_path = resolve_target(cfg.target)
    target = Target.load(target_path)
    every = embedded_sharegpt(0)
    lines = every[args.skip_head: len(every) - args.skip_tail][: args.conversations or None]
    if not lines:
        raise DominoError(f"--skip-head {args.skip_head} and --skip-tail {args.skip_tail} leave none of the "
                          f"{len(every)} conversations")
    ids, masks = [], []
    for start in range(0, len(lines), 1000):
        rows = tokenize_batch(pa.table({"json_line": lines[start:start + 1000]}), target_path, cfg.max_length)
        usable = [i for i, error in enumerate(rows["error"]) if not error]
        ids += [rows["input_ids"][i] for i in usable]
        masks += [rows["loss_mask"][i] for i in usable]
        print(f"  tokenised {start + len(rows['error'])}/{len(lines)} conversations, {len(ids)} usable", flush=True)
    vocabulary = None
    if cfg.draft_vocab_size:
        counts = count_tokens(zip(ids, masks), target.vocab_size)
        vocabulary = most_frequent(counts, cfg.draft_vocab_size).tolist()
    args.out.mkdir(parents=True, exist_ok=True)
    flat, flat_mask = np.concatenate(ids), np.concatenate(masks)
    if flat.max() >= 2 ** 16:
        raise DominoError("token ids past 65535: this script stores them as uint16")
    np.savez_compressed(args.out / DATA, ids=flat.astype(np.uint16), lengths=np.array([len(i) for i in ids], np.int32),
                        mask=np.packbits(flat_mask))
    settings = {"drafter": asdict(drafter_config(cfg, target)), "train": asdict(train_config(cfg, torch.device("cuda"))),
                "draft_vocabulary": vocabulary, "batch_size": cfg.batch_size, "seed": cfg.seed,
                "feature_dtype": cfg.feature_dtype, "pipeline": cfg.model_dump()}
    (args.out / CONFIG).write_text(json.dumps(settings, indent=1) + "\n")
    print(f"{len(ids)} sequences, {len(flat)} tokens ({int(flat_mask.sum())} answer tokens) -> {args.out}")


class Batches:
    """Batches of the prepared sequences in a fresh seeded order each pass, with the target's features
    and greedy next tokens computed on the GPU (no transport: they never leave it)."""

    def __init__(self, folder: Path, target: Target, config: DrafterConfig, batch_size: int, feature_dtype: str, seed: int):
        data = np.load(folder / DATA)
        ends = np.cumsum(data["lengths"])
        flat_mask = np.unpackbits(data["mask"])[: ends[-1]].astype(bool)
        self.ids = np.split(data["ids"].astype(np.int64), ends[:-1])
        self.masks = np.split(flat_mask, ends[:-1])
        self.target, self.layer_ids, self.batch_size = target, config.target_layer_ids, batch_size
        self.feature_dtype = getattr(torch, feature_dtype)
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []
        self.passes = 0

    def __iter__(self):
        return self

    @torch.no_grad()
    def __next__(self) -> dict[str, torch.Tensor]:
        if len(self.order) < self.batch_size:
            self.order += self.rng.permutation(len(self.ids)).tolist()
            self.passes += 1
        picked, self.order = self.order[: self.batch_size], self.order[self.batch_size:]
        lengths = [len(self.ids[i]) for i in picked]
        device = self.target.device
        # right-padded, as the pipeline's collate pads them
        ids = pad_sequence([torch.from_numpy(self.ids[i]) for i in picked], batch_first=True)
        mask = pad_sequence([torch.from_numpy(self.masks[i]) for i in picked], batch_first=True)
        ids, mask, lengths = ids.to(device), mask.to(device), torch.tensor(lengths, device=device)
        attention = (torch.arange(ids.shape[1], device=device) < lengths[:, None]).long()
        out = self.target.forward(ids, layer_ids=self.layer_ids, attention_mask=attention)
        return {"input_ids": ids, "loss_mask": mask, "lengths": lengths,
                "features": out.features.to(self.feature_dtype), "target_next": out.logits.argmax(dim=-1)}


def build(settings: dict, train_config: TrainConfig, target: Target, seed: int) -> tuple[Drafter, DraftingObjective]:
    config = DrafterConfig(**settings["drafter"])
    drafter = Drafter.initial(config, target, seed, settings["draft_vocabulary"])
    objective = DraftingObjective(drafter, train_config.objective, seed=seed)
    return drafter, objective.to(target.device)


def train_on_gpu(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DominoError("no CUDA GPU here: `train` is the half that runs on one (--device cpu only to try it)")
    if not (args.data / CONFIG).is_file() or not (args.data / DATA).is_file():
        raise DominoError(f"{args.data} holds no {CONFIG} and {DATA}: make it with `gpu-drafter prepare --out {args.data}`")
    begin = time.perf_counter()
    settings = json.loads((args.data / CONFIG).read_text())
    target = Target.load(resolve_target(args.target), device=args.device)
    batches = Batches(args.data, target, DrafterConfig(**settings["drafter"]), settings["batch_size"],
                      settings["feature_dtype"], settings["seed"])
    left = args.minutes * 60 - (time.perf_counter() - begin)
    # as many steps as fit the minutes left (the budget times them); the cosine schedule spans those
    train_config = replace(TrainConfig(**settings["train"]), steps=MOST_STEPS, minutes=left / 60)
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"# {where}: {len(batches.ids)} sequences, {settings['batch_size']} a step, "
          f"{left / 60:.1f} minutes left for the steps", flush=True)
    drafter, objective = build(settings, train_config, target, settings["seed"])
    saves = [4, 2, 1]  # the drafter at a quarter, half and all of the (fitted) steps

    def on_log(done: int, summary: dict) -> None:
        steps = train_config.steps
        accuracy = " ".join(f"{a:.2f}" for a in summary["accuracy"][:4])
        print(f"step {done}/{steps}  pass {batches.passes}  {(time.perf_counter() - begin) / 60:.1f} min  "
              f"loss {summary['loss']:.3f}  training tau~{summary['tau']:.2f}  acc {accuracy}", flush=True)
        if saves and done >= steps // saves[0]:
            drafter.save_pretrained(args.out / f"step_{done:06d}")
            while saves and done >= steps // saves[0]:
                saves.pop(0)

    train(objective, batches, train_config, log_every=args.log_every, on_log=on_log, progress=False)
    print(f"# done in {(time.perf_counter() - begin) / 60:.1f} minutes; drafters in {args.out}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench gpu-drafter", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("mode", choices=["prepare", "train"],
                        help="prepare: tokenise conversations here (CPU); train: train drafters on one GPU")
    parser.add_argument("--out", type=Path, required=True, help="prepare: the data folder; train: where drafters go")
    parser.add_argument("--data", type=Path, help="train: the folder `prepare` wrote")
    parser.add_argument("--skip-head", type=int, default=100, help="prepare: conversations left out at the start")
    parser.add_argument("--skip-tail", type=int, default=500, help="prepare: conversations left out at the end")
    parser.add_argument("--conversations", type=int, default=0, help="prepare: at most this many (0: all)")
    parser.add_argument("--minutes", type=float, default=6.0, help="train: wall time, loading included")
    parser.add_argument("--log-every", type=int, default=100, help="train: steps between progress lines (the budget is refitted at each)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="train: the target `prepare` tokenised for")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="train: cpu only to try the script")
    args, overrides = parser.parse_known_args(argv)
    if min(args.skip_head, args.skip_tail, args.conversations) < 0 or args.minutes <= 0 or args.log_every < 1:
        parser.error("--skip-head, --skip-tail and --conversations must not be negative, --minutes and --log-every positive")
    if args.mode == "prepare":
        prepare(args, overrides)
    elif overrides:  # config keys are `prepare`'s: the data folder holds the config `train` runs
        parser.error(f"train takes no key=value or other arguments, got: {' '.join(overrides)}")
    elif args.data is None:
        parser.error("train needs --data, the folder `prepare` wrote")
    else:
        train_on_gpu(args)
    return 0
