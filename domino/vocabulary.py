"""The reduced draft vocabulary (FR-Spec, EAGLE-3): the drafter scores only the tokens the target writes
most often, which shrinks its LM head and the head's residual from the target's vocabulary to N rows.

Verification is unchanged and stays exact: greedy drafts are target ids like any other, and at T > 0 the
drafter's distribution q is zero outside the draft vocabulary, so the residual max(p - q, 0) that a
rejection samples from covers those tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from domino.errors import DominoError


def count_tokens(sequences: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """How often each token id occurs among the trained (loss-masked) tokens of (ids, loss_mask) pairs."""
    trained = [np.asarray(ids, dtype=np.int64)[np.asarray(mask, dtype=bool)] for ids, mask in sequences]
    tokens = np.concatenate(trained) if trained else np.zeros(0, dtype=np.int64)
    return np.bincount(tokens, minlength=vocab_size)[:vocab_size].astype(np.int64)  # one pass, not one per row


def most_frequent(counts: np.ndarray, size: int) -> torch.Tensor:
    """The `size` most counted token ids, in increasing id order (ties go to the lower id, so the choice is
    reproducible; ids never seen fill the rest when the data has fewer distinct tokens)."""
    if not 0 < size <= len(counts):
        raise DominoError(f"a draft vocabulary of {size} tokens does not fit a vocabulary of {len(counts)}")
    order = np.argsort(-np.asarray(counts), kind="stable")[:size]
    return torch.from_numpy(np.sort(order)).long()


def coverage(counts: np.ndarray, draft_ids: torch.Tensor) -> float:
    """The share of counted tokens that the draft vocabulary holds: the drafter can never propose the rest."""
    total = counts.sum()
    return float(counts[draft_ids.numpy()].sum() / total) if total else 0.0
