import time

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from domino.errors import DominoError
from domino.objective import DraftingObjective, ObjectiveConfig
from domino.training import (BUDGET_PROBE, BUDGET_WARMUP, AdamWStep, MetricsWindow, TrainConfig, cosine_schedule,
                             train)
from helpers import greedy_continuations, tiny_drafter, tiny_target, training_batches


def held_out_accuracy(objective, target, data):
    window = MetricsWindow()
    objective.eval()
    with torch.no_grad():
        stream = training_batches(target, objective.drafter, data, 16, seed=1)
        for _ in range(4):
            window.add(objective(next(stream)).metrics)
    return window.summary()["accuracy"]


def test_tiny_drafter_learns_the_targets_greedy_continuations():
    """The objective learns: on a tiny target's own greedy continuations, 150 steps take the first
    block position from chance to over 90 % top-1 on held-out sequences."""
    target = tiny_target(layer_scale=0.1)
    train_set, test_set = greedy_continuations(target, 256, seed=0), greedy_continuations(target, 64, seed=1)
    drafter = tiny_drafter(target, head="domino", randomize_heads=False)
    objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=16))
    before = held_out_accuracy(objective, target, test_set)
    summary = train(objective, training_batches(target, drafter, train_set, 8, seed=0), TrainConfig(steps=150, lr=3e-3),
                    progress=False)
    after = held_out_accuracy(objective, target, test_set)
    assert before[0] < 0.1
    assert after[0] > 0.9, after
    assert summary["tau"] > 3


def test_bfloat16_steps_compute_in_bfloat16_and_keep_float32_weights_and_loss():
    """compute_dtype bfloat16 runs the drafter's matrix products in bf16 (autocast), while its weights,
    their gradients and the loss stay float32, and the loss stays within bf16 rounding of float32's."""
    target = tiny_target()
    drafter = tiny_drafter(target, head="domino")
    batch = next(training_batches(target, drafter, greedy_continuations(target, 4, seed=0), 4, seed=0))
    losses = {}
    for compute_dtype in ["float32", "bfloat16"]:
        objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=8, compute_dtype=compute_dtype))
        products = []
        hooks = [m.register_forward_hook(lambda m, i, out: products.append(out.dtype))
                 for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
        out = objective(dict(batch))
        for hook in hooks:
            hook.remove()
        drafter.zero_grad()
        out.loss.backward()
        assert products and set(products) == {getattr(torch, compute_dtype)}
        assert out.loss.dtype == torch.float32
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in drafter.parameters() if p.grad is not None)
        losses[compute_dtype] = float(out.loss.detach())
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.02 * losses["float32"], losses


def test_unknown_compute_dtype_is_refused():
    with pytest.raises(DominoError, match="compute_dtype must be one of float32, bfloat16, got 'float16'"):
        ObjectiveConfig(compute_dtype="float16")


def test_training_stops_cleanly_when_data_runs_out():

    target = tiny_target()
    drafter = tiny_drafter(target)
    objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=2))
    data = greedy_continuations(target, 4, seed=0, new_tokens=8)
    two_batches = iter([next(training_batches(target, drafter, data, 2, seed=0)) for _ in range(2)])
    with pytest.raises(DominoError, match="data ran out after 2 of 5 steps"):
        train(objective, two_batches, TrainConfig(steps=5), progress=False)


@pytest.mark.parametrize("steps, warmup_fraction", [(100, 0.04), (37, 0.1), (10, 0.0)])
def test_cosine_schedule_is_transformers_warmup_cosine(steps, warmup_fraction):
    """Our schedule (which reads the run's length live, for time budgets) gives transformers' warm-up +
    cosine learning rate at every step."""
    config = TrainConfig(steps=steps, warmup_fraction=warmup_fraction, lr=1.0)
    ours, theirs = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(2))
    ours_schedule = cosine_schedule(ours, config)
    theirs_schedule = get_cosine_schedule_with_warmup(theirs, int(warmup_fraction * steps), steps)
    for _ in range(steps):
        assert ours_schedule.get_last_lr() == pytest.approx(theirs_schedule.get_last_lr(), abs=1e-12)
        ours.step(), theirs.step(), ours_schedule.step(), theirs_schedule.step()


class SlowBatches:
    """Batches that take `seconds` each to arrive, as a feature stream does, but the first `buffered`
    at once (as those produced while the trainer started); counts what it handed out."""

    def __init__(self, batches, seconds: float, buffered: int = 0):
        self.batches, self.seconds, self.buffered, self.handed = batches, seconds, buffered, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.handed >= self.buffered:
            time.sleep(self.seconds)
        self.handed += 1
        return next(self.batches)


@pytest.mark.parametrize("buffered", [0, 40])
def test_a_time_budget_ends_the_run_when_it_runs_out_with_the_schedule_at_zero(buffered):
    """With `minutes`, the run times its steps and keeps only those that fit: it asks for no batch past
    them, reports its last step, ends within the budget, and its learning rate reaches 0 there. When the
    first batches come at once and the rest slowly, the first fit is too long and the refits shorten it."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=2))
    data = greedy_continuations(target, 8, seed=0, new_tokens=8)
    batches = SlowBatches(training_batches(target, drafter, data, 2, seed=0), seconds=0.05, buffered=buffered)
    config = TrainConfig(steps=100_000, minutes=3 / 60)
    step, logged, began = AdamWStep(objective.parameters(), config), [], time.perf_counter()
    train(objective, batches, config, step=step, log_every=10, on_log=lambda done, _: logged.append(done),
          progress=False)
    took = time.perf_counter() - began
    assert BUDGET_WARMUP + BUDGET_PROBE < config.steps < 60 + buffered, config.steps  # 3 s of steps of 50 ms and more
    assert batches.handed == config.steps and logged[-1] == config.steps
    assert took < 3 * 1.5, took
    assert step.schedule.get_last_lr() == [0.0]


def test_a_time_budget_is_what_every_worker_agrees_on():
    """The count the workers agree on (their minimum) is the run's length, not this worker's own."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=2))
    batches = training_batches(target, drafter, greedy_continuations(target, 8, seed=0, new_tokens=8), 2, seed=0)
    config, offered = TrainConfig(steps=1000, minutes=60), []
    agreed = BUDGET_WARMUP + BUDGET_PROBE + 3
    train(objective, batches, config, progress=False, agree=lambda steps: offered.append(steps) or agreed)
    assert offered == [1000] and config.steps == agreed  # an hour holds all of this worker's steps
