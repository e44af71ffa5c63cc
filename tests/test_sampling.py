"""At T > 0 the engine must produce exactly the target's sampling distribution, and a seeded request
must give the same tokens whatever shares its batch.

On a 6-token vocabulary we enumerate the target's exact law of the first five tokens (temperature,
top-k and top-p applied by an independent reference below, not by domino.sampling) and compare the
frequencies of 800 seeded generations with chi-square tests on every position, on pairs and on
the pooled joint. The drafter's head changes its proposals, rounds accept and reject drafts, and the
generations share batches with a greedy request and requests of other parameters."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from domino.engine import DecodingEngine
from domino.requests import GenerationConfig
from domino.sampling import RowSampling, SamplingParams, choice_seed, point_masses, probabilities, row_keys, uniforms
from domino.scheduler import ConfidenceScheduler, SPSProfile, ThresholdVerify
from domino.verify import speculative_accept
from helpers import tiny_drafter, tiny_target

VOCAB, NEW, RUNS, BATCH = 6, 5, 800, 80
PROMPT = [1, 2, 3, 4]
# the target's forwards are so cheap that drafting loses against plain rounds: the gate opens and shuts
FAST = SPSProfile(tokens=[1, 1000], seconds=[1e-4, 1e-4 + 999 * 1e-7])


@pytest.fixture(scope="module")
def target():
    target = tiny_target(vocab_size=VOCAB, hidden_size=32, num_layers=4, init_std=0.3, seed=5)
    target.model.double()
    return target


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """Temperature, then top-k, then top-p (the smallest most-likely set reaching top_p), in plain Python."""
    weights = [2.718281828459045 ** ((x - max(logits)) / params.temperature) for x in logits]
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    keep = order[:params.top_k] if params.top_k else order
    total, mass, kept = sum(weights[i] for i in keep), 0.0, []
    for i in keep:
        kept.append(i)
        mass += weights[i] / total
        if mass >= params.top_p:
            break
    norm = sum(weights[i] for i in kept)
    return [weights[i] / norm if i in kept else 0.0 for i in range(len(weights))]


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-6, 0.3, 0.95, 1.0])
def test_top_p_keeps_the_reference_set_down_to_the_smallest_float(top_p):
    logits = [2.0, 1.5, 0.2, -1.0, 3.1, 0.0]
    params = SamplingParams(temperature=0.7, top_p=top_p)
    got = probabilities(torch.tensor([logits]), params)[0].tolist()
    assert got == pytest.approx(reference_probs(logits, params), abs=1e-6)


def exact_law(target, params) -> dict:
    """P(t1, ..., t5) under the target's own sampling, for every path (one batched forward)."""
    paths = list(itertools.product(range(VOCAB), repeat=NEW))
    ids = torch.tensor([PROMPT + list(path) for path in paths])
    logits = target.model(ids).logits[:, len(PROMPT) - 1: -1].tolist()
    law = {}
    for path, rows in zip(paths, logits):
        p = 1.0
        for token, row in zip(path, rows):
            p *= reference_probs(row, params)[token]
        law[path] = p
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
    drafter = tiny_drafter(target, head="domino", block_size=3, seed=11).double()
    torch.nn.init.normal_(drafter.head.out.weight, std=8.0)
    torch.nn.init.normal_(drafter.fc.weight, std=1.0)
    return drafter


def reduced_drafter(target):
    """A draft vocabulary of half the tokens: q is zero on the others, which only the residual reaches."""
    drafter = tiny_drafter(target, head="domino", block_size=3, seed=6, draft_vocab_size=3).double()
    drafter.set_draft_vocabulary(torch.tensor([0, 2, 5]))
    torch.nn.init.normal_(drafter.head.out.weight, std=2.0)
    return drafter


