"""The reduced draft vocabulary: which tokens it keeps, that it saves and loads with the drafter, that the
drafter only ever proposes them, and that decoding with it stays exact (the chi-square test at T > 0,
with tokens outside the draft vocabulary, is in test_sampling.py)."""

import numpy as np
import pytest
import torch

from domino.drafter import Drafter
from domino.engine import DecodingEngine
from domino.errors import DominoError
from domino.objective import DraftingObjective, ObjectiveConfig
from domino.packed_linear import pack_linear_layers
from domino.requests import GenerationConfig
from domino.sampling import SamplingParams
from domino.vocabulary import count_tokens, coverage, most_frequent
from helpers import tiny_drafter, tiny_target
from test_decoding import hf_greedy, random_prompts
from test_drafter import draft_once
from test_objective import make_batch

KEPT = torch.tensor([0, 3, 7, 8, 20, 41, 55, 60, 77, 90, 94, 95])


def reduced_drafter(target, head="domino", **options):
    drafter = tiny_drafter(target, head=head, draft_vocab_size=len(KEPT), **options)
    drafter.set_draft_vocabulary(KEPT)
    return drafter


def test_most_frequent_tokens_of_the_trained_positions():
    ids = np.array([5, 5, 5, 2, 2, 9, 1, 1, 1, 1])
    mask = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)  # token 1 is in the prompt only
    counts = count_tokens([(ids, mask)], vocab_size=12)
    assert counts[5] == 3 and counts[1] == 0
    assert most_frequent(counts, 2).tolist() == [2, 5]
    assert most_frequent(counts, 4).tolist() == [0, 2, 5, 9]  # a tie among unseen ids goes to the lowest
    assert coverage(counts, most_frequent(counts, 2)) == pytest.approx(5 / 6)
    with pytest.raises(DominoError, match="does not fit"):
        most_frequent(counts, 13)


@pytest.mark.parametrize("ids, message", [
    (torch.arange(5), "must hold draft_vocab_size=12 target ids"),
    (torch.tensor([0] * 12), "distinct target ids in 0..95"),
    (torch.arange(90, 102), "distinct target ids in 0..95"),
])
def test_bad_draft_vocabularies_are_refused(ids, message):
    drafter = tiny_drafter(tiny_target(), draft_vocab_size=12)
    with pytest.raises(DominoError, match=message):
        drafter.set_draft_vocabulary(ids)


def test_draft_vocabulary_size_is_checked():
    with pytest.raises(DominoError, match="draft_vocab_size must be 0"):
        tiny_drafter(tiny_target(), draft_vocab_size=97)


@pytest.mark.parametrize("head", ["none", "domino", "markov"])
def test_the_mapping_saves_and_loads_and_drafts_stay_inside_it(tmp_path, head):
    target = tiny_target()
    drafter = reduced_drafter(target, head=head, confidence_head=True)
    pack_linear_layers(drafter)  # as loading packs it, so that the drafts compare bit for bit
    assert drafter.draft_logits(torch.randn(3, 64)).shape == (3, len(KEPT))
    if drafter.head is not None:
        assert drafter.head.out.weight.shape[0] == len(KEPT)
    ids = torch.randint(0, 96, (1, 20))
    before = draft_once(drafter, target, ids, SamplingParams(temperature=1.0))
    assert set(before.tokens.flatten().tolist()) <= set(KEPT.tolist())
    outside = torch.ones(96, dtype=torch.bool)
    outside[KEPT] = False
    assert before.probs.shape[-1] == 96 and not before.probs[..., outside].any()
    assert torch.allclose(before.probs.sum(-1), torch.ones(()))

    drafter.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target)
    assert torch.equal(loaded.draft_to_target, KEPT)
    after = draft_once(loaded, target, ids, SamplingParams(temperature=1.0))
    assert torch.equal(before.tokens, after.tokens) and torch.equal(before.probs, after.probs)


def test_greedy_decoding_with_a_reduced_vocabulary_equals_the_target():
    target = tiny_target(init_std=0.1)
    target.model.double()
    engine = DecodingEngine(target, reduced_drafter(target, block_size=5).double())
    prompts = list(random_prompts(4, seed=2))
    states = [engine.add(f"r{i}", p, GenerationConfig(max_new_tokens=20, stop_token_ids=[])) for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    for prompt, state in zip(prompts, states):
        assert state.tokens == hf_greedy(target, prompt, 20)


def test_labels_outside_the_draft_vocabulary_train_nothing_and_are_never_correct():
    target = tiny_target()
    drafter = reduced_drafter(target, head="none")
    # a sequence made only of tokens outside the draft vocabulary: nothing can be learned or hit
    outside = torch.tensor([t for t in range(96) if t not in KEPT.tolist()])
    ids = outside[torch.randint(0, len(outside), (1, 40))]
    out = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=8))(make_batch(target, drafter, ids))
    assert out.metrics["count"].sum() > 0 and out.metrics["correct"].sum() == 0
    assert out.loss.item() == 0.0
