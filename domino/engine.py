"""The decoding engine: lossless speculative decoding for a batch of requests (continuous batching).

Each `step` prefills waiting requests (target forwards over the prompt, capturing the drafter's
features, then the first token; a long prompt takes PREFILL_CHUNK tokens per step, so the rows in
flight go on between its chunks and a short request can join before it), then runs one round for
every request in flight:

  draft a block for all rows at once -> choose how many drafts each row verifies -> verify all rows in
  one target forward -> accept per row (greedy match or speculative sampling, verify.py) -> keep the
  accepted slots in both caches -> commit, and retire the rows that finished.

A row whose logits are broken (NaN or inf) ends alone with an error; the others go on.

Rows advance by different numbers of tokens (ragged); the caches handle that with holes (batch_caches.py).
Plain autoregressive decoding is the same loop with no drafter (each round verifies just the anchor),
and the oracle drafter proposes the target's own greedy continuation: the loop's ceiling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from domino.config import DEFAULT_BLOCK_SIZE, check_block_size
from domino.drafter import ContextCache, Draft, Drafter
from domino.errors import DominoError
from domino.batch_caches import BatchCaches
from domino.requests import GenerationConfig, GenerationResult, RequestState, TokenLogprob
from domino.sampling import ACCEPT, TARGET, RowSampling, point_masses
from domino.scheduler import FullVerify, VerifyPolicy, check_fits
from domino.target import Target
from domino.verify import greedy_accept, speculative_accept

if TYPE_CHECKING:
    from transformers import DynamicCache

PAD = 0  # token id fed in padding slots; they are masked out everywhere
# prompt tokens a waiting request prefills per step: on 2 CPU cores a 7 800-token prompt prefilled at once
# held every other request for about 30 s
PREFILL_CHUNK = 512
NOT_FINITE = "the target's logits for this request are not finite (NaN or inf): the model overflowed on its input"


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the target's raw logits (len(tokens), V) at the positions
    that chose it, with the `top` most likely tokens there."""
    logp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, device=logp.device)].tolist()
    best = logp.topk(top, dim=-1) if top else None
    return [TokenLogprob(token, value, list(zip(best.indices[j].tolist(), best.values[j].tolist())) if top else [])
            for j, (token, value) in enumerate(zip(tokens, chosen))]


@dataclass
class Prefill:
    """A waiting request's prefill so far: the target's cache, the drafter's staged context, tokens done."""
    cache: DynamicCache
    context: ContextCache | None
    done: int = 0


@dataclass
class StepTimes:
    """Seconds one `step` spent, each counted once. A round's drafting and verifying serve every row in it,
    and each request's own stats count them in full: summed over requests they would count a second once
    per row (the replica's metrics add these instead)."""
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafting, and settling both caches after the verify
    verify_s: float = 0.0


@dataclass
class Event:
    request_id: str
    tokens: list[int]  # committed this step
    text: str  # text released this step
    result: GenerationResult | None  # set on the request's last event
    logprobs: list[TokenLogprob] | None = None  # of `tokens`, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.result is not None


def make_event(request_id: str, state: RequestState, tokens: list[int], text: str) -> Event:
    """What a step reports about one request: the tokens it just committed (with their
    log-probabilities, the last ones the request holds), and its result once it finished."""
    logprobs = state.logprobs[len(state.logprobs) - len(tokens):] if state.logprobs is not None else None
    return Event(request_id, tokens, text, state.result if state.finished else None, logprobs)


