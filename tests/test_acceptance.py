"""The engine's drafts equal drafts computed from scratch (one full target forward over the finished
sequence): the drafter's context cache, grown round by round through holes, staged rounds, compaction,
joins and retirements, holds exactly the context it should. Greedy exactness cannot see a bug here (it
would only lower tau), so this compares the drafts themselves: tokens exactly, confidences to 1e-9."""

import pytest
import torch

from domino.acceptance import drafts_from_scratch, greedy_accepted
from domino.engine import DecodingEngine
from domino.requests import GenerationConfig
from domino.scheduler import FullVerify
from helpers import tiny_drafter, tiny_target
from test_decoding import random_prompts
from test_engine import run_batch

VOCAB = 96


def bigram_target():
    """Layers scaled to zero: the target's greedy next token depends on the current token only."""
    target = tiny_target(layer_scale=0.0, seed=2)
    target.model.double()
    return target


def next_token_table(target) -> torch.Tensor:
    with torch.no_grad():
        return target.model(torch.arange(VOCAB)[:, None]).logits[:, 0].argmax(-1)


def mostly_right_drafter(target, wrong_fraction: float = 0.3, lookup_ngram: int = 0, lookup_min_ngram: int = 2,
                         label_convention: str = "shifted"):
    """A Markov head that knows the target's next-token table except for a share of the tokens, so rounds
    accept every number of drafts; the backbone's own logits and its confidences still read the context."""
    drafter = tiny_drafter(target, head="markov", rank=VOCAB, block_size=6, confidence_head=True, seed=4,
                           lookup_ngram=lookup_ngram, lookup_min_ngram=lookup_min_ngram,
                           label_convention=label_convention).double()
    table = next_token_table(target)
    wrong = torch.rand(VOCAB, generator=torch.Generator().manual_seed(0)) < wrong_fraction
    table = torch.where(wrong, (table + 1) % VOCAB, table)
    with torch.no_grad():
        drafter.head.embed.weight.copy_(torch.eye(VOCAB, dtype=torch.float64))
        drafter.head.out.weight.zero_()
        drafter.head.out.weight[table, torch.arange(VOCAB)] = 1000.0
    return drafter


class RecordingEngine(DecodingEngine):
    """Keeps every row's anchor position, draft tokens and confidences, round by round, and whether the
    caches ever held holes and were compacted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple[str, int, torch.Tensor, torch.Tensor]] = []
        self.saw_holes = self.compacted = False

    def _round(self):
        events = super()._round()
        if self.caches is not None:  # compact far more eagerly than the engine does, to exercise it often
            width = self.caches.valid.shape[1]
            self.saw_holes |= not bool(self.caches.valid.all())
            self.caches.compact(slack=1.0)
            self.compacted |= self.caches.valid.shape[1] < width
        return events

    def _propose(self, states, anchors, positions, sampling, caps):
        draft = super()._propose(states, anchors, positions, sampling, caps)
        if draft is not None:
            for r, request_id in enumerate(self.ids):
                self.recorded.append((request_id, int(positions[r]), draft.tokens[r], draft.confidence[r]))
        return draft


class EveryThirdRoundPlain(FullVerify):
    """Shuts the speculation gate every third round, and in every round before `first_draft`, so the
    drafter's features wait staged (from the start: rows then join as features, unprojected)."""

    def __init__(self, first_draft: int):
        self.rounds, self.first_draft = 0, first_draft

    def wants_draft(self, rows: int) -> bool:
        self.rounds += 1
        return self.rounds >= self.first_draft and self.rounds % 3 != 0


@pytest.mark.parametrize("lookup_ngram, first_draft", [(0, 1), (2, 1), (0, 7)])
def test_engine_drafts_equal_drafts_from_scratch(lookup_ngram, first_draft):
    """With context lookup too: each row's text, kept by the engine as it commits, must be the one the
    reference reads off the finished sequence. With `first_draft` 7 the first six rounds decode plainly
    and a row joins during them: the batch is still all staged features when it joins."""
    target = bigram_target()
    drafter = mostly_right_drafter(target, lookup_ngram=lookup_ngram)
    engine = RecordingEngine(target, drafter, policy=EveryThirdRoundPlain(first_draft))
    prompts = list(random_prompts(5, seed=7))
    requests = {f"r{i}": (p, GenerationConfig(max_new_tokens=30 + 25 * (i % 3), stop_token_ids=[]))
                for i, p in enumerate(prompts)}
    got = run_batch(engine, requests, join_at={"r3": 4, "r4": 9})
    assert engine.saw_holes and engine.compacted

    accepted_lengths = set()
    for request_id, (prompt, _) in requests.items():
        sequence = torch.tensor(prompt + got[request_id])
        features = target.forward(sequence[None], layer_ids=drafter.config.target_layer_ids).features
        rounds = [(p, tokens, confidence) for rid, p, tokens, confidence in engine.recorded if rid == request_id]
        assert len(rounds) > 3
        anchors = torch.tensor([p for p, _, _ in rounds])
        reference = drafts_from_scratch(drafter, features, sequence, anchors)
        for i, (position, tokens, confidence) in enumerate(rounds):
            assert torch.equal(tokens, reference.tokens[i]), (request_id, position)
            assert torch.allclose(confidence, reference.confidence[i], rtol=0, atol=1e-9), (request_id, position)
        accepted_lengths.update(greedy_accepted(drafter, features, sequence, anchors).tolist())
    assert len(accepted_lengths) >= 4  # rounds accepted many different numbers of drafts


