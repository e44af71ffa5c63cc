"""The batched engine: many requests per forward, each with its own lengths, parameters and seeds."""

import itertools
import math
import random
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from domino.engine import PREFILL_CHUNK, DecodingEngine, StepTimes
from domino.errors import DominoError
from domino.requests import GenerationConfig
from domino.sampling import SamplingParams
from domino.scheduler import ConfidenceScheduler, GatedFullVerify, SPSProfile, ThresholdVerify, profile_sps
from helpers import tiny_drafter, tiny_target
from test_decoding import NoisyOracle, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def target():
    target = tiny_target(init_std=0.1)
    target.model.double()
    return target


def run_batch(engine, requests, join_at=None, cancel=None):
    """Drive `engine` until done; requests is {id: (prompt, config)}; ids in `join_at` {id: step} join
    later; `cancel` {id: step} leave. Returns {id: committed tokens}."""
    join_at, cancel = join_at or {}, cancel or {}
    got = {rid: [] for rid in requests}
    step = 0
    for rid, (prompt, config) in requests.items():
        if rid not in join_at:
            engine.add(rid, prompt, config)
    while engine.has_work or any(s >= step for s in join_at.values()):
        for rid, at in join_at.items():
            if at == step:
                engine.add(rid, *requests[rid])
        for rid, at in cancel.items():
            if at == step:
                engine.cancel(rid)
        for event in engine.step():
            got[event.request_id] += event.tokens
        step += 1
    return got


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 5])  # 5: prompts of up to 39 tokens join in chunks
@pytest.mark.parametrize("drafter", ["domino", "domino-lookup", "noisy-oracle", "none"])
def test_batched_greedy_outputs_equal_each_requests_own(target, drafter, chunk):
    prompts = list(random_prompts(7, seed=11))
    requests = {}
    for i, prompt in enumerate(prompts):
        stop = hf_greedy(target, prompt, 30)[5 + 3 * i] if i % 3 == 0 else None  # some stop mid-way
        config = GenerationConfig(max_new_tokens=12 + 5 * i, stop_token_ids=[stop] if stop is not None else [])
        requests[f"r{i}"] = (prompt, config)
    if drafter.startswith("domino"):  # with lookup, rows copy from their own text while others draft
        lookup = 2 if drafter == "domino-lookup" else 0
        engine = DecodingEngine(target, tiny_drafter(target, head="domino", block_size=6, lookup_ngram=lookup).double(),
                                prefill_chunk=chunk)
    elif drafter == "noisy-oracle":
        engine = NoisyOracle(target, "oracle", block_size=6, prefill_chunk=chunk)
    else:
        engine = DecodingEngine(target, None, prefill_chunk=chunk)
    got = run_batch(engine, requests, join_at={"r4": 2, "r5": 3, "r6": 9})
    for rid, (prompt, config) in requests.items():
        stop = config.stop_token_ids[0] if config.stop_token_ids else None
        assert got[rid] == hf_greedy(target, prompt, config.max_new_tokens, stop=stop), rid
    assert engine.caches is None and not engine.states  # everything retired


def test_a_steps_times_count_a_shared_round_once(target):
    """A round's drafting and verifying serve every row in it; each request's stats count them in full, so
    their sum over a batch counts a second once per row. The engine's own per-step times count it once:
    they add up to no more than the wall time of the steps, and to no less than any one request's share."""
    engine = DecodingEngine(target, tiny_drafter(target, block_size=6).double())
    results, spent = {}, StepTimes()
    for i, prompt in enumerate(random_prompts(6, seed=3)):
        engine.add(f"r{i}", prompt, GenerationConfig(max_new_tokens=16, stop_token_ids=[]))
    start = time.perf_counter()
    while engine.has_work:
        results.update((e.request_id, e.result) for e in engine.step() if e.finished)
        for name in ("prefill_s", "draft_s", "verify_s"):
            setattr(spent, name, getattr(spent, name) + getattr(engine.last_step, name))
    wall = time.perf_counter() - start
    stats = [result.stats for result in results.values()]
    assert spent.prefill_s + spent.draft_s + spent.verify_s <= wall
    assert spent.prefill_s == pytest.approx(sum(s.prefill_s for s in stats))  # a prefill is one request's
    assert max(s.verify_s for s in stats) <= spent.verify_s < sum(s.verify_s for s in stats)
    assert max(s.draft_s for s in stats) <= spent.draft_s < sum(s.draft_s for s in stats)


