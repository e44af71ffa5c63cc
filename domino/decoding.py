"""The speculative decoding loop for one request.

prefill the target (capturing the drafter's features) -> draft a block -> verify it in one target
forward -> accept -> crop the target's KV cache to the accepted tokens and append their features to
the drafter's context -> repeat until max_new_tokens, a stop token or a stop string.

A proposer supplies the drafts. The autoregressive baseline is the same loop with no proposer (each
round verifies just the anchor: a plain decode step), and the oracle proposes the target's own
greedy continuation, which measures the loop's ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from domino.drafter import ContextCache, Draft, Drafter
from domino.errors import DominoError
from domino.sampling import SamplingParams, probabilities, sample
from domino.target import Target
from domino.text import TextStream
from domino.verify import greedy_accept, speculative_accept


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: list[int] | None = None  # None: the target's end-of-sequence tokens
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise DominoError(f"max_new_tokens must be positive, got {self.max_new_tokens}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify forward
    proposed: list[int] = field(default_factory=list)  # per block position: drafts verified there
    accepted: list[int] = field(default_factory=list)  # per block position: drafts accepted there
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify forward of the target (1.0 for plain decoding)."""
        return sum(self.accept_lengths) / max(1, self.rounds)

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def record_round(self, verified: int, accepted: int) -> None:
        for k in range(verified):
            if k == len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[k] += 1
            self.accepted[k] += k < accepted
        self.accept_lengths.append(accepted + 1)

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens, rounds=self.rounds,
                    tau=self.tau, acceptance_by_position=self.acceptance_by_position,
                    prefill_s=self.prefill_s, draft_s=self.draft_s, verify_s=self.verify_s, other_s=self.other_s,
                    total_s=self.total_s, tokens_per_second=self.tokens_per_second)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str | None
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats


# -- proposers -----------------------------------------------------------------------------------