def test_a_batch_that_has_not_drafted_never_projects_its_drafter_cache():
    """Rows join, one retires and the holes it leaves are compacted, all before any round drafts: the
    drafter's cache is still features alone (a batch too large for drafts to pay never pays for the
    drafter's context), and once drafting starts, the drafts are those computed from scratch."""
    target = bigram_target()
    drafter = mostly_right_drafter(target)
    first_draft = 16
    engine = RecordingEngine(target, drafter, policy=EveryThirdRoundPlain(first_draft))
    short, medium, late = random_prompts(3, seed=7)
    long = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    requests = {"long": (long, GenerationConfig(max_new_tokens=6, stop_token_ids=[])),  # retires early
                "short": (short, GenerationConfig(max_new_tokens=40, stop_token_ids=[])),
                "medium": (medium, GenerationConfig(max_new_tokens=40, stop_token_ids=[])),
                "late": (late, GenerationConfig(max_new_tokens=40, stop_token_ids=[]))}
    got = {rid: [] for rid in requests}
    step = 0
    while engine.has_work or step <= 3:
        if step == 0:
            for rid in ("long", "short", "medium"):
                engine.add(rid, *requests[rid])
        if step == 3:
            engine.add("late", *requests["late"])
        for event in engine.step():
            got[event.request_id] += event.tokens
        step += 1
        if engine.policy.rounds == first_draft - 1:  # the last round before the first draft
            assert engine.compacted and "long" not in engine.ids
            assert engine.caches.context.all_staged
    assert engine.policy.rounds > first_draft + 3

    for request_id in ("short", "medium", "late"):
        prompt = requests[request_id][0]
        sequence = torch.tensor(prompt + got[request_id])
        features = target.forward(sequence[None], layer_ids=drafter.config.target_layer_ids).features
        rounds = [(p, tokens, confidence) for rid, p, tokens, confidence in engine.recorded if rid == request_id]
        assert len(rounds) > 3
        reference = drafts_from_scratch(drafter, features, sequence, torch.tensor([p for p, _, _ in rounds]))
        for i, (position, tokens, confidence) in enumerate(rounds):
            assert torch.equal(tokens, reference.tokens[i]), (request_id, position)
            assert torch.allclose(confidence, reference.confidence[i], rtol=0, atol=1e-9), (request_id, position)


@pytest.mark.parametrize("label_convention", ["shifted", "dflash"])
def test_greedy_accepted_counts_leading_matches(label_convention):
    """Up to a block's drafts: 6 in the shifted convention, 5 in DFlash's (its first slot is the anchor's)."""
    target = bigram_target()
    drafter = mostly_right_drafter(target, wrong_fraction=0.0, label_convention=label_convention)
    table = next_token_table(target)
    sequence = [5]
    for _ in range(20):
        sequence.append(int(table[sequence[-1]]))
    sequence = torch.tensor(sequence)
    features = target.forward(sequence[None], layer_ids=drafter.config.target_layer_ids).features
    accepted = greedy_accepted(drafter, features, sequence, torch.arange(0, 20))
    # every draft matches the target's chain; only the text's end cuts the count
    assert accepted.tolist() == [min(drafter.config.num_drafts, 20 - a) for a in range(20)]


@pytest.mark.parametrize("lookup_ngram", [0, 2])
def test_accepted_copies_are_counted_apart_from_drafted_tokens(lookup_ngram):
    """A drafter whose every learned draft is wrong: whatever passes verification was copied from the text,
    so the statistics must count every accepted draft as a copy (and none without context lookup). Copies
    after 1-token matches in the random prompts are often wrong, and those must not count."""
    target = bigram_target()
    drafter = mostly_right_drafter(target, wrong_fraction=1.0, lookup_ngram=lookup_ngram, lookup_min_ngram=1)
    engine = DecodingEngine(target, drafter)
    states = [engine.add(f"r{i}", prompt, GenerationConfig(max_new_tokens=40, stop_token_ids=[]))
              for i, prompt in enumerate(random_prompts(4, seed=3))]
    while engine.has_work:
        engine.step()
    accepted = sum(sum(s.stats.accepted) for s in states)
    copies = sum(s.stats.accepted_copies for s in states)
    assert copies == accepted
    assert accepted > 0 if lookup_ngram else accepted == 0