def test_a_long_prompt_prefills_in_chunks_while_the_batch_goes_on(target):
    """A prompt of 8 chunks joins over 8 steps: the row in flight commits tokens at each of them, and a
    short request that came after the long one starts first."""
    engine = DecodingEngine(target, tiny_drafter(target, head="domino", block_size=4).double(), prefill_chunk=5)
    config = GenerationConfig(max_new_tokens=30, stop_token_ids=[])
    engine.add("early", [1, 2, 3], config)
    engine.step()
    engine.add("long", list(range(40)), config)
    engine.add("short", [4, 5, 6], config)
    started = {}
    for step in range(8):
        events = {e.request_id: e for e in engine.step()}
        assert events["early"].tokens, step  # the batch goes on between the long prompt's chunks
        for rid in ("long", "short"):
            if rid in events:
                started.setdefault(rid, step)
    assert started == {"short": 0, "long": 7}


def test_prefills_in_flight_count_against_max_rows(target):
    """A request that is prefilling holds a cache already: with max_rows=1, long prompts prefill one at
    a time, each after the row before it finished."""
    engine = DecodingEngine(target, None, max_rows=1, prefill_chunk=8)
    for i in range(4):
        engine.add(f"r{i}", list(range(i, i + 40)), GenerationConfig(max_new_tokens=3, stop_token_ids=[]))
    held = 0
    while engine.has_work:
        engine.step()
        held = max(held, len(engine.ids) + len(engine.prefills))
    assert held == 1


def test_requests_beyond_max_rows_wait_their_turn(target):
    """With max_rows=2, five requests are decoded at most two at a time, started in the order they came,
    and each still gives the target's greedy tokens."""
    engine = DecodingEngine(target, tiny_drafter(target, head="domino", block_size=4).double(), max_rows=2)
    prompts = list(random_prompts(5, seed=33))
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, GenerationConfig(max_new_tokens=6 + 3 * i, stop_token_ids=[]))
    got, started, widest = {f"r{i}": [] for i in range(5)}, [], 0
    while engine.has_work:
        for event in engine.step():
            if not got[event.request_id]:
                started.append(event.request_id)
            got[event.request_id] += event.tokens
        widest = max(widest, len(engine.ids))
    assert widest == 2 and started == [f"r{i}" for i in range(5)]
    assert got == {f"r{i}": hf_greedy(target, p, 6 + 3 * i) for i, p in enumerate(prompts)}
    with pytest.raises(DominoError, match="max_rows must be at least 1"):
        DecodingEngine(target, max_rows=0)
    with pytest.raises(DominoError, match="prefill_chunk must be at least 1"):
        DecodingEngine(target, prefill_chunk=0)


def test_cancelled_request_does_no_further_work(target):
    engine = DecodingEngine(target, tiny_drafter(target, head="none").double())
    prompts = list(random_prompts(2, seed=3))
    engine.add("keep", prompts[0], GenerationConfig(max_new_tokens=40, stop_token_ids=[]))
    gone = engine.add("gone", prompts[1], GenerationConfig(max_new_tokens=40, stop_token_ids=[]))
    engine.step()
    engine.step()
    engine.cancel("gone")
    produced = list(gone.tokens)
    seen = set()
    while engine.has_work:
        seen.update(e.request_id for e in engine.step())
    assert seen == {"keep"} and gone.tokens == produced and not gone.finished


def test_compaction_keeps_outputs_exact(target):
    """Long generations with many rejections pile up holes; compaction bounds them without changing
    anything."""
    engine = NoisyOracle(target, "oracle", block_size=12)
    prompts = list(random_prompts(3, seed=5))
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, GenerationConfig(max_new_tokens=120, stop_token_ids=[]))
    got = {f"r{i}": [] for i in range(3)}
    saw_holes = False
    while engine.has_work:
        for event in engine.step():
            got[event.request_id] += event.tokens
        if engine.caches is not None:
            saw_holes |= not bool(engine.caches.valid.all())
            assert engine.caches.valid.shape[1] <= 2 * int(engine.caches.positions.max()) + 16
    assert saw_holes
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(target, prompt, 120)


# -- verify-length policies ----------------------------------------------------------------------

def test_a_speed_profile_needs_two_sizes(target):
    with pytest.raises(DominoError, match="must be at least 2, got 1"):
        profile_sps(target, max_tokens=1)


