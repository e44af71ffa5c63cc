import math

import pytest
import torch

from domino.drafter import ContextCache
from domino.objective import (DraftingObjective, ObjectiveConfig, curriculum_lambda, packed_block_mask,
                              position_weights, sample_anchors)
from domino.sampling import RowSampling, SamplingParams
from helpers import tiny_drafter, tiny_target

HEADS = ["none", "domino", "sglang-domino", "markov", "rnn"]


def make_batch(target, drafter, ids, response_from=0):
    out = target.forward(ids, layer_ids=drafter.config.target_layer_ids, final_hidden=True)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, response_from:] = True
    return dict(input_ids=ids, loss_mask=loss_mask, lengths=torch.full((ids.shape[0],), ids.shape[1]),
                features=out.features, final_hidden=out.final_hidden)


def teacher_forced_logits(drafter, h, prev):
    logits = drafter.draft_logits(h)
    if drafter.head is not None:
        logits = logits + drafter.head.out(drafter.head.codes(h, prev, drafter.embed(prev)))
    return logits


@pytest.mark.parametrize("convention", ["shifted", "dflash"])
@pytest.mark.parametrize("head", HEADS)
def test_packed_training_matches_inference_drafting(head, convention):
    """One packed forward over several anchors gives, for each block, the same distributions as the
    inference path (context cache + one block) fed the same tokens; teacher-forced heads equal the
    step-by-step heads; confidences agree. In both label conventions."""
    torch.manual_seed(1)
    target = tiny_target()
    drafter = tiny_drafter(target, head=head, confidence_head=True, label_convention=convention)
    drafts = drafter.config.num_drafts
    ids = torch.randint(0, 96, (1, 48))
    objective = DraftingObjective(drafter, ObjectiveConfig())
    anchors = torch.tensor([[2, 11, 17, 30]])  # overlapping blocks (11..18 and 17..24) must not leak
    for i, anchor in enumerate(anchors[0].tolist()):
        features = target.forward(ids[:, :anchor], layer_ids=drafter.config.target_layer_ids).features
        cache = ContextCache()
        drafter.extend_context(cache, features, torch.arange(anchor)[None])
        draft = drafter.draft(cache, ids[:, anchor], RowSampling([SamplingParams(1.0)], [i]))
        # write the drafted tokens into the sequence, so teacher forcing reads what was drafted
        forced = ids.clone()
        forced[0, anchor + 1: anchor + 1 + drafts] = draft.tokens[0]
        packed = objective.pack(make_batch(target, drafter, forced), anchors, torch.ones_like(anchors, dtype=torch.bool))
        h, prev = packed.hidden[i:i + 1], packed.prev_tokens[i:i + 1]
        assert torch.equal(prev[0, 1:], draft.tokens[0, :-1])
        probs = torch.softmax(teacher_forced_logits(drafter, h, prev), dim=-1)
        assert torch.allclose(probs, draft.probs, atol=1e-5)
        confidence = torch.sigmoid(drafter.confidence(h, drafter.embed(prev)))
        assert torch.allclose(confidence, draft.confidence, atol=1e-5)


def test_dflash_convention_trains_the_same_tokens_from_one_slot_later():
    """Shifted labels: block slot k learns x_{a+k+1}. DFlash's: the anchor's slot learns nothing and slot
    k learns x_{a+k}. Both ask for the tokens after the anchor in order, DFlash for one fewer."""
    target = tiny_target()
    ids = torch.randint(0, 96, (1, 40))
    anchors = torch.tensor([[3, 20]])
    packs = {}
    for convention in ("shifted", "dflash"):
        drafter = tiny_drafter(target, label_convention=convention)
        batch = make_batch(target, drafter, ids)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        packs[convention] = DraftingObjective(drafter, ObjectiveConfig()).pack(batch, anchors, valid)
    shifted, dflash = packs["shifted"], packs["dflash"]
    assert dflash.labels.shape == (2, 7) and torch.equal(dflash.labels[0], ids[0, 4:11])
    assert torch.equal(dflash.labels, shifted.labels[:, :-1])
    assert torch.equal(dflash.prev_tokens, shifted.prev_tokens[:, :-1])
    assert torch.equal(dflash.positions, shifted.positions[:, :-1])  # where the target predicts each label


