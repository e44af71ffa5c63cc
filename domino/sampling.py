"""Turning logits into the distribution a token is drawn from. Target and drafter go through the same
function, so temperature, top-k and top-p shape both alike (required for lossless sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from domino.errors import DominoError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise DominoError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DominoError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DominoError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the last dimension after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `probs` (..., vocab)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


class RowSampling:
    """Sampling for a batch of requests: row r uses its own parameters and its own random generator,
    so a request's samples do not depend on which other requests share its batch."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None]):
        self.params, self.generators = params, generators
        self.greedy = torch.tensor([p.greedy for p in params])

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row sampling distributions of logits (n, ..., V); rows that decode greedily get zeros."""
        probs = torch.zeros_like(logits, dtype=torch.float32)
        for params in set(self.params):
            if not params.greedy:
                rows = torch.tensor([p == params for p in self.params])
                probs[rows] = probabilities(logits[rows], params)
        return probs

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of logits (n, V): the argmax for greedy rows, else a draw from the row's
        distribution. Returns the tokens and the distributions they were drawn from (None if all greedy)."""
        tokens = logits.argmax(dim=-1)
        if self.all_greedy:
            return tokens, None
        probs = self.probabilities(logits)
        for r in torch.nonzero(~self.greedy).flatten().tolist():
            tokens[r] = sample(probs[r], self.generators[r])
        return tokens, probs
