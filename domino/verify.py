"""Lossless verification of drafted tokens (DESIGN §5).

The target chooses its own token at every verified position: its argmax (T = 0), or at T > 0 the
winner of the request's Gumbel-max race at that position (domino.sampling), which is an exact
sample from the target's distribution given the tokens before it. A draft is accepted while it equals
those choices, and the target's choice follows the accepted prefix. The committed tokens are thus
the target's own whatever was drafted, and at T > 0 the drafter, drawing with the same noise, makes
the same choice whenever q and p agree closely enough (an acceptance of at least (1 - TV) / (1 + TV)
per position, against 1 - TV for rejection sampling, which would make the tokens depend on the drafts;
Daliri et al. 2024, "drafter-invariant speculative decoding").

Rows verify different numbers of drafts: row r judges its first `limits[r]` drafts, ignoring the rest.
"""

from __future__ import annotations

import torch


def accept(draft_tokens: torch.Tensor, choices: torch.Tensor,
           limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts equal to the target's choices, then commit the target's
    choice after it. draft_tokens (b, m), choices (b, m + 1) -> accepted (b,), next_token (b,)."""
    match = draft_tokens == choices[:, :-1]
    if limits is not None:
        match &= torch.arange(draft_tokens.shape[1], device=draft_tokens.device) < limits[:, None]
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, choices.gather(1, accepted[:, None])[:, 0]