class DrafterProposer:
    """Drafts with a trained Drafter, keeping a context cache (per request) in step with the target."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.layer_ids = drafter.config.target_layer_ids
        self.cache = ContextCache()

    def propose(self, anchor: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        anchors = torch.tensor([anchor], device=self.drafter.fc.weight.device)
        return self.drafter.draft(self.cache, anchors, params, generator)

    @torch.no_grad()
    def commit(self, features: torch.Tensor, tokens: list[int]) -> None:
        """Append the features of newly committed tokens (the prompt, after prefill)."""
        positions = self.cache.length + torch.arange(features.shape[1], device=features.device)
        self.drafter.extend_context(self.cache, features, positions[None])


class OracleProposer:
    """Proposes a known continuation: the target's own greedy output, computed before the timed run.
    Every greedy draft is then accepted, so it measures how fast the loop itself can go."""

    layer_ids: list[int] = []

    def __init__(self, reference: list[int], block_size: int, vocab_size: int):
        self.reference, self.block_size, self.vocab_size = reference, block_size, vocab_size
        self.done = 1  # the prefill commits the first token

    def propose(self, anchor: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        upcoming = self.reference[self.done: self.done + self.block_size]
        tokens = torch.tensor([upcoming + [0] * (self.block_size - len(upcoming))])
        probs = None if params.greedy else torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        return Draft(tokens=tokens, probs=probs, confidence=None)

    def commit(self, features, tokens: list[int]) -> None:
        self.done += len(tokens)


# -- the loop ------------------------------------------------------------------------------------


class SpeculativeDecoder:
    """Lossless speculative decoding of one request at a time on `target`.

    `drafter` is a Drafter, "oracle" (the target's own greedy continuation), or None for plain
    autoregressive decoding through the same loop."""

    def __init__(self, target: Target, drafter: Drafter | str | None = None, block_size: int = 16):
        if isinstance(drafter, Drafter):
            drafter.config.check_target(target)
        elif drafter not in (None, "oracle"):
            raise DominoError(f"drafter must be a Drafter, 'oracle' or None, got {drafter!r}")
        self.target, self.drafter, self.block_size = target, drafter, block_size

    def new_proposer(self, prompt_ids: list[int], max_new_tokens: int) -> DrafterProposer | OracleProposer | None:
        """Proposer state is per request, so requests can be interleaved on one decoder."""
        if self.drafter is None:
            return None
        if self.drafter == "oracle":
            plain = SpeculativeDecoder(self.target, None)
            reference = plain.generate(prompt_ids, GenerationConfig(max_new_tokens, stop_token_ids=[])).tokens
            return OracleProposer(reference, self.block_size, self.target.vocab_size)
        return DrafterProposer(self.drafter)

    def generate(self, prompt_ids: list[int], config: GenerationConfig,
                 on_tokens: Callable[[list[int], str], None] | None = None) -> GenerationResult:
        generation = self.start(prompt_ids, config)
        for tokens, text in generation:
            if on_tokens is not None:
                on_tokens(tokens, text)
        return generation.result

    def start(self, prompt_ids: list[int], config: GenerationConfig) -> "Generation":
        return Generation(self, prompt_ids, config)


class Generation:
    """One request being decoded. Iterating runs it a round at a time, yielding (new token ids, new
    text) as they are committed; `result` holds the outcome once iteration ends. Stop iterating early
    (e.g. when a client disconnects) and no further target forwards run."""

    def __init__(self, decoder: SpeculativeDecoder, prompt_ids: list[int], config: GenerationConfig):
        target = decoder.target
        if not prompt_ids:
            raise DominoError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= target.max_length:
            raise DominoError(f"the prompt has {len(prompt_ids)} tokens but the target's context holds {target.max_length}")
        if len(prompt_ids) + config.max_new_tokens > target.max_length:
            raise DominoError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({config.max_new_tokens}) exceeds the "
                f"target's context of {target.max_length}: lower max_new_tokens to {target.max_length - len(prompt_ids)}")
        self.decoder, self.prompt, self.config = decoder, list(prompt_ids), config
        self.stop_ids = set(target.stop_token_ids if config.stop_token_ids is None else config.stop_token_ids)
        self.text = TextStream(target.tokenizer, config.stop_strings) if target.tokenizer is not None else None
        if config.stop_strings and self.text is None:
            raise DominoError("stop strings need a tokenizer, and this target has none")
        self.generator = torch.Generator(device=target.device)
        self.generator.manual_seed(config.seed if config.seed is not None else torch.seed())
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.text.text if self.text else None, self.finish_reason or "length",
                                self.stats)

    def _pick(self, logits: torch.Tensor) -> int:
        """The target's own choice from one row of logits."""
        params = self.config.sampling
        if params.greedy:
            return int(logits.argmax())
        return int(sample(probabilities(logits, params), self.generator))

    def _commit(self, tokens: list[int]) -> tuple[list[int], str]:
        """Append tokens until a stop token, a stop string or the token budget ends the request."""
        new = []
        for token in tokens:
            new.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.tokens) + len(new) == self.config.max_new_tokens:
                self.finish_reason = "length"
                break
        self.tokens.extend(new)
        text = ""
        if self.text is not None:
            text = self.text.push(new, final=self.finish_reason is not None)
            if self.text.stopped:
                self.finish_reason = "stop"
        self.stats.new_tokens = len(self.tokens)
        return new, text

    @torch.no_grad()
    def __iter__(self) -> Iterator[tuple[list[int], str]]:
        target, params, stats = self.decoder.target, self.config.sampling, self.stats
        proposer = self.decoder.new_proposer(self.prompt, self.config.max_new_tokens)
        layer_ids = proposer.layer_ids if proposer is not None else []
        start = time.perf_counter()
        cache = target.new_cache()
        out = target.forward(torch.tensor([self.prompt], device=target.device), cache, layer_ids=layer_ids)
        anchor = self._pick(out.logits[0, -1])
        stats.prefill_s = time.perf_counter() - start
        if out.features is not None:
            begin = time.perf_counter()
            proposer.commit(out.features, self.prompt)
            stats.draft_s += time.perf_counter() - begin
        chunk = self._commit([anchor])
        stats.total_s = time.perf_counter() - start
        yield chunk

        while self.finish_reason is None:
            remaining = self.config.max_new_tokens - len(self.tokens)
            verify = 0 if proposer is None else min(proposer.block_size, remaining - 1)
            begin = time.perf_counter()
            draft = proposer.propose(anchor, params, self.generator) if verify else None
            stats.draft_s += time.perf_counter() - begin

            begin = time.perf_counter()
            block = torch.tensor([[anchor] + (draft.tokens[0, :verify].tolist() if verify else [])], device=target.device)
            out = target.forward(block, cache, layer_ids=layer_ids)
            drafts = block[:, 1:]
            if params.greedy:
                accepted, following = greedy_accept(drafts, out.logits)
            else:
                draft_probs = draft.probs[:, :verify] if verify else out.logits.new_zeros(1, 0, out.logits.shape[-1])
                accepted, following = speculative_accept(
                    drafts, draft_probs, probabilities(out.logits, params), generator=self.generator)
            accepted = int(accepted[0])
            cache.crop(-(verify - accepted))
            stats.verify_s += time.perf_counter() - begin

            committed = drafts[0, :accepted].tolist() + [int(following[0])]
            stats.record_round(verify, accepted)
            if proposer is not None:
                begin = time.perf_counter()
                proposer.commit(out.features[:, : accepted + 1] if out.features is not None else None, committed)
                stats.draft_s += time.perf_counter() - begin
            anchor = committed[-1]
            chunk = self._commit(committed)
            stats.total_s = time.perf_counter() - start
            yield chunk