def engines(target):
    """Each way of decoding: plain; full verification with the Domino head, a sharply wrong head, the
    Markov head, a reduced draft vocabulary, and copies from the text (point masses); threshold
    (screened); confidence (screened, gated)."""
    def drafter(confidence: bool):
        return tiny_drafter(target, head="domino", block_size=3, seed=3, confidence_head=confidence).double()
    return {
        "plain": lambda: DecodingEngine(target, None),
        "full": lambda: DecodingEngine(target, drafter(False)),
        "full-bad": lambda: DecodingEngine(target, bad_drafter(target)),
        "full-markov": lambda: DecodingEngine(target, tiny_drafter(target, head="markov", block_size=3, seed=4).double()),
        "full-reduced": lambda: DecodingEngine(target, reduced_drafter(target)),
        "full-lookup": lambda: DecodingEngine(target, tiny_drafter(target, head="markov", block_size=3, seed=4,
                                                                   lookup_ngram=2, lookup_min_ngram=1).double()),
        "threshold": lambda: DecodingEngine(target, drafter(True), policy=ThresholdVerify(0.05)),
        "confidence": lambda: DecodingEngine(target, drafter(True), policy=ConfidenceScheduler(FAST, padded=False)),
    }


def generate_all(make_engine, params, seeds, batch=BATCH, others=True):
    """{seed: tokens} for seeded requests decoded `batch` at a time, beside a greedy request and one
    with other parameters when `others`; also the drafts proposed and accepted."""
    tokens, proposed, accepted = {}, 0, 0
    seeds = list(seeds)
    for first in range(0, len(seeds), batch):
        engine = make_engine()
        states = {seed: engine.add(f"s{seed}", PROMPT, GenerationConfig(NEW, sampling=params, stop_token_ids=[],
                                                                          seed=seed))
                  for seed in seeds[first:first + batch]}
        if others:
            engine.add("greedy", PROMPT[:2], GenerationConfig(7, stop_token_ids=[]))
            engine.add("other", PROMPT[1:], GenerationConfig(6, sampling=SamplingParams(0.7, top_k=2),
                                                             stop_token_ids=[], seed=first))
        while engine.has_work:
            engine.step()
        for seed, state in states.items():
            tokens[seed] = state.tokens
            proposed += sum(state.stats.proposed)
            accepted += sum(state.stats.accepted)
    return tokens, proposed, accepted


# (parameters, the engines run): plain and verification at T = 1; plain, the wrong head and the screened,
# gated engine with top-p and top-k; the Markov head, the reduced vocabulary and context lookup at T = 1.3
CASES = {"t1": (SamplingParams(temperature=1.0), ["plain", "full", "threshold", "confidence"]),
         "top-p-k": (SamplingParams(temperature=1.4, top_p=0.8, top_k=4), ["plain", "full-bad", "confidence"]),
         "t1.3": (SamplingParams(temperature=1.3), ["full-markov", "full-reduced", "full-lookup"])}


@pytest.fixture(scope="module", params=list(CASES))
def generations(request, target):
    """Each engine's tokens for the same seeds."""
    params, names = CASES[request.param]
    return params, {name: generate_all(engines(target)[name], params, range(RUNS)) for name in names}


def test_generated_tokens_follow_the_target_distribution(target, generations):
    params, outputs = generations
    law = exact_law(target, params)
    for name, (tokens, proposed, accepted) in outputs.items():
        counts: dict = {}
        for path in tokens.values():
            counts[tuple(path)] = counts.get(tuple(path), 0) + 1
        for positions in [(0,), (1,), (2,), (3,), (4,), (0, 1), (3, 4), tuple(range(NEW))]:
            p = chi_square_p(marginal(counts, positions), marginal(law, positions), RUNS)
            assert p > 1e-3, (name, positions, p)
        if name != "plain":  # the drafts were really judged: some accepted, some rejected
            assert 0 < accepted < proposed, (name, accepted, proposed)


@pytest.mark.parametrize("name", ["plain", "full", "threshold"])
def test_a_seeded_request_alone_equals_it_in_any_batch(target, name):
    """Where verify lengths are each row's own (not the confidence scheduler's, which weighs the batch)."""
    params = SamplingParams(temperature=1.0)
    make = engines(target)[name]
    alone, _, _ = generate_all(make, params, range(8), batch=1, others=False)
    crowded, _, _ = generate_all(make, params, range(8), batch=8)
    assert alone == crowded


