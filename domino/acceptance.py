"""Drafts computed from scratch, and the greedy acceptance they would get, at every position of a text.

One target forward over a whole sequence gives every token's features; a draft at anchor position a
then sees exactly the context a decoding round sees there (the features of the tokens before a) and
drafts with the same `Drafter.draft` the engine runs. Two uses:
- a reference for the engine: its drafts, made from caches grown round by round (holes, staging,
  compaction, joins), must equal these;
- a cheap held-out measure: on text the target wrote greedily, the accepted length at anchor a is the
  number of leading drafts equal to the text's next tokens, as verification would count it.
"""

from __future__ import annotations

import torch

from domino.drafter import ContextCache, Draft, Drafter
from domino.sampling import GREEDY, RowSampling
from domino.verify import leading_run


@torch.no_grad()
def drafts_from_scratch(drafter: Drafter, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                        sampling: RowSampling | None = None) -> Draft:
    """The drafts at each anchor position (A,) of one sequence `ids` (T,) whose target features
    (1, T, n * D) come from one forward: anchor token ids[a], context the tokens before a."""
    t, count = ids.shape[0], anchors.shape[0]
    cache = ContextCache(project=drafter.context_kv)
    drafter.extend_context(cache, features, torch.arange(t, device=ids.device)[None])
    cache.keys = [k.expand(count, -1, -1, -1) for k in cache.keys]
    cache.values = [v.expand(count, -1, -1, -1) for v in cache.values]
    valid = torch.arange(t, device=ids.device)[None] < anchors[:, None]
    sampling = sampling or RowSampling([GREEDY] * count, [None] * count)
    histories = None
    if drafter.config.lookup_ngram:  # each anchor's text for the context lookup: the sequence up to and including it
        text = ids.tolist()
        histories = [drafter.new_history(text[:a + 1]) for a in anchors.tolist()]
    return drafter.draft(cache, ids[anchors], sampling, positions=anchors, valid=valid, histories=histories)


@torch.no_grad()
def greedy_accepted(drafter: Drafter, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                    chunk: int = 64) -> torch.Tensor:
    """Per anchor (A,), how many greedy drafts verification would accept if `ids` is the target's own
    greedy text: the leading drafts that equal the tokens after the anchor (none past the text's end)."""
    drafts = drafter.config.num_drafts
    accepted = []
    for part in anchors.split(chunk):
        tokens = drafts_from_scratch(drafter, features, ids, part).tokens
        wanted = part[:, None] + 1 + torch.arange(drafts, device=ids.device)
        inside = wanted < ids.shape[0]
        match = (tokens == ids[wanted.clamp(max=ids.shape[0] - 1)]) & inside
        accepted.append(leading_run(match))
    return torch.cat(accepted)
