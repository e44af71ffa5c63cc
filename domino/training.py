"""The training loop, in one process and without Ray. The Ray pipeline runs the same loop inside each
trainer, handing it DeepSpeed's engine and step instead of the plain AdamW ones here."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm

from domino.errors import DominoError
from domino.objective import ObjectiveConfig, ObjectiveOutput, curriculum_lambda, expected_accept_length


# A time budget's first fit times steps [start + BUDGET_WARMUP, start + BUDGET_WARMUP + BUDGET_PROBE): the
# first steps wait for the data stream to start and are not typical.
BUDGET_WARMUP, BUDGET_PROBE = 5, 20


@dataclass
class TrainConfig:
    """`steps` is the run's length; with `minutes` set it is the most the run may take, and `train` sets
    it in place, once its first steps are timed and again at every log step, to the steps that fit the
    budget at the mean pace so far: the learning-rate schedule and the curriculum read it, so they span
    the steps the run keeps."""

    steps: int = 1000
    minutes: float | None = None  # wall-time budget of the steps (data waits included); None: all `steps`
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    def __post_init__(self) -> None:
        if isinstance(self.objective, dict):
            self.objective = ObjectiveConfig(**self.objective)
        if self.steps < 1:
            raise DominoError(f"steps must be at least 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise DominoError(f"minutes must be positive, got {self.minutes}")
        if self.lr <= 0:
            raise DominoError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise DominoError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")


def cosine_schedule(optimizer: torch.optim.Optimizer, config: TrainConfig) -> LambdaLR:
    """The learning rate: linear warm-up over `warmup_fraction` of the steps, then cosine to 0. It reads
    `config.steps` at every step, so a time budget that shortens the run shortens the schedule with it."""

    def factor(step: int) -> float:
        warmup = int(config.warmup_fraction * config.steps)
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / max(1, config.steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


class TimeBudget:
    """Keeps `config.steps` at the steps that fit `config.minutes` from the moment it is made, at the mean
    pace since step start + BUDGET_WARMUP: fitted once BUDGET_PROBE steps are timed and again at every log
    step (the pace changes once the batches buffered during start-up run out), never past the run's
    original `steps` and at least one step on (whose log line and checkpoint close the run)."""

    def __init__(self, config: TrainConfig, start_step: int, log_every: int, agree: Callable[[int], int]):
        self.config, self.log_every, self.agree = config, log_every, agree
        self.most, self.began, self.probe_began = config.steps, time.perf_counter(), 0.0
        self.probe_start = start_step + BUDGET_WARMUP
        self.probe_end = self.probe_start + BUDGET_PROBE

    def before_step(self, i: int) -> None:
        if i == self.probe_start:
            self.probe_began = time.perf_counter()
        if i == self.probe_end or (i > self.probe_end and i % self.log_every == 0):
            now = time.perf_counter()
            pace = (now - self.probe_began) / (i - self.probe_start)
            left = self.config.minutes * 60 - (now - self.began)
            self.config.steps = self.agree(max(i + 1, min(self.most, i + int(left / pace))))


class AdamWStep:
    """backward + clip + AdamW + cosine schedule with warm-up: one optimiser step per call."""

    def __init__(self, parameters, config: TrainConfig):
        self.parameters = [p for p in parameters if p.requires_grad]
        # fused: one pass over each tensor instead of about ten; on CPU a step of the long recipe's
        # 7.5 M parameters takes 11 ms instead of 60 (docs/benchmarks.md, "AdamW, fused")
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.lr, weight_decay=config.weight_decay, fused=True)
        self.schedule = cosine_schedule(self.optimizer, config)
        self.grad_clip = config.grad_clip

    def __call__(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.grad_clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)


class MetricsWindow:
    """Sums per-position correct/count and averages losses over the steps since the last reset."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        for key, value in metrics.items():
            value = value.detach().float().cpu()
            self.sums[key] = self.sums[key] + value if key in self.sums else value.clone()
        self.steps += 1

    def summary(self) -> dict[str, float | list[float]]:
        if not self.steps:
            return {}
        out: dict[str, float | list[float]] = {
            key: float(value) / self.steps for key, value in self.sums.items() if value.dim() == 0}
        if "correct" in self.sums:
            accuracy = self.sums["correct"] / self.sums["count"].clamp(min=1)
            out["accuracy"] = [round(float(a), 4) for a in accuracy]
            out["tau"] = expected_accept_length(accuracy)
        return out

    def reset(self) -> None:
        self.sums, self.steps = {}, 0


def format_summary(summary: dict) -> str:
    """One short line for a progress bar: loss, estimated tau and accuracy at the first positions."""
    if not summary:
        return ""
    accuracy = " ".join(f"{a:.2f}" for a in summary.get("accuracy", [])[:6])
    return f"loss {summary['loss']:.3f} tau~{summary.get('tau', 0):.2f} acc[{accuracy} ...]"


def train(objective: nn.Module, batches: Iterator[dict[str, torch.Tensor]], config: TrainConfig,
          step: Callable[[torch.Tensor], None] | None = None, start_step: int = 0, log_every: int = 10,
          on_log: Callable[[int, dict], None] | None = None, progress: bool = True,
          agree: Callable[[int], int] = lambda steps: steps) -> dict:
    """Run `config.steps - start_step` optimiser steps of `objective` (a DraftingObjective, or DeepSpeed's
    engine around one) on `batches`; return the metrics of the last logging window. With `config.minutes`,
    the steps are timed and `config.steps` fitted to the budget; `agree` turns this process's count into
    the one every data-parallel worker uses (their minimum), since all must stop together."""
    step = step or AdamWStep(objective.parameters(), config)
    window = MetricsWindow()
    summary: dict = {}
    objective.train()
    bar = tqdm(initial=start_step, total=config.steps, disable=not progress, desc="train", dynamic_ncols=True)
    budget = TimeBudget(config, start_step, log_every, agree) if config.minutes is not None else None
    i = start_step
    while i < config.steps:
        if budget is not None:
            budget.before_step(i)
            bar.total = config.steps
        try:
            batch = next(batches)
        except StopIteration:
            raise DominoError(f"the data ran out after {i} of {config.steps} steps: give more data or fewer steps") from None
        out: ObjectiveOutput = objective(batch, curriculum_lambda(i, config.steps, config.objective.curriculum_fraction))
        step(out.loss)
        window.add(out.metrics)
        if (i + 1) % log_every == 0 or i + 1 == config.steps:
            summary = window.summary()
            bar.set_postfix_str(format_summary(summary))
            if on_log is not None:
                on_log(i + 1, summary)
            window.reset()
        i += 1
        bar.update()
    bar.close()
    return summary