LINEAR = SPSProfile(tokens=[1, 1000], seconds=[0.010, 0.010 + 999 * 0.001])  # 10 ms + 1 ms per token
# 1 ms a token, but a step to 2 tokens costs 1.5 ms: drafts can pay only for a lone request
STEP_UP = SPSProfile(tokens=[1, 2, 1000], seconds=[0.001, 0.0015, 0.9995])


def theta(lengths, survive, sps, padded):
    tau = sum(1 + sum(survive[r][:l]) for r, l in enumerate(lengths))
    cost = len(lengths) * (1 + max(lengths)) if padded else sum(1 + l for l in lengths)
    return tau * sps(cost)


def test_scheduler_maximises_theta_on_small_cases():
    torch.manual_seed(0)
    for trial in range(20):
        confidence = torch.rand(3, 4) ** 0.3
        caps = torch.tensor([4, 3, 4])
        survive = torch.cumprod(confidence.double(), dim=1).tolist()
        lengths = ConfidenceScheduler(LINEAR, padded=False).lengths(caps, confidence).tolist()
        best = max(itertools.product(*(range(c + 1) for c in caps.tolist())),
                   key=lambda ls: theta(ls, survive, LINEAR, False))
        assert theta(lengths, survive, LINEAR, False) == pytest.approx(theta(best, survive, LINEAR, False)), trial


