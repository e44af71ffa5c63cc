"""The training objective: packed blocks drawn at many anchors of a sequence, trained in one forward.

A training example is a token sequence with the target's layer features for every token. Each
anchor a opens a block [x_a, MASK, ...] at positions a..a+B-1 whose labels are x_{a+1}..x_{a+B}
(position k of the block predicts the token k+1 after the anchor). In the DFlash label convention
the anchor's slot is not trained and position k predicts x_{a+k}. A block sees the context strictly
before its anchor and itself, never another block: exactly what it sees at inference.

Loss per block position k (0-based): cross-entropy weighted by w_k = exp(-k / decay), or with
distillation DSpark's 0.1 CE + 0.9 TV to the target distribution. The base-anchored curriculum mixes
that loss of the final logits with the same loss of the base logits, (1 - lambda) L(final) +
lambda L(base), so it holds the head back with or without distillation. The confidence head's BCE
trains the confidence head alone (its inputs are detached): it estimates survival and never pulls
the backbone towards being easy to estimate. Heads read the ground-truth prefix (teacher forcing),
so the whole block trains in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from domino.drafter import Drafter
from domino.errors import DominoError
from domino.target import COMPUTE_DTYPES

# Published decay constants per block size (DESIGN §4); other sizes use B / 2.
DECAY_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class ObjectiveConfig:
    anchors_per_sequence: int = 64
    decay: float | None = None  # position-weight decay; None picks the published value for the block size
    curriculum_fraction: float = 0.5  # lambda falls from 1 to 0 over this fraction of the steps; 0 turns it off
    distill: bool = False  # DSpark: 0.1 CE + 0.9 TV(p_draft, p_target); needs the target's final hidden states
    confidence_weight: float = 1.0
    compute_dtype: str = "float32"  # "bfloat16": the step runs under autocast (twice as fast on CPUs with AMX)

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise DominoError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got '{self.compute_dtype}'")
        if self.anchors_per_sequence < 1:
            raise DominoError(f"anchors_per_sequence must be at least 1, got {self.anchors_per_sequence}")
        if not 0 <= self.curriculum_fraction <= 1:
            raise DominoError(f"curriculum_fraction must be in [0, 1], got {self.curriculum_fraction}")
        if self.decay is not None and self.decay <= 0:
            raise DominoError(f"decay must be positive, got {self.decay}")


def position_weights(block_size: int, decay: float | None = None) -> torch.Tensor:
    """w_k = exp(-k / decay) for block positions k = 0..B-1: early positions matter most, since a
    rejection there discards everything after it."""
    decay = decay or DECAY_BY_BLOCK_SIZE.get(block_size, block_size / 2)
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def curriculum_lambda(step: int, total_steps: int, fraction: float) -> float:
    """Weight of the base-logit loss: 1 at the start, falling linearly to 0 at `fraction` of training."""
    if fraction <= 0:
        return 0.0
    return max(0.0, 1.0 - step / (fraction * total_steps))


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, count: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row, uniformly among positions whose next token is trained.
    Returns anchors (b, count) and valid (b, count); rows with fewer candidates are padded with
    invalid anchors at position 0."""
    b, t = loss_mask.shape
    candidates = torch.zeros_like(loss_mask)
    positions = torch.arange(1, t, device=loss_mask.device)
    candidates[:, :-1] = loss_mask[:, 1:] & (positions < lengths[:, None])
    scores = torch.rand(b, t, generator=generator, device=loss_mask.device).masked_fill(~candidates, -1.0)
    values, anchors = scores.topk(min(count, t), dim=1)
    valid = values >= 0
    anchors = anchors.masked_fill(~valid, 0)
    order = anchors.masked_fill(~valid, t).argsort(dim=1)  # sort by position, invalid last
    return anchors.gather(1, order), valid.gather(1, order)