def test_a_dflash_drafters_seeded_request_alone_equals_it_beside_longer_ones(target):
    """A DFlash-convention block shrinks near a request's end, as DFlash's reference loop does, and its
    drafts depend on its length (no causal mask): each row's block must be its own, not the longest row's."""
    def make():
        return DecodingEngine(target, tiny_drafter(target, head="none", label_convention="dflash", block_size=6,
                                                   seed=5).double())
    params = SamplingParams(temperature=1.0)
    alone, _, _ = generate_all(make, params, range(40), batch=1, others=False)
    beside = {}
    for seed in range(40):
        engine = make()
        state = engine.add("short", PROMPT, GenerationConfig(NEW, sampling=params, stop_token_ids=[], seed=seed))
        engine.add("long", PROMPT[1:], GenerationConfig(4 * NEW, sampling=params, stop_token_ids=[], seed=seed + 99))
        while engine.has_work:
            engine.step()
        beside[seed] = state.tokens
    assert alone == beside


def test_max_tokens_one_finishes_at_prefill_and_leaves_nothing_behind(target):
    engine = engines(target)["full"]()
    states = [engine.add(f"r{i}", PROMPT, GenerationConfig(1, sampling=SamplingParams(temperature=1.0 * (i % 2)),
                                                           stop_token_ids=[], seed=i)) for i in range(6)]
    events = engine.step()
    assert [len(e.tokens) for e in events] == [1] * 6 and all(e.finished for e in events)
    assert all(s.result.finish_reason == "length" and len(s.tokens) == 1 for s in states)
    assert not engine.has_work and not engine.states and engine.caches is None
    plain, _, _ = generate_all(engines(target)["plain"], SamplingParams(temperature=1.0), [1, 3, 5], others=False)
    assert [states[i].tokens[0] for i in (1, 3, 5)] == [plain[i][0] for i in (1, 3, 5)]


def test_the_acceptance_test_reads_the_uniform_at_full_precision():
    """Draft d passes when u q(d) < p(d): a uniform just below p (closer than float32 can tell) passes."""
    p = 1 - 2 ** -24  # float32's largest number below 1
    target_probs = torch.tensor([[[p, 1 - p], [0.5, 0.5]]])
    draft_probs = torch.tensor([[[1.0, 0.0]]])
    accept_u = torch.tensor([[p - 2 ** -40]], dtype=torch.float64)  # uniforms come in float64
    target_u = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    accepted, _ = speculative_accept(torch.tensor([[0]]), draft_probs, target_probs, accept_u, target_u,
                                     torch.tensor([1]))
    assert accepted.tolist() == [1]


def test_point_masses_are_one_hot_distributions_in_the_asked_dtype():
    tokens = torch.tensor([[3, 0, 6], [5, 2, 2]])
    masses = point_masses(tokens, 7, torch.float64)
    assert masses.dtype == torch.float64 and torch.equal(masses, F.one_hot(tokens, 7).double())


def splitmix64(x: int) -> int:
    """The textbook splitmix64 output function on Python ints: the oracle for the numpy one."""
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_uniforms_are_splitmix64_over_seed_start_offset_and_purpose():
    """The vectorised numbers equal the scalar definition bit for bit, wrapping included (negative and
    63-bit seeds), so a seed's tokens do not depend on how the numbers are computed."""
    seeds = [0, 1, -1, 12345, -(1 << 53) + 1, (1 << 63) - 1, 0x9E3779B97F4A7C15 >> 1]
    starts = [0, 7, 2047, 3, 100000, 1, 42]
    for purpose in range(3):
        u = uniforms(row_keys(seeds, starts), range(2, 9), purpose)
        for r, (seed, start) in enumerate(zip(seeds, starts)):
            for k, offset in enumerate(range(2, 9)):
                x = splitmix64(seed & ((1 << 64) - 1))
                for value in (start, offset, purpose):
                    x = splitmix64(x ^ value)
                assert u[r, k] == ((x >> 11) + 0.5) * 2.0 ** -53
    assert 0 < u.min() and u.max() < 1
    assert [choice_seed(-5, i) for i in range(3)] == [-5] + [splitmix64(splitmix64((-5) & ((1 << 64) - 1)) ^ i) >> 1
                                                            for i in (1, 2)]
    rows = RowSampling([SamplingParams(0.7), SamplingParams(), SamplingParams(1.0)], [seeds[0], None, seeds[2]],
                       torch.tensor(starts[:3]))
    table = rows.uniforms(1, range(2, 9))
    assert table.dtype == torch.float64 and (table[1] == 0.5).all()  # a greedy row draws nothing
    assert torch.equal(table[[0, 2]], torch.from_numpy(uniforms(row_keys(seeds[:3:2], starts[:3:2]), range(2, 9), 1)))
