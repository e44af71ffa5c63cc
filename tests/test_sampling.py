"""At T > 0 speculative sampling must produce exactly the target's sampling distribution. On a
6-token vocabulary we enumerate the target's exact law of the first three tokens and compare the
empirical frequencies of over a thousand seeded generations with a chi-square test. The generations
run in batches of requests with their own seeds (plus a greedy request with other parameters), so
this also checks that a request's samples do not depend on the batch it shares."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from domino.engine import DecodingEngine
from domino.requests import GenerationConfig
from domino.sampling import SamplingParams, probabilities
from helpers import tiny_drafter, tiny_target

VOCAB, NEW, RUNS, BATCH = 6, 3, 1200, 40
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def target():
    target = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=4, init_std=0.3, seed=5)
    target.model.double()
    return target


def exact_law(target, params):
    """P(t1, t2, t3) under the target's own sampling, by enumerating every path."""
    law = {}
    for path in itertools.product(range(VOCAB), repeat=NEW):
        ids = torch.tensor([PROMPT + list(path)])
        probs = probabilities(target.model(ids).logits[0, len(PROMPT) - 1: -1], params)
        law[path] = float(torch.prod(probs[torch.arange(NEW), torch.tensor(path)]))
    return law


def chi_square_p(observed: dict, expected: dict, runs: int) -> float:
    """Chi-square p-value; cells expected below 5 counts are pooled into one. A cell outside the
    target's support (top-k / top-p cut) must never be observed."""
    obs, exp, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for cell, p in expected.items():
        if p == 0:
            assert observed.get(cell, 0) == 0, f"{cell} has probability 0 but was generated"
        elif p * runs >= 5:
            obs.append(observed.get(cell, 0))
            exp.append(p * runs)
        else:
            pooled_obs += observed.get(cell, 0)
            pooled_exp += p * runs
    if pooled_exp:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    scale = sum(obs) / sum(exp)  # the law sums to 1 up to rounding
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def marginal(law: dict, positions: tuple[int, ...]) -> dict:
    out: dict = {}
    for path, p in law.items():
        key = tuple(path[i] for i in positions)
        out[key] = out.get(key, 0.0) + p
    return out


def bad_drafter(target):
    """Random weights with a head that makes q sharply peaked on arbitrary tokens."""
    drafter = tiny_drafter(target, head="domino", block_size=2, seed=11).double()
    torch.nn.init.normal_(drafter.head.out.weight, std=8.0)
    torch.nn.init.normal_(drafter.fc.weight, std=1.0)
    return drafter


def reduced_drafter(target):
    """A draft vocabulary of half the tokens: q is zero on the others, which only the residual reaches."""
    drafter = tiny_drafter(target, head="domino", block_size=2, seed=6, draft_vocab_size=3).double()
    drafter.set_draft_vocabulary(torch.tensor([0, 2, 5]))
    torch.nn.init.normal_(drafter.head.out.weight, std=2.0)
    return drafter


DRAFTERS = {
    "domino": lambda t: tiny_drafter(t, head="domino", block_size=2, seed=3).double(),
    "reduced": reduced_drafter,
    "bad": bad_drafter,
    "markov": lambda t: tiny_drafter(t, head="markov", block_size=2, seed=4).double(),
}


@pytest.mark.parametrize("name, params", [
    ("domino", SamplingParams(temperature=1.0)),
    ("bad", SamplingParams(temperature=1.5, top_p=0.9, top_k=4)),
    ("markov", SamplingParams(temperature=1.3)),
    ("reduced", SamplingParams(temperature=1.0)),
])
def test_generated_tokens_follow_the_target_distribution(target, name, params):
    drafter = DRAFTERS[name](target)
    counts: dict = {}
    accepted = 0
    for first in range(0, RUNS, BATCH):
        engine = DecodingEngine(target, drafter, block_size=2)
        states = [engine.add(f"s{seed}", PROMPT, GenerationConfig(NEW, sampling=params, stop_token_ids=[], seed=seed))
                  for seed in range(first, first + BATCH)]
        engine.add("greedy", PROMPT[:2], GenerationConfig(5, stop_token_ids=[]))
        while engine.has_work:
            engine.step()
        for state in states:
            counts[tuple(state.tokens)] = counts.get(tuple(state.tokens), 0) + 1
            accepted += sum(state.stats.accepted)
    law = exact_law(target, params)
    for positions in [(0,), (1,), (2,), (1, 2), (0, 1)]:
        observed = marginal({k: float(v) for k, v in counts.items()}, positions)
        p = chi_square_p(observed, marginal(law, positions), RUNS)
        assert p > 1e-3, (positions, p)
    # the drafts were really used: some were accepted, and (for the bad drafter) many rejected
    assert 0 < accepted < 2 * RUNS