class DecodingEngine:
    """`drafter`: a Drafter, "oracle", or None (plain decoding). `block_size`: the oracle's drafts per
    round (default DEFAULT_BLOCK_SIZE); a Drafter has its own block (None, or its config's value). `policy` decides per
    round how many drafts each request verifies (scheduler.py; default: all of them). `max_rows`: the
    most requests decoded or prefilling together (their caches grow with every row); later ones wait in
    the queue, first come first served (None: no limit). `prefill_chunk`: prompt tokens a waiting request prefills
    per step."""

    def __init__(self, target: Target, drafter: Drafter | str | None = None, block_size: int | None = None,
                 policy: VerifyPolicy | None = None, max_rows: int | None = None, prefill_chunk: int = PREFILL_CHUNK):
        self.policy = policy or FullVerify()
        # drafted tokens per round at most (a DFlash drafter's block less its anchor)
        self.max_drafts = self.check(target, drafter, block_size, self.policy, max_rows, prefill_chunk)
        self.max_rows, self.prefill_chunk = max_rows, prefill_chunk
        self.target, self.drafter = target, drafter
        self.layer_ids = drafter.config.target_layer_ids if isinstance(drafter, Drafter) else []
        self.pending: dict[str, RequestState] = {}
        self.prefills: dict[str, Prefill] = {}  # of the pending requests whose prefill has begun
        self.ids: list[str] = []  # request id of each batch row
        self.states: dict[str, RequestState] = {}
        self.anchors: list[int] = []  # each row's last committed token, not yet fed to the target
        self.caches: BatchCaches | None = None
        self.last_step = StepTimes()

    @staticmethod
    def check(target: Target, drafter: Drafter | str | None, block_size: int | None,
              policy: VerifyPolicy | type[VerifyPolicy], max_rows: int | None = None,
              prefill_chunk: int = PREFILL_CHUNK) -> int:
        """Refuse arguments an engine cannot run with, reading only configs (so Serve's application builder
        asks before any replica loads weights); the most tokens a round drafts."""
        target.check_batchable()
        if max_rows is not None and max_rows < 1:
            raise DominoError(f"max_rows must be at least 1, got {max_rows}")
        if prefill_chunk < 1:
            raise DominoError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        if isinstance(drafter, Drafter):
            drafter.config.check_target(target)
            if block_size not in (None, drafter.config.block_size):
                raise DominoError(f"the drafter drafts blocks of {drafter.config.block_size} tokens, not {block_size}: "
                                  f"leave the block size unset")
            max_drafts = drafter.config.num_drafts
        elif drafter not in (None, "oracle"):
            raise DominoError(f"drafter must be a Drafter, 'oracle' or None, got {drafter!r}")
        else:
            max_drafts = DEFAULT_BLOCK_SIZE if block_size is None else block_size
            check_block_size(max_drafts)
        check_fits(policy, drafter)
        return max_drafts

    # -- requests --------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], config: GenerationConfig) -> RequestState:
        """Queue a request; it starts at the next step. Bad input raises DominoError here."""
        if request_id in self.pending or request_id in self.states:
            raise DominoError(f"request id {request_id!r} is already in flight")
        state = RequestState(self.target, prompt_ids, config)
        self.pending[request_id] = state
        return state

    def cancel(self, request_id: str) -> RequestState | None:
        """Drop a request (e.g. its client went away); it does no further work. Its state (with the stats of
        the rounds it took part in), or None for an id the engine does not hold."""
        state = self.pending.pop(request_id, None) or self.states.get(request_id)
        self.prefills.pop(request_id, None)
        if request_id in self.states:
            self._retire([request_id])
        return state

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.ids)

    def step(self) -> list[Event]:
        events, joining = [], []
        self.last_step = StepTimes()
        for request_id in list(self.pending):  # first come, first prefilled
            # a prefill holds a cache too: one is begun only while rows and prefills are fewer than max_rows
            if (self.max_rows is not None and request_id not in self.prefills
                    and len(self.ids) + len(self.prefills) >= self.max_rows):
                break
            admitted = self._admit(request_id, self.pending[request_id])
            if admitted is not None:  # its prefill is over: it leaves the queue, whatever became of it
                state = self.pending.pop(request_id)
                event, caches = admitted
                events.append(event)
                if caches is not None:  # it decodes on, in a new last row of the batch
                    self.ids.append(request_id)
                    self.states[request_id] = state
                    self.anchors.append(state.tokens[-1])
                    joining.append(caches)
        if joining:  # the batch's caches are copied once for all the rows that join
            if self.caches is None:
                self.caches = joining.pop(0)
            if joining:
                self.caches.append_rows(joining)
        if self.ids:
            events += self._round()
        return events

    # -- prefill ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _admit(self, request_id: str, state: RequestState) -> tuple[Event, BatchCaches | None] | None:
        """Prefill the next chunk of one request's prompt; after the last, return its event (its first token)
        and its caches, for the caller to make it a batch row (None when it finished at once). None while
        chunks remain. A prefill that raises (out of memory on a long prompt, say) fails this request alone:
        nothing of it has joined."""
        first = logprobs = None
        try:
            if request_id not in self.prefills:
                state.started = time.perf_counter()
                if self.drafter == "oracle":  # outside the request's clock: it stands for a perfect drafter
                    state.reference = self._greedy_continuation(state)
                    state.started = time.perf_counter()
                self.prefills[request_id] = self._new_prefill(state)
            logits = self._prefill_chunk(state, self.prefills[request_id])
            if logits is None:
                return None
            first, logprobs = self._first_token(state, logits)
        except Exception as error:
            state.fail(f"the prefill failed ({type(error).__name__})")
        prefill = self.prefills.pop(request_id, None)
        tokens, text = state.commit([first], logprobs) if first is not None else ([], "")
        joining = None
        if not state.finished:
            joining = BatchCaches(prefill.cache, prefill.context, torch.ones(1, len(state.prompt), dtype=torch.bool,
                                                                             device=self.target.device))
        state.stats.total_s = time.perf_counter() - state.started
        return make_event(request_id, state, tokens, text), joining

    def _new_prefill(self, state: RequestState) -> Prefill:
        context = None
        if isinstance(self.drafter, Drafter):  # projected when first drafted: a large batch may never draft
            context = ContextCache(project=self.drafter.context_kv)
            state.history = self.drafter.new_history(state.prompt)
        return Prefill(self.target.new_cache(), context)

    def _prefill_chunk(self, state: RequestState, prefill: Prefill) -> torch.Tensor | None:
        """The next `prefill_chunk` prompt tokens through the target, appended to the prefill's caches (their
        features staged for the drafter's context); the logits after the prompt once it is all in."""
        start = time.perf_counter()
        end = min(prefill.done + self.prefill_chunk, len(state.prompt))
        chunk = torch.tensor([state.prompt[prefill.done:end]], device=self.target.device)
        out = self.target.forward(chunk, prefill.cache, layer_ids=self.layer_ids, last_logits_only=True)
        if prefill.context is not None:
            prefill.context.stage(out.features, torch.arange(prefill.done, end, device=chunk.device)[None])
        prefill.done = end
        elapsed = time.perf_counter() - start
        state.stats.prefill_s += elapsed
        self.last_step.prefill_s += elapsed
        return out.logits[:, -1] if end == len(state.prompt) else None

    def _first_token(self, state: RequestState, logits: torch.Tensor) -> tuple[int | None, list[TokenLogprob] | None]:
        """The token after the prompt and its log-probabilities; None when the logits are broken (the
        request fails, alone)."""
        if not bool(torch.isfinite(logits).all()):
            state.fail(NOT_FINITE)
            return None, None
        sampling = RowSampling([state.config.sampling], [state.seed], torch.tensor([len(state.prompt)]))
        first = int(sampling.target_tokens(logits)[0])
        top = state.config.logprobs
        return first, token_logprobs(logits, [first], top) if top is not None else None

    def _greedy_continuation(self, state: RequestState) -> list[int]:
        plain = DecodingEngine(self.target)
        plain.add("reference", state.prompt, GenerationConfig(state.config.max_new_tokens, stop_token_ids=[]))
        tokens = []
        while plain.has_work:
            tokens += [t for event in plain.step() for t in event.tokens]
        return tokens

    # -- one round for every row -----------------------------------------------------------------
    def _propose(self, states: list[RequestState], anchors: torch.Tensor, positions: torch.Tensor,
                 sampling: RowSampling, caps: torch.Tensor) -> Draft | None:
        """This round's drafts, or None when the policy would verify none of them."""
        if isinstance(self.drafter, Drafter):
            screen = (lambda first: self.policy.admits_any(caps, first)) if self.policy.needs_confidence else None
            return self.drafter.draft(self.caches.context, anchors, sampling, positions, screen,
                                      needed=caps + 1, valid=self.caches.valid,
                                      histories=[s.history for s in states])
        upcoming = [s.reference[len(s.tokens): len(s.tokens) + self.max_drafts] for s in states]
        tokens = torch.tensor([u + [PAD] * (self.max_drafts - len(u)) for u in upcoming], device=anchors.device)
        probs = None
        if not sampling.all_greedy:  # the oracle's proposals are certain: q is a point mass
            probs = point_masses(tokens, self.target.vocab_size)
        return Draft(tokens=tokens, probs=probs, confidence=None)

    def _accept(self, drafts: torch.Tensor, draft: Draft | None, logits: torch.Tensor, lengths: torch.Tensor,
                sampling: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, how many drafts pass and the token committed after them: greedy rows by exact
        match, the others by speculative sampling on their own random numbers."""
        accepted, following = greedy_accept(drafts, logits, lengths)
        if sampling.all_greedy:
            return accepted, following
        sampled = ~sampling.greedy.to(logits.device)
        m = drafts.shape[1]
        q = draft.probs[sampled, :m] if m else logits.new_zeros(int(sampled.sum()), 0, logits.shape[-1])
        accepted[sampled], following[sampled] = speculative_accept(
            drafts[sampled], q, sampling.probabilities(logits)[sampled],
            sampling.uniforms(ACCEPT, range(m), logits.device)[sampled],
            sampling.uniforms(TARGET, range(m + 1), logits.device)[sampled],
            lengths[sampled])
        return accepted, following

    @torch.no_grad()
    def _round(self) -> list[Event]:
        states = [self.states[i] for i in self.ids]
        device = self.target.device
        positions = self.caches.positions
        sampling = RowSampling([s.config.sampling for s in states], [s.seed for s in states], positions + 1)
        anchors = torch.tensor(self.anchors, device=device)
        proposes = self.drafter is not None
        caps = torch.tensor([min(self.max_drafts, s.remaining - 1) if proposes else 0 for s in states], device=device)

        start = time.perf_counter()
        draft = None
        lengths = torch.zeros_like(caps)
        could_draft = int(caps.max()) > 0 and self.policy.could_pay(caps)
        copies_only = (could_draft and isinstance(self.drafter, Drafter)
                       and self.drafter.copy_from_the_start(self.drafter.copy_runs([s.history for s in states])))
        tried = copies_only or (could_draft and self.policy.wants_draft(len(states)))
        if tried:
            draft = self._propose(states, anchors, positions, sampling, caps)
            if draft is not None:
                lengths = self.policy.lengths(caps, draft.confidence, draft.copied)
        # each clock read waits for the device's work: nearly free, since a read of its results follows
        self.target.synchronize()
        drafted = time.perf_counter()

        width = int(lengths.max())
        offsets = torch.arange(1 + width, device=device)
        new_valid = offsets < 1 + lengths[:, None]
        block = anchors[:, None]
        if width:
            block = torch.cat([block, draft.tokens[:, :width]], dim=1).masked_fill(~new_valid, PAD)
        # padding slots sit at the row's anchor position: never past its budget (a learned position
        # table's end) nor past the batch's real positions (which dynamic RoPE scaling reads)
        slot_positions = torch.where(new_valid, positions[:, None] + offsets, positions[:, None])
        out = self.target.forward(block, self.caches.target, layer_ids=self.layer_ids,
                                  attention_mask=self.caches.attention_mask(new_valid).long(),
                                  position_ids=slot_positions)
        drafts = block[:, 1:]
        copied = draft.copied.tolist() if draft is not None and draft.copied is not None else None
        accepted, following = self._accept(drafts, draft, out.logits, lengths, sampling)
        used = offsets <= accepted[:, None]  # the logits each row's committed tokens came from
        broken = (~torch.isfinite(out.logits).all(dim=-1) & used).any(dim=1).tolist()
        verified = time.perf_counter()

        if isinstance(self.drafter, Drafter):
            self.caches.context.stage(out.features, slot_positions)  # projected when next drafted
        self.caches.settle(offsets < 1 + accepted[:, None])
        self.target.synchronize()
        settled = time.perf_counter()
        if not copies_only:  # a round of copies alone says nothing of whether the drafter pays
            self.policy.observe(tried, len(states), int(accepted.sum()) + len(states), settled - start,
                                block.numel(), verified - drafted)

        # drafting's share of the round includes keeping both caches after the verify
        draft_s, verify_s = (drafted - start) + (settled - verified), verified - drafted
        self.last_step.draft_s += draft_s
        self.last_step.verify_s += verify_s
        events, done = [], []
        # one copy to the host for the whole batch, not one per row (each is a device sync on a GPU)
        draft_rows, accepted_rows, following_rows, length_rows = (
            t.tolist() for t in (drafts, accepted, following, lengths))
        for r, (request_id, state) in enumerate(zip(self.ids, states)):
            n = accepted_rows[r]
            committed = draft_rows[r][:n] + [following_rows[r]]
            state.stats.draft_s += draft_s
            state.stats.verify_s += verify_s
            if broken[r]:
                state.fail(NOT_FINITE)
                tokens, text = [], ""
            else:
                state.stats.record_round(length_rows[r], n, copied[r] if copied is not None else None)
                top = state.config.logprobs
                tokens, text = state.commit(committed, token_logprobs(out.logits[r], committed, top)
                                            if top is not None else None)
                self.anchors[r] = committed[-1]
            state.stats.total_s = time.perf_counter() - state.started
            events.append(make_event(request_id, state, tokens, text))
            if state.finished:
                done.append(request_id)
        self._retire(done)
        if self.caches is not None:
            self.caches.compact()
        return events

    def _retire(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        keep = [r for r, i in enumerate(self.ids) if i not in request_ids]
        for request_id in request_ids:
            del self.states[request_id]
        self.ids = [self.ids[r] for r in keep]
        self.anchors = [self.anchors[r] for r in keep]
        if keep:
            self.caches.keep_rows(torch.tensor(keep, device=self.caches.valid.device))
        else:
            self.caches = None