def test_scheduler_admits_by_survival_and_stops_at_the_first_drop():
    # row 0 is very confident, row 1 hopeless: row 0 gets long drafts, row 1 none
    confidence = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.05, 0.9, 0.9, 0.9]])
    lengths = ConfidenceScheduler(LINEAR, padded=False).lengths(torch.tensor([4, 4]), confidence)
    assert lengths.tolist() == [4, 0]
    # a later position with high confidence is never admitted before its weak prefix
    costly = SPSProfile(tokens=[1, 1000], seconds=[0.010, 0.010 + 999 * 0.004])
    confidence = torch.tensor([[0.2, 1.0, 1.0, 1.0], [0.9, 0.9, 0.9, 0.9]])
    assert ConfidenceScheduler(costly, padded=False).lengths(torch.tensor([4, 4]), confidence).tolist() == [0, 3]
    # first drop: admitting the next position lowers theta, so admission ends even though
    # a longer draft would win again (a step cost of 10 tokens, then flat)
    steps = SPSProfile(tokens=[1, 2, 3, 12, 100], seconds=[1.0, 2.0, 2.0, 2.0, 2.0])
    confidence = torch.tensor([[0.4, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    assert ConfidenceScheduler(steps, padded=False).lengths(torch.tensor([8]), confidence).tolist() == [0]


def test_a_copy_run_is_judged_whole_where_its_first_copy_alone_would_not_pay():
    """This CPU's cost shape: a 2-token verify costs what a 16-token one does. A copy run (confidences
    fixed by the text) is admitted to the cap as a whole; the same confidences on learned drafts, whose
    later confidences read the drafts before them, stop at the first drop."""
    step = SPSProfile(tokens=[1, 2, 1000], seconds=[1.0, 2.0, 2.0])
    strong, copied = torch.tensor([[0.74] + [0.75] * 6]), torch.tensor([[True] * 7])
    scheduler = ConfidenceScheduler(step, padded=False)
    assert scheduler.lengths(torch.tensor([7]), strong).tolist() == [0]
    assert scheduler.lengths(torch.tensor([7]), strong, copied).tolist() == [7]  # 1 + 2.57 tokens for 2 steps
    assert scheduler.lengths(torch.tensor([1]), strong, copied).tolist() == [0]  # a run of one is one copy
    weak = torch.tensor([[0.24] + [0.75] * 6])  # 1 + 0.83 tokens for 2 steps
    assert scheduler.lengths(torch.tensor([7]), weak, copied).tolist() == [0]
    # a copy run that starts after learned drafts is judged whole from its first copy (here the step
    # comes after 3 tokens, so the two learned drafts pay alone)
    later, run = torch.tensor([[0.99, 0.99] + [0.9] * 5]), torch.tensor([[False, False] + [True] * 5])
    wide_step = ConfidenceScheduler(SPSProfile(tokens=[1, 3, 4, 1000], seconds=[1.0, 1.0, 2.0, 2.0]), padded=False)
    assert wide_step.lengths(torch.tensor([7]), later).tolist() == [2]
    assert wide_step.lengths(torch.tensor([7]), later, run).tolist() == [7]


def test_a_drop_closes_only_its_own_row():
    """Row 1's learned first draft comes first and lowers Theta: its row closes, and row 0's copy run,
    judged after it, is still admitted (padded: row 1 is then verified to the same length for free)."""
    step = SPSProfile(tokens=[1, 2, 3, 1000], seconds=[1.0, 1.0, 2.0, 2.0])  # two rows alone cost 2 tokens
    confidence = torch.tensor([[0.74] + [0.75] * 6, [0.8] + [0.75] * 6])
    copied = torch.tensor([[True] * 7, [False] * 7])
    caps = torch.tensor([7, 7])
    assert ConfidenceScheduler(step, padded=False).lengths(caps, confidence, copied).tolist() == [7, 0]
    assert ConfidenceScheduler(step, padded=True).lengths(caps, confidence, copied).tolist() == [7, 7]
    assert ConfidenceScheduler(step, padded=False).lengths(caps, confidence).tolist() == [0, 0]


def copy_rows(draw, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random confidences and copy masks shaped as drafts are: a row copies from some position to the end."""
    confidence = torch.tensor([[draw(st.floats(0.3, 1.0)) for _ in range(cols)] for _ in range(rows)])
    starts = [draw(st.integers(0, cols + 1)) for _ in range(rows)]  # > cols - 1: no copies
    return confidence, torch.arange(cols)[None, :] >= torch.tensor(starts)[:, None]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), rows=st.integers(1, 3), cols=st.integers(1, 6), padded=st.booleans(),
       profile=st.sampled_from([LINEAR, SPSProfile([1, 2, 1000], [1.0, 2.0, 2.0]),
                                SPSProfile([1, 3, 4, 1000], [1.0, 1.0, 1.6, 1.6])]))
def test_whether_a_draft_is_verified_never_reads_the_drafts_from_it_on(data, rows, cols, padded, profile):
    """What makes scheduled verification lossless at T > 0: whether draft j of a row is verified may read
    the row's confidences up to j and, where j is a copy, its run's (fixed with the run, by the text
    before it), but nothing that depends on draft j or later ones. So redrawing a row's later learned
    confidences and where a later copy run starts never changes whether draft j is verified."""
    confidence, copied = copy_rows(data.draw, rows, cols)
    caps = torch.tensor([data.draw(st.integers(0, cols)) for _ in range(rows)])
    scheduler = ConfidenceScheduler(profile, padded=padded)
    lengths = scheduler.lengths(caps, confidence, copied)
    r = data.draw(st.integers(0, rows - 1))
    for j in range(int(caps[r])):
        if copied[r, j]:
            continue  # the run's confidences and extent are known at j
        other_confidence, other_copied = copy_rows(data.draw, 1, cols)
        confidence2, copied2 = confidence.clone(), copied.clone()
        confidence2[r, j + 1:] = other_confidence[0, j + 1:]
        copied2[r, j + 1:] = other_copied[0, j + 1:]
        redrawn = scheduler.lengths(caps, confidence2, copied2)
        assert bool(redrawn[r] > j) == bool(lengths[r] > j), (r, j, lengths.tolist(), redrawn.tolist())


def test_padded_scheduler_tops_rows_up_to_the_longest():
    """Padded cost 3 * (1 + max l): admitting (0,0) and (2,0) raises theta, (0,1) would lower it. Row 1
    admitted nothing, but verifying up to the batch's longest length costs nothing more: it gets 1."""
    confidence = torch.tensor([[0.99, 0.99, 0.99], [0.1, 0.9, 0.9], [0.99, 0.5, 0.1]])
    lengths = ConfidenceScheduler(LINEAR, padded=True).lengths(torch.tensor([3, 3, 2]), confidence)
    assert lengths.tolist() == [1, 1, 1]
    assert ConfidenceScheduler(LINEAR, padded=True).lengths(torch.tensor([3, 0, 2]), confidence).tolist() == [1, 0, 1]


def test_threshold_policy_cuts_where_the_prefix_becomes_unlikely():
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.9, 0.9, 0.9]])
    lengths = ThresholdVerify(0.7).lengths(torch.tensor([4, 4]), confidence)
    assert lengths.tolist() == [3, 0]  # 0.9, 0.81, 0.729 >= 0.7 > 0.656; 0.5 < 0.7


@pytest.mark.parametrize("policy", [ConfidenceScheduler(LINEAR), ThresholdVerify(0.5)])
def test_scheduled_verification_stays_exact(target, policy):
    drafter = tiny_drafter(target, head="rnn", confidence_head=True, block_size=6).double()
    engine = DecodingEngine(target, drafter, policy=policy)
    requests = {f"r{i}": (p, GenerationConfig(max_new_tokens=25, stop_token_ids=[]))
                for i, p in enumerate(random_prompts(5, seed=2))}
    got = run_batch(engine, requests, join_at={"r3": 1})
    for rid, (prompt, config) in requests.items():
        assert got[rid] == hf_greedy(target, prompt, 25)


def test_first_position_screen_agrees_with_the_full_admission():
    """admits_any, which sees only the first drafted position, says yes exactly when the full
    schedule verifies something: the engine relies on it to stop a draft before its LM head."""
    generator = torch.Generator().manual_seed(3)
    cheap = SPSProfile(tokens=[1, 1000], seconds=[0.010, 0.010 + 999 * 0.0001])
    policies = [ConfidenceScheduler(LINEAR), ConfidenceScheduler(cheap), ConfidenceScheduler(cheap, padded=False),
                ThresholdVerify(0.5)]
    answers = []
    for trial in range(400):
        policy = policies[trial % len(policies)]
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        confidence = torch.rand(rows, 5, generator=generator) ** float(torch.rand(1, generator=generator) * 4)
        caps = torch.randint(0, 6, (rows,), generator=generator)
        answer = policy.admits_any(caps, confidence[:, 0])
        assert answer == bool(policy.lengths(caps, confidence).max() > 0), trial
        answers.append(answer)
    assert 0.2 < sum(answers) / len(answers) < 0.8  # both answers were exercised


def test_a_round_no_draft_could_pay_for_is_never_admitted():
    """could_pay, which sees only the caps, says no only where no confidences and no copy runs would get
    a draft verified: the engine relies on it to skip drafting."""
    generator = torch.Generator().manual_seed(4)
    answers = []
    for trial in range(300):
        # as on a CPU: a step to 2 tokens costs `jump` decode steps, up to 16 costs little more, then 1 ms a token
        jump = 1 + 2 * float(torch.rand(1, generator=generator))
        profile = SPSProfile(tokens=[1, 2, 16, 1000], seconds=[0.01, 0.01 * jump, 0.011 * jump, 0.011 * jump + 0.984])
        policy = ConfidenceScheduler(profile, padded=trial % 2 == 0)
        rows = int(torch.randint(1, 41, (1,), generator=generator))
        caps = torch.randint(0, 9, (rows,), generator=generator)
        certain = torch.rand(rows, 1, generator=generator) < 0.5  # the worst case: drafts sure to pass
        confidence = torch.where(certain, 1.0, torch.rand(rows, 8, generator=generator) ** 0.1)
        copied = torch.rand(rows, 8, generator=generator) < 0.7
        if not policy.could_pay(caps):
            assert policy.lengths(caps, confidence, copied).max() == 0, trial
        answers.append(policy.could_pay(caps))
    assert 0.2 < sum(answers) / len(answers) < 0.8  # both answers were exercised


@pytest.mark.parametrize("gated", [ConfidenceScheduler, GatedFullVerify])
def test_a_batch_no_draft_could_pay_for_does_not_draft(target, monkeypatch, gated):
    """Under STEP_UP, drafting can pay only for a lone request: rounds of two or three requests run no
    drafter forward at all, not even the gate's exploratory ones, and the outputs stay the target's."""
    drafter = tiny_drafter(target, head="domino", confidence_head=True, block_size=4).double()
    engine = DecodingEngine(target, drafter, policy=gated(STEP_UP))
    drafted_rows, real_draft = [], drafter.draft

    def counted_draft(context, anchors, *rest, **named):
        drafted_rows.append(len(anchors))
        return real_draft(context, anchors, *rest, **named)

    monkeypatch.setattr(drafter, "draft", counted_draft)
    budgets = [6, 12, 30]
    requests = {f"r{i}": (p, GenerationConfig(max_new_tokens=n, stop_token_ids=[]))
                for i, (p, n) in enumerate(zip(random_prompts(3, seed=5), budgets))}
    got = run_batch(engine, requests)
    for rid, (prompt, config) in requests.items():
        assert got[rid] == hf_greedy(target, prompt, config.max_new_tokens)
    assert drafted_rows and set(drafted_rows) == {1}


def test_confidence_policy_needs_a_confidence_head(target):
    with pytest.raises(DominoError, match="verify 'threshold' needs a drafter trained with a confidence head.*; "
                                          "this drafter has none"):
        DecodingEngine(target, tiny_drafter(target), policy=ThresholdVerify())
    with pytest.raises(DominoError, match="; decoding without a drafter has none"):
        DecodingEngine(target, None, policy=ThresholdVerify())
    for threshold in (0.0, 1.0, 1.5):  # a survival probability strictly between 0 and 1
        with pytest.raises(DominoError, match="between 0 and 1"):
            ThresholdVerify(threshold)


def plain_rounds_until_draft(gate, rows: int) -> int:
    skipped = 0
    while not gate.wants_draft(rows):
        skipped += 1
    return skipped


def test_gate_judges_drafting_by_its_average_and_backs_off_while_it_loses():
    from domino.scheduler import SpeculationGate

    gate = SpeculationGate(LINEAR)  # a plain round of 4 rows: 4 tokens in 13 ms; of 5 rows: 14 ms

    def drafted(rows: int, committed: int, seconds: float) -> None:  # verify forwards as profiled
        gate.observe(True, rows, committed, seconds, verify_tokens=rows, verify_seconds=LINEAR.seconds_at(rows))

    drafted(4, 8, 0.013)  # 8 tokens in one plain round's time: won a round; the mean starts from 4 rounds at even
    record = gate.records[3]
    assert record.mean == pytest.approx(-1 / 5) and gate.wants_draft(4)
    drafted(4, 5, 0.026)  # lost 2 - 5/4 = 0.75 rounds, but on average drafting still wins: no back-off
    assert record.mean == pytest.approx(-1 / 5 + (0.75 + 1 / 5) / 6) and gate.wants_draft(4)
    # a second loss puts the mean at a loss, not yet a sure one: plain rounds for long enough that a
    # drafted round's expected loss stays under 5 % of them
    drafted(4, 5, 0.026)
    assert 0 < record.mean and not record.sure_losses
    assert plain_rounds_until_draft(gate, 4) == math.ceil(record.mean / 0.05)
    while not record.sure_losses:  # the same loss again and again makes it sure
        drafted(5, 6, 0.056)  # 5 rows: the same class; lost 4 - 6/5 rounds
    assert plain_rounds_until_draft(gate, 7) == math.ceil(record.mean / 0.05)
    drafted(5, 6, 0.056)  # and each sure loss after it stretches the back-off 4-fold
    assert record.sure_losses == 2 and plain_rounds_until_draft(gate, 7) == math.ceil(record.mean / 0.05 * 4)
    for _ in range(6):
        drafted(4, 5, 0.050)
    assert record.skip == gate.max_backoff == 1024
    # losing at 4 rows says nothing about 1 or 32 rows: those classes still draft
    assert gate.wants_draft(1) and gate.wants_draft(32) and not gate.wants_draft(6)
    for _ in range(20):  # wins bring the mean back to a gain, and the gate opens
        drafted(4, 32, 0.013)
    assert record.mean < 0 and record.sure_losses == 0 and not record.skip and gate.wants_draft(4)
    # target forwards that run slower than profiled make drafting look better by the same factor
    gate.observe(False, 4, 4, 0.026, verify_tokens=4, verify_seconds=0.026)
    assert gate.calibration == pytest.approx(0.75)


def gate_run(outcomes: Iterator[int], cost: float, rounds: int = 1000) -> tuple[float, float]:
    """A gate at one request per round, over `rounds` rounds of a drafter whose drafted rounds commit the
    next of `outcomes` tokens each, at `cost` plain rounds a drafted round: the share of rounds drafted,
    and the plain rounds lost per round (negative: gained)."""
    from domino.scheduler import SpeculationGate

    gate = SpeculationGate(LINEAR)
    step = LINEAR.seconds_at(1)
    drafted = lost = 0.0
    for _ in range(rounds):
        if gate.wants_draft(1):
            committed = next(outcomes)
            gate.observe(True, 1, committed, cost * step, verify_tokens=1, verify_seconds=step)
            drafted, lost = drafted + 1, lost + cost - committed
    return drafted / rounds, lost / rounds


def block_outcomes(seed: int, passes: float) -> Iterator[int]:
    """Tokens committed by drafted rounds whose drafts each pass with chance `passes` (a block of 8)."""
    rng = random.Random(seed)
    while True:
        committed = 1
        while committed < 9 and rng.random() < passes:
            committed += 1
        yield committed


def test_gate_stays_open_through_a_losing_streak_of_a_drafter_that_wins_on_average():
    """A drafter whose first draft passes a third of the time, at 1.2 plain rounds a drafted round: it loses
    two rounds of three and gains 0.3 tokens a round on average. Judged round by round it would be shut
    out for most of a request; judged by its average it drafts every round."""
    assert gate_run(itertools.cycle([3, 1, 1]), cost=1.2, rounds=120)[0] == 1.0


def test_gate_keeps_drafting_a_winner_whatever_its_first_rounds():
    """A drafter that loses 60 % of its rounds and gains 0.26 rounds a round on average: four losses in a row
    come early in many runs. A gate that grew its back-off with every loss in a row drafted in under half the
    rounds in 7 of these 20 runs (0.006 at worst, 0.64 on average); this one grows it only while the loss is
    sure."""
    shares = [gate_run(block_outcomes(seed, passes=0.4), cost=1.4)[0] for seed in range(20)]
    assert min(shares) > 0.8, shares


@pytest.mark.parametrize("passes, cost, most", [(0.3, 1.6, 0.05), (0.0, 2.4, 0.015)])
def test_gate_bounds_what_a_losing_drafter_costs(passes, cost, most):
    """A drafter slightly worse than plain decoding costs at most 5 % of the rounds (the gate's `explore`); a
    hopeless one (no draft ever passes, 2.4 rounds a drafted round) far less, as its sure loss stretches the
    back-off."""
    assert max(gate_run(block_outcomes(seed, passes), cost)[1] for seed in range(20)) <= most


@pytest.mark.parametrize("gated, lookup", [(ConfidenceScheduler, 0), (GatedFullVerify, 0), (ConfidenceScheduler, 1)])
def test_gated_engine_stays_exact(target, gated, lookup):
    """With the gate closing and opening, outputs stay the target's greedy outputs; while it is shut
    the drafter's features wait unprojected through rows leaving and joining. With context lookup, rounds
    in which every row can copy draft whatever the gate says."""
    policy = gated(SPSProfile(tokens=[1, 1000], seconds=[1e-4, 1e-4 + 999 * 1e-7]))
    drafter = tiny_drafter(target, head="domino", confidence_head=gated is ConfidenceScheduler, block_size=4,
                           lookup_ngram=lookup, lookup_min_ngram=1).double()
    engine = DecodingEngine(target, drafter, policy=policy)
    prompts = list(random_prompts(4, seed=9))
    budgets = [30, 12, 22, 16]
    got = {f"r{i}": [] for i in range(4)}
    for i in range(3):
        engine.add(f"r{i}", prompts[i], GenerationConfig(max_new_tokens=budgets[i], stop_token_ids=[]))
    most_staged, step = 0, 0
    while engine.has_work:
        if step == 6:
            engine.add("r3", prompts[3], GenerationConfig(max_new_tokens=budgets[3], stop_token_ids=[]))
        for event in engine.step():
            got[event.request_id] += event.tokens
        if engine.caches is not None:
            most_staged = max(most_staged, len(engine.caches.context.staged))
        step += 1
    assert any(record.mean > 0 for record in policy.gate.records.values())  # a random drafter loses to so fast a target
    assert most_staged > 3  # features waited several rounds
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(target, prompt, budgets[i]), i


# -- edges: the context limit, broken rows, log-probabilities ------------------------------------


def test_padded_slots_stay_inside_a_learned_position_table():
    """A row one token from its budget verifies nothing while its neighbour verifies a full block: its
    padding slots must not index past GPT-2's position table (64 positions here)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from domino.target import Target

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=None,
                        eos_token_id=None)
    gpt2 = Target(GPT2LMHeadModel(config).double().eval(), tokenizer=None, name="tiny-gpt2")
    prompts = [list(range(1, 40)), [5, 6, 7]]
    engine = NoisyOracle(gpt2, "oracle", block_size=6)
    requests = {"edge": (prompts[0], GenerationConfig(max_new_tokens=25, stop_token_ids=[])),
                "short": (prompts[1], GenerationConfig(max_new_tokens=40, stop_token_ids=[]))}
    got = run_batch(engine, requests)
    for rid, (prompt, config) in requests.items():
        assert got[rid] == hf_greedy(gpt2, prompt, config.max_new_tokens), rid


def test_a_row_with_broken_logits_fails_alone(target):
    """A target that overflows on one token (its embedding is NaN) fails the request that feeds it, in
    the round after it was committed; the requests beside it give the same tokens as alone."""
    poisoned = tiny_target(init_std=0.1)
    poisoned.model.double()
    prompts = list(random_prompts(8, seed=21))
    broken_prompt = next(p for p in prompts if hf_greedy(poisoned, p, 1)[0] not in p)
    bad_token = hf_greedy(poisoned, broken_prompt, 1)[0]
    healthy = [p for p in prompts if bad_token not in p + hf_greedy(poisoned, p, 20)][:3]
    alone = {f"h{i}": hf_greedy(poisoned, p, 20) for i, p in enumerate(healthy)}
    with torch.no_grad():
        poisoned.embed_tokens.weight[bad_token] = float("nan")
    engine = DecodingEngine(poisoned, tiny_drafter(poisoned, head="domino", block_size=4).double())
    requests = {f"h{i}": (p, GenerationConfig(max_new_tokens=20, stop_token_ids=[])) for i, p in enumerate(healthy)}
    requests["broken"] = (broken_prompt, GenerationConfig(max_new_tokens=20, stop_token_ids=[]))
    broken = None
    for rid, (prompt, config) in requests.items():
        state = engine.add(rid, prompt, config)
        broken = state if rid == "broken" else broken
    got = {rid: [] for rid in requests}
    while engine.has_work:
        for event in engine.step():
            got[event.request_id] += event.tokens
    assert len(healthy) == 3 and {rid: got[rid] for rid in alone} == alone
    assert broken.result.finish_reason == "error" and "not finite" in broken.result.error
    assert got["broken"] == [bad_token]


def test_a_prefill_that_raises_fails_its_request_alone(target, monkeypatch):
    """Two requests join in one step and the second one's prefill raises (as running out of memory on a
    long prompt would; injected here): that request alone ends with an error, the first gives the
    target's greedy tokens, and the failed one leaves nothing behind in the engine."""
    healthy, doomed = random_prompts(2, seed=31)
    forward = target.forward

    def failing_forward(input_ids, *args, **kwargs):
        if input_ids[0].tolist() == doomed:
            raise RuntimeError("out of memory (injected)")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", failing_forward)
    engine = DecodingEngine(target, tiny_drafter(target, head="domino", block_size=4).double())
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=[])
    engine.add("healthy", healthy, config)
    failed = engine.add("doomed", doomed, config)
    got = {"healthy": [], "doomed": []}
    while engine.has_work:
        for event in engine.step():
            got[event.request_id] += event.tokens
        assert "doomed" not in engine.states and not engine.pending
    assert got == {"healthy": hf_greedy(target, healthy, 12), "doomed": []}
    assert failed.result.finish_reason == "error" and "prefill failed (RuntimeError)" in failed.result.error