def test_packed_mask_isolates_blocks():
    mask = packed_block_mask(torch.tensor([[3, 5]]), torch.tensor([[True, True]]), context_len=8, block_size=2)
    assert mask.shape == (1, 1, 4, 8 + 4)
    expected_context = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]] * 2 + [[1, 1, 1, 1, 1, 0, 0, 0]] * 2).bool()
    assert torch.equal(mask[0, 0, :, :8], expected_context)
    assert torch.equal(mask[0, 0, :, 8:], torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]).bool())


def test_position_weights_and_curriculum():
    w = position_weights(16)
    assert w[0] == 1 and math.isclose(float(w[7]), math.exp(-1), rel_tol=1e-6)
    assert math.isclose(float(position_weights(8)[4]), math.exp(-1), rel_tol=1e-6)
    assert math.isclose(float(position_weights(10)[5]), math.exp(-1), rel_tol=1e-6)
    assert math.isclose(float(position_weights(12, decay=3.0)[3]), math.exp(-1), rel_tol=1e-6)
    assert curriculum_lambda(0, 1000, 0.5) == 1.0
    assert curriculum_lambda(250, 1000, 0.5) == 0.5
    assert curriculum_lambda(500, 1000, 0.5) == 0.0
    assert curriculum_lambda(999, 1000, 0.5) == 0.0
    assert curriculum_lambda(500, 1000, 1.0) == 0.5
    assert curriculum_lambda(0, 1000, 0.0) == 0.0


def test_anchor_sampling_picks_distinct_trained_positions():
    loss_mask = torch.zeros(2, 20, dtype=torch.bool)
    loss_mask[0, 10:] = True
    loss_mask[1, 15:18] = True
    anchors, valid = sample_anchors(loss_mask, torch.tensor([20, 20]), 8, torch.Generator().manual_seed(0))
    assert valid[0].all() and valid[1].sum() == 3
    assert set(anchors[1][valid[1]].tolist()) == {14, 15, 16}
    row0 = anchors[0].tolist()
    assert len(set(row0)) == 8 and all(9 <= a <= 18 for a in row0) and row0 == sorted(row0)


@pytest.mark.parametrize("distill", [False, True])
def test_curriculum_moves_loss_weight_from_base_to_final(distill):
    target = tiny_target()
    drafter = tiny_drafter(target, head="domino")
    batch = make_batch(target, drafter, torch.randint(0, 96, (2, 32)))
    objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=4, distill=distill))
    losses = {}
    for lam in (0.0, 1.0):
        objective.generator.manual_seed(0)
        out = objective(batch, curriculum_lambda=lam)
        drafter.zero_grad()
        out.loss.backward()
        losses[lam] = (out.loss.item(), drafter.head.out.weight.grad.abs().sum().item())
    # at lambda = 1 only the base logits are trained: the head gets no gradient
    assert losses[1.0][1] == 0 and losses[0.0][1] > 0


def test_distillation_and_confidence_losses_train_their_parts():
    target = tiny_target()
    drafter = tiny_drafter(target, head="rnn", confidence_head=True)
    batch = make_batch(target, drafter, torch.randint(0, 96, (2, 32)), response_from=8)
    out = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=4, distill=True))(batch)
    out.loss.backward()
    assert {"tv", "bce", "ce", "loss"} <= out.metrics.keys()
    assert 0 <= out.metrics["tv"] <= 1
    assert drafter.confidence.score.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in drafter.parameters())


def test_confidence_loss_trains_only_the_confidence_head():
    """The survival estimate must not pull the backbone: its gradients are the drafting loss's alone."""
    target = tiny_target()
    drafter = tiny_drafter(target, head="domino", confidence_head=True)
    batch = make_batch(target, drafter, torch.randint(0, 96, (2, 32)), response_from=8)
    grads = {}
    for weight in (0.0, 100.0):
        objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=4, confidence_weight=weight))
        drafter.zero_grad()
        objective(batch).loss.backward()
        grads[weight] = {name: p.grad.clone() for name, p in drafter.named_parameters()
                         if p.grad is not None and not name.startswith("confidence.")}
    assert grads[0.0].keys() == grads[100.0].keys()
    for name in grads[0.0]:
        torch.testing.assert_close(grads[100.0][name], grads[0.0][name], msg=name)
