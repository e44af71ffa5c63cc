import pytest
import torch

from domino.errors import DominoError
from domino.objective import DraftingObjective, ObjectiveConfig
from domino.training import MetricsWindow, TrainConfig, train
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