def test_logprobs_are_the_targets_own_at_each_committed_token(target):
    engine = DecodingEngine(target, tiny_drafter(target, head="domino", block_size=4).double())
    prompt = next(random_prompts(1, seed=4))
    config = GenerationConfig(max_new_tokens=9, stop_token_ids=[], logprobs=3,
                              sampling=SamplingParams(temperature=1.0), seed=5)
    result = run_batch_result(engine, prompt, config)
    ids = torch.tensor([prompt + result.tokens])
    logp = torch.log_softmax(target.model(ids).logits[0, len(prompt) - 1: -1], dim=-1)
    assert [entry.token for entry in result.logprobs] == result.tokens
    for j, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(float(logp[j, entry.token]), abs=1e-5)
        best = logp[j].topk(3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)


def run_batch_result(engine, prompt, config):
    state = engine.add("only", prompt, config)
    while engine.has_work:
        engine.step()
    return state.result


def test_unsupported_attention_kinds_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    from domino.target import Target

    config = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    with pytest.raises(DominoError, match="layer 0 is 'sliding_attention'"):
        DecodingEngine(Target(MistralForCausalLM(config), tokenizer=None, name="mistral"), None)


def test_sps_profile_never_prices_more_tokens_below_fewer(target):
    """Timing noise must not make a larger forward look cheaper than a smaller one: the scheduler would
    then price a 2-token verify above a 4-token one."""
    from domino.scheduler import profile_sps

    profile = profile_sps(target, max_tokens=64, context=8, repeats=1)
    assert profile.tokens == [1, 2, 4, 8, 16, 32, 64]
    assert profile.seconds == sorted(profile.seconds)
