"""The caches of a batch of requests that advance by different numbers of tokens per round.

The target's KV cache (a transformers DynamicCache) and the drafter's context cache share one slot
layout: slot t of row r holds the same token in both, and `valid` (n, slots) marks the slots that
count. A round appends the same number of slots to every row (rows verify different numbers of
drafts and keep different numbers); slots a row did not keep become holes that attention masks out
(slots that no row kept leave at once).
`compact` squeezes the holes out once they pile up, and rows join and leave between rounds. The
drafter's cache may lag behind, holding features it has not projected yet (ContextCache.stage); it
catches up before it drafts and before any change of slot layout, except where it is all staged
features (the batch has not drafted yet): then the features join and compact as they are, so a batch
that never drafts (too large for any draft to pay) never projects them.
Positions are passed explicitly, so a row's slot index never has to equal its token position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from domino.drafter import ContextCache

# holes a cache may hold beyond `slack` before it is compacted: a short cache's holes cost attention little,
# and without a floor its first rounds would copy the whole cache every few rounds
COMPACT_FLOOR = 16


class BatchCaches:
    def __init__(self, target: DynamicCache, context: ContextCache | None, valid: torch.Tensor):
        self.target, self.context, self.valid = target, context, valid

    @property
    def staged_only(self) -> bool:
        """Whether the drafter's cache holds staged features alone (the batch has not drafted yet)."""
        return self.context is not None and self.context.all_staged

    @property
    def positions(self) -> torch.Tensor:
        """The position of each row's next token: how many tokens it holds."""
        return self.valid.sum(dim=1)

    def _tensors(self) -> list[torch.Tensor]:
        """Every key/value tensor, each (rows, heads, slots, head_dim), in a fixed order."""
        out = [t for layer in self.target.layers for t in (layer.keys, layer.values)]
        if self.context is not None:
            out += self.context.keys + self.context.values
        return out

    def _replace(self, tensors: list[torch.Tensor], valid: torch.Tensor) -> None:
        layers = len(self.target.layers)
        for i, layer in enumerate(self.target.layers):
            layer.keys, layer.values = tensors[2 * i], tensors[2 * i + 1]
        if self.context is not None:
            rest = tensors[2 * layers:]
            half = len(rest) // 2
            self.context.keys, self.context.values = rest[:half], rest[half:]
        self.valid = valid

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], valid: torch.Tensor) -> None:
        self._replace([fn(t) for t in self._tensors()], valid)

    def attention_mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """The mask for a forward that appends slots `new_valid` (rows, s) (padding marked False)."""
        return torch.cat([self.valid, new_valid], dim=1)

    def settle(self, kept: torch.Tensor) -> None:
        """After a forward appended kept.shape[1] slots to both caches: which of them the rows keep. Each
        row keeps a prefix of the new slots, so those past the longest kept prefix are holes in every row:
        they leave the caches at once (at batch 1, that is every rejected slot) instead of waiting for
        `compact`. The drafter's share of those slots is still staged, and is cut there."""
        drop = kept.shape[1] - int(kept.sum(dim=1).max())
        if drop:
            self.target.crop(-drop)
            if self.context is not None:
                self.context.drop_staged_tail(drop)
            kept = kept[:, :-drop]
        self.valid = torch.cat([self.valid, kept], dim=1)

    def catch_up(self) -> None:
        """Bring the drafter's staged features into its cache, so both caches cover every slot."""
        if self.context is not None:
            self.context.catch_up()

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.context is not None:
            self.context.keep_rows(rows)
        self._map(lambda t: t[rows], self.valid[rows])

    def append_rows(self, others: list["BatchCaches"]) -> None:
        """Add the rows of `others` (requests joining the batch), padding the shorter ones with holes: one
        copy of the batch for all of them. Drafter caches that hold only staged features (nothing drafted
        yet, as in a batch too large for drafts to pay) join as features, still unprojected."""
        parts = [self, *others]
        staged_only = all(part.staged_only for part in parts)
        if not staged_only:
            for part in parts:
                part.catch_up()
        slots = max(part.valid.shape[1] for part in parts)

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = slots - t.shape[dim]
            return t if not missing else F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, missing))

        valid = torch.cat([pad(part.valid, 1) for part in parts])
        tensors = zip(*(part._tensors() for part in parts))
        if staged_only:  # padded slots are holes: valid masks them wherever they are projected
            staged = zip(*(part.context.staged_block() for part in parts))
            self.context.restage(*(torch.cat([pad(t, 1) for t in same]) for same in staged))
        self._replace([torch.cat([pad(t, 2) for t in same]) for same in tensors], valid)

    def compact(self, slack: float = 2.0) -> None:
        """Squeeze out the holes once the cache holds `slack` times more slots than its longest row
        needs, and COMPACT_FLOOR more: each row's valid slots move to the front, in order."""
        counts = self.positions
        longest = int(counts.max())
        if self.valid.shape[1] <= slack * longest + COMPACT_FLOOR:
            return
        staged_only = self.staged_only
        if not staged_only:
            self.catch_up()
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :longest]
        if staged_only:  # the drafter's features move with their slots, still unprojected
            self.context.gather_staged(order)
        index = order[:, None, :, None]
        valid = torch.arange(longest, device=counts.device) < counts[:, None]
        self._map(lambda t: t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3])), valid)
