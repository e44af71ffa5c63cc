"""Ray Train + DeepSpeed: each worker runs domino's training loop on its shard of the feature stream.

The loop is `domino.training.train`, unchanged; the worker hands it DeepSpeed's engine as the objective,
DeepSpeed's backward + step as the optimiser step, and a feed that pads the streamed sequences into
batches and times how long the trainer waits for them.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections import deque

import numpy as np
import ray.train
import torch
import torch.distributed as dist
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.nn.utils.rnn import pad_sequence

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.errors import DominoError
from domino.objective import DraftingObjective, ObjectiveConfig, expected_accept_length
from domino.target import Target, training_dtype
from domino.training import TrainConfig, cosine_schedule, train
from pipelines.training import checkpoints
from pipelines.training.config import PipelineConfig
from pipelines.training.features import from_numpy, torch_threads


def drafter_config(cfg: PipelineConfig, target: Target) -> DrafterConfig:
    return DrafterConfig.for_target(target, num_layers=cfg.draft_layers, layer_ids=cfg.target_layer_ids,
                                    block_size=cfg.block_size, head=cfg.head, rank=cfg.rank,
                                    confidence_head=cfg.confidence_head, draft_vocab_size=cfg.draft_vocab_size,
                                    label_convention=cfg.label_convention, lookup_ngram=cfg.lookup_ngram,
                                    lookup_min_ngram=cfg.lookup_min_ngram)


def train_config(cfg: PipelineConfig, device: torch.device) -> TrainConfig:
    return TrainConfig(steps=cfg.steps, minutes=cfg.minutes, lr=cfg.lr, warmup_fraction=cfg.warmup_fraction,
                       weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, objective=ObjectiveConfig(
                           anchors_per_sequence=cfg.anchors_per_sequence, decay=cfg.decay,
                           curriculum_fraction=cfg.curriculum_fraction, distill=cfg.distill,
                           confidence_weight=cfg.confidence_weight,
                           compute_dtype=training_dtype(cfg.compute_dtype, device)))


class PadCollate(NumpyBatchCollateFn):
    """Ragged sequences from the stream -> right-padded tensors, plus their lengths (and the target time the
    feature actors spent on them, when the stream carries it)."""

    def __init__(self, dtype: str):
        self.dtype = dtype  # the feature transport dtype

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        out = {"lengths": torch.tensor([len(ids) for ids in batch["input_ids"]])}
        if "target_seconds" in batch:
            out["target_seconds"] = torch.tensor(float(np.sum(batch["target_seconds"])))
        for key, dtype in (("input_ids", np.int64), ("loss_mask", bool), ("target_next", np.int64)):
            if key in batch:
                out[key] = pad_sequence([torch.from_numpy(np.asarray(row, dtype=dtype)) for row in batch[key]],
                                        batch_first=True)
        for key in ("features", "final_hidden"):
            if key in batch:
                out[key] = pad_sequence([from_numpy(row, self.dtype) for row in batch[key]], batch_first=True)
        return out


class Feed:
    """This worker's batches, with counters for the progress line. The stream already holds every epoch
    the run needs (each recomputes the features: nothing is stored on disk); should it run short, it
    starts over. The counters start at the first batch, so the pipeline's start-up (actors loading the
    target) is reported apart from the steady-state wait.

    With `replay` > 1, each streamed batch is followed by replay - 1 steps on batches drawn from the
    last `replay_memory` streamed ones, kept in host memory: target features cost far more than a
    drafter step, so the trainer learns from them again instead of waiting for the next."""

    def __init__(self, shard, cfg: PipelineConfig, device: torch.device, seed: int):
        self.shard, self.device = shard, device
        self.collate = PadCollate(cfg.feature_dtype)
        self.batch_size = cfg.batch_size
        self.batches = self._epoch()
        self.created = time.perf_counter()
        self.started: float | None = None  # when the first batch arrived
        self.tokens = self.target_seconds = self.wait = 0.0
        self.replay, self.memory = cfg.replay, deque(maxlen=cfg.replay_memory)
        self.replays_due = 0
        self.random = random.Random(seed)

    def _epoch(self):
        return iter(self.shard.iter_torch_batches(batch_size=self.batch_size, collate_fn=self.collate,
                                                  drop_last=True, prefetch_batches=2))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.replays_due:
            self.replays_due -= 1
            batch = self.random.choice(self.memory)
        else:
            batch = self._streamed()
            if self.replay > 1:
                self.memory.append(batch)
                self.replays_due = self.replay - 1
        return {key: value.to(self.device) for key, value in batch.items()}

    def _streamed(self) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        batch = next(self.batches, None)
        if batch is None:
            self.batches = self._epoch()
            batch = next(self.batches, None)
            if batch is None:
                raise DominoError("an epoch of the data gave this worker no batch: give more data or a smaller batch_size")
        now = time.perf_counter()
        target_seconds = float(batch.pop("target_seconds"))
        if self.started is None:
            self.started = now
        else:
            self.wait += now - start
            self.tokens += float(batch["lengths"].sum())
            self.target_seconds += target_seconds
        return batch


FAULT_DELAY_S = 5.0

# What each worker contributes at a log step: the window since the last log, then the whole run so far.
FIELDS = ("loss", "tokens", "target_s", "wait", "elapsed", "run_tokens", "run_target_s", "run_wait", "run_elapsed")


class Progress:
    """Gathers every worker's counters at each log step; rank 0 prints the progress line. Returns the
    metrics reported with checkpoints: windowed and whole-run tokens/s and data-wait fractions."""

    def __init__(self, feed: Feed, device: torch.device):
        self.feed, self.device = feed, device
        self.last = {"tokens": 0.0, "target_s": 0.0, "wait": 0.0, "time": None}

    def __call__(self, step: int, steps: int, summary: dict) -> dict:
        """The metrics at `step` of a run of `steps`."""
        feed, last, now = self.feed, self.last, time.perf_counter()
        window_start = last["time"] or feed.started
        mine = {"loss": summary["loss"], "tokens": feed.tokens - last["tokens"],
                "target_s": feed.target_seconds - last["target_s"], "wait": feed.wait - last["wait"],
                "elapsed": now - window_start, "run_tokens": feed.tokens, "run_target_s": feed.target_seconds,
                "run_wait": feed.wait, "run_elapsed": now - feed.started}
        self.last = {"tokens": feed.tokens, "target_s": feed.target_seconds, "wait": feed.wait, "time": now}
        row = torch.tensor([mine[f] for f in FIELDS] + list(summary["accuracy"]), dtype=torch.float64, device=self.device)
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        table = torch.stack(rows).cpu()
        every = dict(zip(FIELDS, table[:, : len(FIELDS)].T))  # field -> one value per worker
        accuracy = table[:, len(FIELDS):].mean(0)

        def rate(tokens, seconds):
            return float(tokens.sum() / max(float(seconds), 1e-9))

        metrics = {
            "step": step, "loss": float(every["loss"].mean()), "accuracy": [round(float(a), 4) for a in accuracy],
            "tau_estimate": expected_accept_length(accuracy),
            "train_tokens_per_s": rate(every["tokens"], every["elapsed"].max()),
            "feature_tokens_per_s": rate(every["tokens"], every["target_s"].sum()),
            "data_wait": [round(float(w / max(float(e), 1e-9)), 4) for w, e in zip(every["wait"], every["elapsed"])],
            "run_tokens": float(every["run_tokens"].sum()),
            "run_train_tokens_per_s": rate(every["run_tokens"], every["run_elapsed"].max()),
            "run_feature_tokens_per_s": rate(every["run_tokens"], every["run_target_s"].sum()),
            "run_data_wait": [round(float(w / max(float(e), 1e-9)), 4) for w, e in zip(every["run_wait"], every["run_elapsed"])],
            "first_batch_s": round(feed.started - feed.created, 2),
        }
        if dist.get_rank() == 0:
            print(format_progress(metrics, steps), flush=True)
        return metrics


def format_progress(m: dict, steps: int) -> str:
    accuracy = " ".join(f"{a:.2f}" for a in m["accuracy"])
    wait = " ".join(f"{w:.0%}" for w in m["data_wait"])
    return (f"[train] step {m['step']}/{steps}  loss {m['loss']:.3f}  acc/pos [{accuracy}]  tau~{m['tau_estimate']:.2f}  "
            f"train {m['train_tokens_per_s']:.0f} tok/s  features {m['feature_tokens_per_s']:.0f} tok/s per actor  "
            f"data wait [{wait}]")


def quiet_ray_train_reports() -> None:
    """Ray Train logs each report's whole metrics dict and each checkpoint's path at INFO level (its
    loggers are named after their modules' file and import path, pinned with Ray); the progress line
    already says what matters, so only their warnings stay."""
    from ray.train.v2._internal.execution import context, storage

    logging.getLogger(context.__file__).setLevel(logging.WARNING)
    logging.getLogger(storage.__name__).setLevel(logging.WARNING)


def train_worker(config: dict) -> None:
    """The function every Ray Train worker runs."""
    cfg = PipelineConfig(**config["cfg"])
    if not cfg.use_gpu:  # what DeepSpeed would fall back to, said so that it does not warn of a missing GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    quiet_ray_train_reports()

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # its C++ build takes minutes; gloo is enough
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(torch_threads(cfg.trainer_cpus))
    device = ray.train.torch.get_device()
    if device.type == "cuda":  # DeepSpeed takes cuda:LOCAL_RANK, which is not Ray's pick when workers share a GPU
        torch.cuda.set_device(device)
        os.environ["LOCAL_RANK"] = str(device.index)

    target = Target.load(config["target_path"], device=device)
    drafter = Drafter.initial(drafter_config(cfg, target), target, cfg.seed, config["draft_vocabulary"])
    tc = train_config(cfg, device)
    objective = DraftingObjective(drafter, tc.objective, seed=cfg.seed + rank)
    engine, *_ = deepspeed.initialize(
        model=objective, model_parameters=[p for p in objective.parameters() if p.requires_grad],
        config=config["deepspeed"],
        lr_scheduler=lambda optimizer: cosine_schedule(optimizer, tc))
    start_step, planned_steps = checkpoints.restore(engine)
    tc.steps = checkpoints.steps_to_finish(cfg, planned_steps)
    if tc.steps < cfg.steps:  # a time budget cut the steps before the checkpoint: finish that plan, unbudgeted
        tc.minutes = None
    if rank == 0:
        print(f"[train] {world} worker(s), {sum(p.numel() for p in objective.parameters())/1e6:.2f} M drafter parameters, "
              f"computing in {tc.objective.compute_dtype}, "
              + (f"resuming at step {start_step}" if start_step else "starting at step 0"), flush=True)

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()
        if cfg.fail_at_step and start_step == 0 and engine.global_steps == cfg.fail_at_step and rank == world - 1:
            # Ray Train collects reported checkpoints by polling every few seconds; tiny test steps are
            # faster than that, so wait as a real run's steps would before the crash
            time.sleep(FAULT_DELAY_S)
            print(f"[train] fault injection: worker {rank} dies at step {engine.global_steps}", flush=True)
            os._exit(1)

    feed = Feed(ray.train.get_dataset_shard("train"), cfg, device, seed=cfg.seed + rank)
    progress = Progress(feed, device)

    def on_log(done: int, summary: dict) -> None:
        metrics = progress(done, tc.steps, summary)
        if done % cfg.checkpoint_every == 0 or done == tc.steps:
            with checkpoints.saved(engine, drafter, done, tc.steps, rank, world, cfg) as checkpoint:
                ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoints.step_dir_name(done))
            if rank == 0:
                print(f"[train] checkpoint at step {done} saved", flush=True)

    def fewest(steps: int) -> int:
        """The step count every worker can finish within the time budget."""
        count = torch.tensor([steps], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count)

    train(engine, feed, tc, step=step, start_step=start_step, log_every=cfg.log_every, on_log=on_log, progress=False,
          agree=fewest)


def fit(cfg: PipelineConfig, dataset: ray.data.Dataset, target_path: str,
        draft_vocabulary: list[int] | None) -> ray.train.Result:
    resources = {"CPU": cfg.trainer_cpus, **({"GPU": cfg.trainer_gpus} if cfg.use_gpu else {})}
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"cfg": cfg.model_dump(), "deepspeed": cfg.deepspeed(), "target_path": target_path,
                           "draft_vocabulary": draft_vocabulary},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(name=cfg.run_name, storage_path=cfg.storage_uri,
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints)),
        datasets={"train": dataset})
    previous = signal.getsignal(signal.SIGINT)
    try:
        return trainer.fit()
    except SystemExit:
        # Ctrl-C: Ray Train's own SIGINT handler aborts the run, and the driver's wait for it then ends in
        # SystemExit(1); raised as the interrupt it is, the command ends with its one line and status 130
        raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGINT, previous)  # Ray Train leaves its handler, tied to the finished run
