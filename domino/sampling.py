"""Turning logits into the distribution a token is drawn from, and drawing it. Target and drafter go
through the same functions, so temperature, top-k and top-p shape both alike.

Random numbers are counter-based: each uniform a request draws is a pure function of its seed, the
position where the round starts, the offset in the round and what it is for (`uniforms`), and a token
is drawn by inverting its distribution's CDF at one of them. So no process-wide generator is touched;
every round draws fresh numbers (no two rounds of a request start at one position), which
speculative sampling's exactness needs; and a request's tokens depend on its own seed and history
alone, not on which requests share its batch, wherever its verify lengths do not either (plain, full
and threshold verification; the gate of `gated` and the confidence scheduler weigh the whole batch). Speculative sampling
commits the drafter's accepted proposals, so plain and speculative decoding give one seed different
tokens, from the same distribution.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
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


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the last dimension after temperature, top-k and top-p. Every
    valid parameter leaves mass: the maximum is subtracted before dividing and the temperature is kept
    above float32's smallest normal number, so the most likely token survives any temperature; top-k
    keeps k >= 1 tokens and top-p the first one."""
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
        beyond = before >= params.top_p
        beyond[..., 0] = False  # also where top_p rounds to 0 in float32 (below about 1e-45)
        cut = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, beyond)
        logp = torch.log_softmax(logp.masked_fill(cut, float("-inf")), dim=-1)
    return logp.exp()


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 arrays (their arithmetic wraps, as it must)."""
    x = x + np.uint64(GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _words(values) -> np.ndarray:
    """Python ints (negative ones in two's complement) as a uint64 array of at least one dimension
    (numpy warns on overflow in scalars, not in arrays)."""
    return np.atleast_1d(np.array(values, dtype=object) & UINT64).astype(np.uint64)


def fresh_seed() -> int:
    """A seed for a request that gave none (from the OS, so no generator anyone seeds is touched)."""
    return secrets.randbits(63)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request asking for several (choice 0 keeps the request's)."""
    return seed if index == 0 else int(_splitmix(_splitmix(_words(seed)) ^ _words(index))[0]) >> 1


DRAFT, ACCEPT, TARGET = 0, 1, 2  # what a round's random number is for


def row_keys(seeds: list[int], starts: list[int]) -> np.ndarray:
    """Each row's seed and round start, hashed once a round: what all its uniforms of the round share."""
    return _splitmix(_splitmix(_words(seeds)) ^ _words(starts))


def uniforms(keys: np.ndarray, offsets: range, purpose: int) -> np.ndarray:
    """(len(keys), len(offsets)) uniforms in (0, 1): entry [r, k] is for `purpose` at offset k of row r's
    round, a pure function of seed, start, offset and purpose (splitmix64 over each in turn, 53 bits)."""
    x = _splitmix(keys[:, None] ^ np.array(offsets, dtype=np.uint64)[None, :])
    x = _splitmix(x ^ np.uint64(purpose))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens (n,) from distributions probs (n, V) (not necessarily normalised), inverting each CDF at
    u (n,) in (0, 1). A token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def point_masses(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distributions (..., V) certain of `tokens` (...): the proposal distribution of a token that is not
    sampled (a copy, an oracle's), written straight into `dtype` (F.one_hot would first make int64)."""
    out = torch.zeros(*tokens.shape, vocab_size, dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens[..., None], 1.0)


class RowSampling:
    """Sampling for a batch of rows in one round: row r has its own parameters and seed (None: a fresh
    one), and the round's first new token of row r sits at position start[r]. The k-th call of
    `choose` drafts offset k of the round; `uniforms` are the numbers verification draws with."""

    def __init__(self, params: list[SamplingParams], seeds: list[int | None], start: torch.Tensor | None = None):
        self.params = params
        self.seeds = [fresh_seed() if seed is None and not p.greedy else seed for p, seed in zip(params, seeds)]
        self.greedy = torch.tensor([p.greedy for p in params])
        starts = start.tolist() if start is not None else [0] * len(params)
        self.drawn = [r for r, seed in enumerate(self.seeds) if seed is not None]  # rows that draw numbers
        self.keys = row_keys([self.seeds[r] for r in self.drawn], [starts[r] for r in self.drawn])
        self.tables: dict[int, torch.Tensor] = {}  # purpose -> uniforms at the round's first offsets
        self.calls = 0

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row sampling distributions of logits (n, ..., V); rows that decode greedily get zeros."""
        groups = set(self.params)
        if len(groups) == 1 and not self.params[0].greedy:
            return probabilities(logits, self.params[0])
        probs = torch.zeros_like(logits, dtype=torch.float32)
        for params in groups:
            if not params.greedy:
                rows = torch.tensor([p == params for p in self.params])
                probs[rows] = probabilities(logits[rows], params)
        return probs

    def uniforms(self, purpose: int, offsets: range, device: torch.device | str = "cpu") -> torch.Tensor:
        """(n, len(offsets)): each row's uniforms for `purpose` at those offsets of its round (0.5 for
        greedy rows, which draw nothing)."""
        drawn = uniforms(self.keys, offsets, purpose)
        if len(self.drawn) == len(self.seeds):
            return torch.from_numpy(drawn).to(device)
        u = np.full((len(self.seeds), len(offsets)), 0.5)
        u[self.drawn] = drawn
        return torch.from_numpy(u).to(device)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's proposal per row of logits (n, V) at the round's next offset: the argmax for
        greedy rows, else a draw. Returns the tokens and the distributions they were drawn from (None
        if all greedy)."""
        offset = self.calls
        self.calls += 1
        return self._draw(logits, DRAFT, offset)

    def target_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's own token per row of logits (n, V) at the round's first offset (plain decoding)."""
        return self._draw(logits, TARGET, 0)[0]

    def _draw(self, logits: torch.Tensor, purpose: int, offset: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = logits.argmax(dim=-1)
        if self.all_greedy:
            return tokens, None
        probs = self.probabilities(logits)
        sampled = ~self.greedy.to(logits.device)
        u = self._uniforms_at(purpose, offset, logits.device)
        tokens[sampled] = draw(probs[sampled], u[sampled])
        return tokens, probs

    def _uniforms_at(self, purpose: int, offset: int, device: torch.device) -> torch.Tensor:
        """(n,) uniforms for `purpose` at one offset, read from a table of the round's first offsets made
        in one call: drafting asks for one offset per block position."""
        table = self.tables.get(purpose)
        if table is None or offset >= table.shape[1]:
            table = self.tables[purpose] = self.uniforms(purpose, range(max(16, 2 * (offset + 1))), device)
        return table[:, offset]
