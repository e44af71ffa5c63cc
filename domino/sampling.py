"""Turning logits into the distribution a token is drawn from, and drawing it. Target and drafter go
through the same functions, so temperature, top-k and top-p shape both alike.

Random numbers are counter-based: the draw for the token at position t of a request with seed s uses
noise that depends on (s, t) alone (`noise`). A request's tokens therefore do not depend on which
requests share its batch, on how many drafts a round verifies, or on whether it is drafted at all,
and no process-wide generator is touched. The drafter proposes with the very noise the target then
chooses with (Gumbel-max: token = argmax log p + g): when q is close to p the proposal is usually
the target's own choice, and the committed token never depends on the proposal.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from domino.errors import DominoError

UINT64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise DominoError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DominoError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DominoError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def log_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log of the sampling distribution over the last dimension after temperature, top-k and top-p
    (-inf outside its support). Every valid parameter leaves mass: the maximum is subtracted before
    dividing and the temperature is kept above float32's smallest normal number, so the most likely
    token survives any temperature; top-k keeps k >= 1 tokens and top-p the first one."""
    logits = logits.float()
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(logp.exp(), dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        cut = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        logp = torch.log_softmax(logp.masked_fill(cut, float("-inf")), dim=-1)
    return logp


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the last dimension after temperature, top-k and top-p."""
    return log_probabilities(logits, params).exp()


def _splitmix(x: int) -> int:
    x = (x + GOLDEN) & UINT64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & UINT64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & UINT64
    return x ^ (x >> 31)


def fresh_seed() -> int:
    """A seed for a request that gave none (from the OS, so no generator anyone seeds is touched)."""
    return secrets.randbits(63)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request asking for several (choice 0 keeps the request's)."""
    return seed if index == 0 else _splitmix(_splitmix(seed & UINT64) ^ index) >> 1


def noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel noise (vocab,) for the token at `position` of the request with `seed`: a pure function of
    the two. argmax(log p + noise) is then an exact draw from p (the exponential race argmax p / E with
    E = exp(-noise)). Float32 uniforms sit at the centre of their 2^-24 cells, so none is 0 or 1."""
    generator = torch.Generator(device=device).manual_seed(_splitmix(_splitmix(seed & UINT64) + position))
    uniform = torch.rand(vocab, generator=generator, device=device) + 2.0 ** -25
    return uniform.log_().neg_().log_().neg_()


class RowSampling:
    """Sampling for a batch of rows: row r has its own parameters and seed (None: a fresh one). The
    k-th call of `choose` draws each row's token at position start[r] + k (the drafter's block), and
    `choices` the target's tokens at given positions; both draw from the same per-position noise,
    kept for the round, so the target reuses what the drafter drew."""

    def __init__(self, params: list[SamplingParams], seeds: list[int | None], start: torch.Tensor | None = None):
        self.params = params
        self.seeds = [fresh_seed() if seed is None and not p.greedy else seed for p, seed in zip(params, seeds)]
        self.greedy = torch.tensor([p.greedy for p in params])
        self.start = start if start is not None else torch.zeros(len(params), dtype=torch.long)
        self.calls = 0
        self._noise: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    def log_probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row log sampling distributions of logits (n, ..., V); rows that decode greedily get -inf."""
        groups = set(self.params)
        if len(groups) == 1 and not self.params[0].greedy:
            return log_probabilities(logits, self.params[0])
        logp = torch.full_like(logits, float("-inf"), dtype=torch.float32)
        for params in groups:
            if not params.greedy:
                rows = torch.tensor([p == params for p in self.params])
                logp[rows] = log_probabilities(logits[rows], params)
        return logp

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row sampling distributions of logits (n, ..., V); rows that decode greedily get zeros."""
        return self.log_probabilities(logits).exp()

    def noise(self, row: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
        key = (row, position)
        if key not in self._noise:
            self._noise[key] = noise(self.seeds[row], position, vocab, device)
        return self._noise[key]

    def _draw(self, logits: torch.Tensor, positions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (n, m) for logits (n, m, V) at positions[r][j]: the argmax for greedy rows, else
        argmax(log p + the row's noise there); and the log-distributions (None if all greedy)."""
        tokens = logits.argmax(dim=-1)
        if self.all_greedy:
            return tokens, None
        logp = self.log_probabilities(logits)
        vocab = logits.shape[-1]
        for r in torch.nonzero(~self.greedy).flatten().tolist():
            gumbel = torch.stack([self.noise(r, t, vocab, logits.device) for t in positions[r]])
            tokens[r] = (logp[r] + gumbel).argmax(dim=-1)
        return tokens, logp

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of logits (n, V), at the next position of the block. Returns the tokens
        and the distributions they were drawn from (None if all greedy)."""
        positions = (self.start + self.calls).tolist()
        self.calls += 1
        tokens, logp = self._draw(logits[:, None], [[t] for t in positions])
        return tokens[:, 0], None if logp is None else logp[:, 0].exp()

    def choices(self, logits: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The token each row commits at positions first[r], first[r] + 1, ... for logits (n, m, V)."""
        m = logits.shape[1]
        return self._draw(logits, [list(range(t, t + m)) for t in first.tolist()])[0]