def packed_block_mask(anchors: torch.Tensor, valid: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Attention mask (b, 1, m*B, T + m*B) for m packed blocks over a context of T tokens: block i sees
    context positions < anchor_i and the B slots of block i."""
    b, m = anchors.shape
    context = torch.arange(context_len, device=anchors.device) < (anchors * valid)[..., None]  # (b, m, T)
    context = context.repeat_interleave(block_size, dim=1)  # (b, m*B, T)
    block_of = torch.arange(m * block_size, device=anchors.device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([context, own_block], dim=-1)[:, None]


@dataclass
class PackedBlocks:
    """Every block of a packed batch, flattened to n = sequences x anchors per sequence blocks, each with
    its k = num_drafts slots that propose (the block less a DFlash anchor's silent slot)."""

    hidden: torch.Tensor  # (n, k, D) backbone output at the slots that propose
    labels: torch.Tensor  # (n, k) the tokens (target ids) each slot must predict
    trained: torch.Tensor  # (n, k) slots whose label exists and is a response token
    prev_tokens: torch.Tensor  # (n, k) the data's token before each label: anchor, then ground truth
    rows: torch.Tensor  # (n, k) which sequence of the batch each block came from
    positions: torch.Tensor  # (n, k) sequence position just before each label (where the target predicts it)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]  # detached; per-position counts are exact sums, so they add across steps/ranks


class DraftingObjective(nn.Module):
    """The drafter plus its loss, as one module whose forward returns the loss (the shape DeepSpeed
    wraps). `batch` holds input_ids (b, T), loss_mask (b, T), lengths (b,), features (b, T, n*D), for
    distillation final_hidden (b, T, D), and optionally target_next (b, T): the target's greedy choice
    after each position, which then replaces the data's next token as the label (the heads still read
    the data's tokens, which is what the target's choice was conditioned on)."""

    def __init__(self, drafter: Drafter, config: ObjectiveConfig, seed: int = 0):
        super().__init__()
        self.drafter = drafter
        self.config = config
        weights = position_weights(drafter.config.block_size, config.decay)[:drafter.config.num_drafts]
        self.register_buffer("weights", weights, persistent=False)
        self.generator = torch.Generator().manual_seed(seed)

    def pack(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor) -> PackedBlocks:
        """Run the backbone on blocks opened at `anchors` (b, m) of each sequence, all in one forward."""
        drafter, block = self.drafter, self.drafter.config.block_size
        ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"].bool(), batch["lengths"]
        (b, t), m = ids.shape, anchors.shape[1]
        offsets = torch.arange(block, device=ids.device)

        context_kv = drafter.context_kv(batch["features"], torch.arange(t, device=ids.device).expand(b, t))
        block_ids = drafter.block_ids(ids.gather(1, anchors))  # (b, m, B)
        positions = anchors[..., None] + offsets  # (b, m, B)
        mask = packed_block_mask(anchors, valid, t, block)
        h = drafter.backbone(block_ids.reshape(b, m * block), positions.reshape(b, m * block), context_kv, mask)

        # labels: the tokens after each anchor, one per proposing slot; trained where they exist and
        # are response tokens
        silent, drafts = drafter.config.silent_slots, drafter.config.num_drafts
        label_pos = (positions[..., silent:] + 1 - silent).reshape(b, m * drafts)
        clamped = label_pos.clamp(max=t - 1)
        following = ids.gather(1, clamped).reshape(b * m, drafts)
        labels = following
        if "target_next" in batch:  # the target's own choice there, given the data before it
            labels = batch["target_next"].gather(1, clamped - 1).reshape(b * m, drafts)
        trained = (loss_mask.gather(1, clamped) & (label_pos < lengths[:, None])).reshape(b * m, drafts)
        trained &= valid.reshape(b * m, 1)
        rows = torch.arange(b, device=ids.device)[:, None, None].expand(b, m, drafts)
        return PackedBlocks(
            hidden=h.reshape(b * m, block, -1)[:, silent:],
            labels=labels,
            trained=trained,
            prev_tokens=torch.cat([block_ids.reshape(b * m, block)[:, :1], following[:, :-1]], dim=1),
            rows=rows.reshape(b * m, drafts),
            positions=(label_pos - 1).reshape(b * m, drafts),
        )

    def forward(self, batch: dict[str, torch.Tensor], curriculum_lambda: float = 0.0) -> ObjectiveOutput:
        # autocast keeps the losses and softmaxes in float32; backward follows the forward's dtypes
        with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16,
                            enabled=self.config.compute_dtype == "bfloat16"):
            return self.loss(batch, curriculum_lambda)

    def loss(self, batch: dict[str, torch.Tensor], curriculum_lambda: float) -> ObjectiveOutput:
        drafter, cfg = self.drafter, self.config
        anchors, valid = sample_anchors(batch["loss_mask"].bool().cpu(), batch["lengths"].cpu(),
                                        cfg.anchors_per_sequence, self.generator)
        device = batch["input_ids"].device
        packed = self.pack(batch, anchors.to(device), valid.to(device))
        h, trained, prev_tokens = packed.hidden, packed.trained, packed.prev_tokens
        # labels outside a reduced draft vocabulary (-100) cannot be drafted: no cross-entropy, never correct
        draft_labels = drafter.to_draft_ids(packed.labels[trained])
        prev_embeds = drafter.embed(prev_tokens)

        # logits only where a label is trained: the vocab projection dominates memory
        weights = self.weights.expand_as(trained)[trained]
        base = drafter.draft_logits(h[trained])
        final = base
        if drafter.head is not None:
            codes = drafter.head.codes(h, prev_tokens, prev_embeds)[trained]
            final = base + drafter.head.out(codes).float()

        def weighted_mean(values: torch.Tensor) -> torch.Tensor:
            return (values * weights).sum() / weights.sum().clamp(min=1e-6)

        p_target = None
        if cfg.distill:
            with torch.no_grad():  # the target's own next-token distribution at each block position
                target_hidden = batch["final_hidden"][packed.rows[trained], packed.positions[trained]]
                p_target = drafter.on_draft_vocabulary(torch.softmax(drafter.target_logits(target_hidden), dim=-1))

        def drafting_loss(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            """The loss of one set of logits (CE, or DSpark's 0.1 CE + 0.9 TV with distillation), its CE,
            and its TV per slot."""
            ce = weighted_mean(F.cross_entropy(logits, draft_labels, reduction="none", ignore_index=-100))
            if p_target is None:
                return ce, ce, None
            # the target's mass outside a reduced draft vocabulary is distance the drafter cannot close
            tv = 0.5 * ((torch.softmax(logits, dim=-1) - p_target).abs().sum(dim=-1) + (1 - p_target.sum(dim=-1)))
            return 0.1 * ce + 0.9 * weighted_mean(tv), ce, tv

        # the base-anchored curriculum mixes the whole drafting loss (CE, or CE + TV), so with distillation
        # too the head's residual is held back while lambda is high
        loss, ce, tv = drafting_loss(final)
        if drafter.head is not None and curriculum_lambda > 0:
            loss = (1 - curriculum_lambda) * loss + curriculum_lambda * drafting_loss(base)[0]
        hits = (final.detach().argmax(-1) == draft_labels).float()  # the drafter's greedy choice is the label
        metrics = {"ce": ce.detach()}
        if tv is not None:
            metrics["tv"] = weighted_mean(tv).detach()
        if drafter.confidence is not None:
            # an estimator of survival, not a drafting signal: its loss trains the confidence head only
            survival = (1 - tv).detach() if tv is not None else hits
            confidence_logits = drafter.confidence(h[trained].detach(), prev_embeds[trained].detach())
            bce = F.binary_cross_entropy_with_logits(confidence_logits, survival)
            loss = loss + cfg.confidence_weight * bce
            metrics["bce"] = bce.detach()

        correct = torch.zeros(trained.shape, device=device)
        correct[trained] = hits
        metrics["correct"] = correct.sum(0).detach()
        metrics["count"] = trained.float().sum(0)
        metrics["loss"] = loss.detach()
        return ObjectiveOutput(loss=loss, metrics=metrics)


def expected_accept_length(accuracy: torch.Tensor) -> float:
    """tau = 1 + sum_j prod_{i<=j} acc_i, reading teacher-forced accuracies as acceptance rates."""
    return 1.0 + float(torch.cumprod(accuracy, dim=0).sum())
