"""Sequential heads that correct the backbone's parallel logits, and the confidence head.

The backbone drafts every block position at once, so position k cannot see which token was drafted
at k-1. A head restores that dependency cheaply: it reads the drafted prefix and adds a low-rank
residual to the base logits, final_k = base_k + W2 z_k. Every head produces the codes z_k (rank r);
W2 (r -> draft vocabulary) is shared code in `LogitHead`.

Position convention (0-based k over the B block positions): `prev_tokens[:, k]` is the token before
draft position k, i.e. the anchor at k = 0 and the k-th drafted (or, in training, ground-truth) token
after it. Training feeds ground truth for all k at once (teacher forcing); drafting calls `step`
position by position with what was actually drafted. Both paths run the same modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import DrafterConfig


class LogitHead(nn.Module):
    """Base class: codes (…, r) -> logit residual (…, draft vocabulary). W2 starts at zero, so an untrained head
    leaves the base logits unchanged."""

    def __init__(self, rank: int, vocab_size: int):
        super().__init__()
        self.out = nn.Linear(rank, vocab_size, bias=False)
        nn.init.zeros_(self.out.weight)

    def initial_state(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def codes(self, h: torch.Tensor, prev_tokens: torch.Tensor, prev_embeds: torch.Tensor) -> torch.Tensor:
        """Teacher-forced codes for all positions: h (n, B, D), prev_* (n, B[, D]) -> (n, B, r)."""
        raise NotImplementedError

    def step(self, k: int, h_k: torch.Tensor, prev_token: torch.Tensor, prev_embed: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Codes for position k only: h_k (n, D) -> (n, r), and the state for position k + 1."""
        raise NotImplementedError


class DominoHead(LogitHead):
    """GRU over the target embeddings of the drafted tokens; z_k = SiLU(W1 [h_k ; s_{k-1}]).
    The first position has no drafted prefix and keeps its base logits (z_0 = 0)."""

    first_read = 1  # position of the first token the GRU reads: the first draft
    gru_bias = True

    def __init__(self, config: DrafterConfig):
        super().__init__(config.rank, config.scored_vocab_size)
        self.gru = nn.GRU(config.hidden_size, config.gru_hidden, batch_first=True, bias=self.gru_bias)
        self.proj = nn.Linear(config.hidden_size + config.gru_hidden, config.rank, bias=False)

    def initial_state(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(1, n, self.gru.hidden_size)

    def codes(self, h, prev_tokens, prev_embeds):
        states, _ = self.gru(prev_embeds[:, self.first_read:])
        states = states[:, 1 - self.first_read:]  # the states before positions 1..B-1
        z = F.silu(self.proj(torch.cat([h[:, 1:], states], dim=-1)))
        return torch.cat([torch.zeros_like(z[:, :1]), z], dim=1)

    def step(self, k, h_k, prev_token, prev_embed, state):
        if k >= self.first_read:
            out, state = self.gru(prev_embed[:, None], state)
        if k == 0:
            return h_k.new_zeros(h_k.shape[0], self.proj.out_features), state
        return F.silu(self.proj(torch.cat([h_k, out[:, 0]], dim=-1))), state


class SGLangDominoHead(DominoHead):
    """The Domino head exactly as SGLang serves it (its `projector_type: domino`): a bias-free GRU that
    is primed with the anchor as well, so the state before position k has read the anchor and the
    drafts before k. Choose it for training when the drafter is to be exported to SGLang."""

    first_read = 0
    gru_bias = False


class MarkovHead(LogitHead):
    """DSpark's Markov head: a low-rank bigram table, z_k = E[x_{k-1}]."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config.rank, config.scored_vocab_size)
        self.embed = nn.Embedding(config.target_vocab_size, config.rank)

    def codes(self, h, prev_tokens, prev_embeds):
        return self.embed(prev_tokens)

    def step(self, k, h_k, prev_token, prev_embed, state):
        return self.embed(prev_token), state


class RNNHead(LogitHead):
    """DSpark's RNN head: with z = [s_{k-1} ; E[x_{k-1}] ; h_k], a gated state update
    s_k = g * s_{k-1} + (1 - g) * tanh(W_c z), g = sigmoid(W_g z), and codes tanh(W_o z)."""

    def __init__(self, config: DrafterConfig):
        super().__init__(config.rank, config.scored_vocab_size)
        self.embed = nn.Embedding(config.target_vocab_size, config.rank)
        width = config.gru_hidden + config.rank + config.hidden_size
        self.gate = nn.Linear(width, config.gru_hidden)
        self.candidate = nn.Linear(width, config.gru_hidden)
        self.proj = nn.Linear(width, config.rank)

    def initial_state(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(n, self.gate.out_features)

    def codes(self, h, prev_tokens, prev_embeds):
        state = self.initial_state(h.shape[0], h)
        codes = []
        for k in range(h.shape[1]):
            z_k, state = self.step(k, h[:, k], prev_tokens[:, k], prev_embeds[:, k], state)
            codes.append(z_k)
        return torch.stack(codes, dim=1)

    def step(self, k, h_k, prev_token, prev_embed, state):
        z = torch.cat([state, self.embed(prev_token), h_k], dim=-1)
        gate = torch.sigmoid(self.gate(z))
        new_state = gate * state + (1 - gate) * torch.tanh(self.candidate(z))
        return torch.tanh(self.proj(z)), new_state


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w . [h_k ; E[x_{k-1}]]): the chance that position k survives verification given
    that its prefix did (E is the target's frozen embedding)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.score = nn.Linear(2 * config.hidden_size, 1)

    def forward(self, h: torch.Tensor, prev_embeds: torch.Tensor) -> torch.Tensor:
        """Logits of the survival probability, (…, D) x2 -> (…)."""
        return self.score(torch.cat([h, prev_embeds], dim=-1)).squeeze(-1)


HEADS: dict[str, type[LogitHead]] = {
    "domino": DominoHead, "sglang-domino": SGLangDominoHead, "markov": MarkovHead, "rnn": RNNHead}


def build_head(config: DrafterConfig) -> LogitHead | None:
    return None if config.head == "none" else HEADS[config.head](config)
