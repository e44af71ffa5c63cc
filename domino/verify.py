"""Lossless verification of drafted tokens against the target's distributions (DESIGN §5).

Both rules work on a batch of rows: row r verifies its first `limits[r]` draft tokens (the rest are
ignored), and returns how many it accepts plus the token the target commits after them (its own
choice at the first rejection, or a bonus token when every verified draft passed). Speculative
sampling stays exact whatever the verify policy, as long as whether draft k is verified depends on
the drafts before k only (scheduler.py's policies read confidences that do).
"""

from __future__ import annotations

import torch

from domino.sampling import draw


def leading_run(flags: torch.Tensor) -> torch.Tensor:
    """Per row of flags (b, m), how many of its first entries are all True: the drafts that pass."""
    return flags.long().cumprod(dim=1).sum(dim=1)


def _limit_mask(draft_tokens: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    return torch.arange(draft_tokens.shape[1], device=draft_tokens.device) < limits[:, None]


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts equal to the target's argmax, then commit the target's own
    argmax. draft_tokens (b, m), target_logits (b, m + 1, V) -> accepted (b,), next_token (b,)."""
    choice = target_logits.argmax(dim=-1)
    match = (draft_tokens == choice[:, :-1]) & _limit_mask(draft_tokens, limits)
    accepted = leading_run(match)
    return accepted, choice.gather(1, accepted[:, None])[:, 0]


def speculative_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       accept_u: torch.Tensor, target_u: torch.Tensor,
                       limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: accept draft d_k when accept_u[k] q_k(d_k) < p_k(d_k) (probability
    min(1, p/q)); at the first rejection draw from norm(max(p_k - q_k, 0)); after all verified drafts
    pass, draw from p_m. The draw at offset k inverts its CDF at target_u[k]. draft_probs (b, m, V) are
    the q the drafts were drawn from; target_probs (b, m + 1, V); accept_u (b, m); target_u (b, m + 1)."""
    b, m = draft_tokens.shape
    p = target_probs[:, :m].gather(-1, draft_tokens[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    # in float64, as the uniforms come: rounding u to p's float32 would tilt the test by up to 2^-24
    passed = (accept_u.double() * q.double() < p.double()) & _limit_mask(draft_tokens, limits)
    accepted = leading_run(passed)

    rows = torch.arange(b, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]
    rejected = accepted < limits
    if m:
        q_next = draft_probs[rows, accepted.clamp(max=m - 1)]
        residual = torch.clamp(p_next - q_next, min=0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection implies p < q at the draft, hence p > q elsewhere: the residual has mass
        # (up to rounding, when p and q agree everywhere; then p itself is the right law).
        use_residual = rejected[:, None] & (mass > 0)
        p_next = torch.where(use_residual, residual, p_next)
    return accepted, draw(p_next, target_u[rows, accepted])
