"""One generation request: its parameters, what it has produced so far, when it ends, its statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from domino.errors import DominoError
from domino.lookup import TokenHistory
from domino.sampling import SamplingParams, fresh_seed
from domino.target import Target
from domino.text import TextStream


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: list[int] | None = None  # None: the target's end-of-sequence tokens
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None  # None: a fresh seed from the OS
    logprobs: int | None = None  # return each token's log-probability and this many top alternatives

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise DominoError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise DominoError(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and self.logprobs < 0:
            raise DominoError(f"logprobs (the number of top alternatives) must be >= 0, got {self.logprobs}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify forward
    proposed: list[int] = field(default_factory=list)  # per block position: drafts verified there
    accepted: list[int] = field(default_factory=list)  # per block position: drafts accepted there
    accepted_copies: int = 0  # accepted drafts that were copied from the request's text (domino.lookup)
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

    def record_round(self, verified: int, accepted: int, copied: list[bool] | None = None) -> None:
        """One verify forward: `verified` drafts checked, the first `accepted` of them passed; `copied`
        marks, per block position, the drafts copied from the text rather than drafted."""
        if copied is not None:
            self.accepted_copies += sum(copied[:accepted])
        for k in range(verified):
            if k == len(self.proposed):
                self.proposed.append(0)
                self.accepted.append(0)
            self.proposed[k] += 1
            self.accepted[k] += k < accepted
        self.accept_lengths.append(accepted + 1)

    @property
    def speculative_decoding(self) -> dict:
        """vLLM's per-request names: a draft is a round that verified at least one drafted token."""
        drafts = self.proposed[0] if self.proposed else 0
        accepted = sum(self.accepted)
        return dict(num_drafts=drafts, num_draft_tokens=sum(self.proposed), num_accepted_draft_tokens=accepted,
                    num_accepted_draft_tokens_per_pos=list(self.accepted),
                    mean_acceptance_length=1 + accepted / drafts if drafts else 1.0)

    def as_dict(self) -> dict:
        return dict(speculative_decoding=self.speculative_decoding, prompt_tokens=self.prompt_tokens,
                    new_tokens=self.new_tokens, rounds=self.rounds, tau=self.tau,
                    acceptance_by_position=self.acceptance_by_position, accepted_copies=self.accepted_copies,
                    prefill_s=self.prefill_s, draft_s=self.draft_s, verify_s=self.verify_s, other_s=self.other_s,
                    total_s=self.total_s, tokens_per_second=self.tokens_per_second)

    @classmethod
    def combined(cls, parts: list["GenerationStats"]) -> "GenerationStats":
        """The statistics of one request's several choices (rows decoded side by side): counts and
        prefills (one per choice) add up; drafting and verifying are forwards the choices share, each
        timed in full by every row in it, so they and the wall time are the longest choice's."""
        width = max((len(p.proposed) for p in parts), default=0)
        return cls(prompt_tokens=parts[0].prompt_tokens, new_tokens=sum(p.new_tokens for p in parts),
                   accept_lengths=[n for p in parts for n in p.accept_lengths],
                   proposed=[sum(p.proposed[k] for p in parts if k < len(p.proposed)) for k in range(width)],
                   accepted=[sum(p.accepted[k] for p in parts if k < len(p.accepted)) for k in range(width)],
                   accepted_copies=sum(p.accepted_copies for p in parts),
                   prefill_s=sum(p.prefill_s for p in parts), draft_s=max(p.draft_s for p in parts),
                   verify_s=max(p.verify_s for p in parts), total_s=max(p.total_s for p in parts))


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target's own distribution (the raw logits, before
    temperature, top-k and top-p), and the `top` most likely tokens there with theirs."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int = 0  # where the token's text starts in the request's text (set when committed)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str | None
    finish_reason: str  # "stop", "length" or "error"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    error: str | None = None  # why the request failed (finish_reason "error")


class RequestState:
    """A request's progress. Checks its input up front, so a bad request fails before any work."""

    def __init__(self, target: Target, prompt_ids: list[int], config: GenerationConfig):
        if not prompt_ids:
            raise DominoError("the prompt is empty: give at least one token")
        if not all(0 <= token < target.vocab_size for token in prompt_ids):
            raise DominoError(f"prompt token ids must lie in 0..{target.vocab_size - 1}")
        if len(prompt_ids) >= target.max_length:
            raise DominoError(f"the prompt has {len(prompt_ids)} tokens but the target's context holds {target.max_length}")
        if len(prompt_ids) + config.max_new_tokens > target.max_length:
            raise DominoError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({config.max_new_tokens}) exceeds the "
                f"target's context of {target.max_length}: lower max_new_tokens to {target.max_length - len(prompt_ids)}")
        if config.stop_strings and target.tokenizer is None:
            raise DominoError("stop strings need a tokenizer, and this target has none")
        self.prompt, self.config = list(prompt_ids), config
        self.stop_ids = set(target.stop_token_ids if config.stop_token_ids is None else config.stop_token_ids)
        self.text = (TextStream(target.tokenizer, config.stop_strings, offsets=config.logprobs is not None)
                     if target.tokenizer is not None else None)
        self.seed = config.seed if config.seed is not None else fresh_seed()
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.started = 0.0  # perf_counter() when its prefill began
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.reference: list[int] | None = None  # the oracle's known continuation, when it drafts
        self.history: TokenHistory | None = None  # prompt + tokens, indexed for copy drafts (domino.lookup)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.tokens)

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.text.text if self.text else None, self.finish_reason or "length",
                                self.stats, self.logprobs, self.error)

    def fail(self, error: str) -> None:
        """End the request with an error; the others in its batch go on."""
        self.finish_reason, self.error = "error", error

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> tuple[list[int], str]:
        """Append tokens until a stop token, a stop string or the token budget ends the request;
        return the tokens and the text this released. `logprobs` go with the tokens, one each."""
        new = []
        for token in tokens:
            new.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.tokens) + len(new) == self.config.max_new_tokens:
                self.finish_reason = "length"
                break
        text = ""
        if self.text is not None:
            text = self.text.push(new, final=self.finished)
            if self.text.stopped:  # a stop string: the tokens after the one that completed it go
                self.finish_reason = "stop"
                del new[len(self.text.tokens) - len(self.tokens):]
        self.tokens.extend(new)
        if self.history is not None:
            self.history.extend(new)
        if self.logprobs is not None and logprobs is not None:
            kept = logprobs[:len(new)]
            if self.text is not None:
                for entry, offset in zip(kept, self.text.offsets[len(self.tokens) - len(new):]):
                    entry.text_offset = offset
            self.logprobs.extend(kept)
        self.stats.new_tokens = len(self.tokens)
        return new, text
