"""The parallel draft model (DFlash-style backbone) with an optional sequential head.

One forward drafts a whole block. The block's input is [anchor, MASK, ..., MASK] embedded with the
target's frozen table; in every draft layer, keys and values are the fused target features of the
context followed by the block's own states, and queries come from the block only, so the block
attends to all context and to itself without a causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from domino.config import DrafterConfig
from domino.errors import DominoError
from domino.formats import CONFIG_NAME, WEIGHTS_NAME, read_checkpoint
from domino.heads import ConfidenceHead, build_head
from domino.lookup import CopyRun, TokenHistory
from domino.packed_linear import pack, pack_linear_layers, packed_linear, runs_packed
from domino.sampling import RowSampling, point_masses


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings at `positions` (n, t) -> (n, 1, t, head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """Normalises in its weight's dtype: under bfloat16 autocast (training's compute_dtype) the norm runs
    in float32, as mixed precision keeps it, on torch's fused kernel; elsewhere the cast does nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values (n, kv_heads, t, head_dim) of states x (n, t, D)."""
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, context_kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None):
        n, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context_kv[0], k], dim=2)
        v = torch.cat([context_kv[1], v], dim=2)
        grouped = self.num_heads != self.num_kv_heads
        if grouped and mask is not None and q.is_cuda:
            # on CUDA, grouped-query attention with a mask only has the math kernel, which keeps every
            # score (packed training blocks: tens of GB); shared keys/values repeated take any kernel.
            # On a CPU the grouped kernel is the faster (same values: measured 1.6-2x at 8 block slots)
            k, v = (t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1) for t in (k, v))
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        return self.o_proj(out.transpose(1, 2).reshape(n, t, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        d = config.hidden_size
        self.attn_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.attn = DraftAttention(config)
        self.mlp_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.gate = nn.Linear(d, config.intermediate_size, bias=False)
        self.up = nn.Linear(d, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, d, bias=False)

    def forward(self, x, cos, sin, context_kv, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, context_kv, mask)
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


@dataclass
class ContextCache:
    """Per draft layer, the keys and values of the context (n, kv_heads, slots, head_dim). Only
    committed tokens' features are attended to; a drafted block is never cached. In a batch of
    requests, rows hold different numbers of tokens: which slots count is the batch's to say
    (BatchCaches.valid, handed to `Drafter.draft`).

    Features can also be `stage`d: kept as they are and turned into keys and values only by
    `catch_up`, which every draft runs first. Prompts and rounds that decode plainly (the speculation
    gate shut, or a batch too large for any draft to pay) then cost the drafter one list append instead
    of a projection and a copy of the whole cache."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    project: Callable[[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (features, positions)

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]

    def append(self, new: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append every layer's keys and values for new slots."""
        if not self.keys:
            self.keys, self.values = [k for k, _ in new], [v for _, v in new]
            return
        for i, (k, v) in enumerate(new):
            self.keys[i] = torch.cat([self.keys[i], k], dim=2)
            self.values[i] = torch.cat([self.values[i], v], dim=2)

    def stage(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append features (n, t, n_layers * D) at `positions` (n, t), projecting them later."""
        if self.project is None:
            raise DominoError("a context cache stages features only with a projection: "
                              "ContextCache(project=drafter.context_kv)")
        self.staged.append((features, positions))

    def catch_up(self) -> None:
        """Project the staged features (with `project`, the drafter's `context_kv`) into the cache."""
        if self.staged:
            features, positions = self.staged_block()
            self.staged = []
            self.append(self.project(features, positions))

    @property
    def all_staged(self) -> bool:
        """Whether no slot is projected yet: the cache is its staged features alone."""
        return not self.keys

    def staged_block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged features (n, t, n_layers * D) and positions (n, t) as one block."""
        return tuple(torch.cat(parts, dim=1) for parts in zip(*self.staged))

    def restage(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Replace the staged features with one block (rows joined or reordered by the caller)."""
        self.staged = [(features, positions)]

    def drop_staged_tail(self, count: int) -> None:
        """Cut the last `count` slots of the latest staged features (slots no row kept)."""
        features, positions = self.staged[-1]
        self.staged[-1] = (features[:, :-count], positions[:, :-count])

    def gather_staged(self, order: torch.Tensor) -> None:
        """Keep, per row, the staged slots `order` (n, t) in that order (a cache that is all staged, being
        compacted: the caller moves the other caches' slots alike)."""
        features, positions = self.staged_block()
        self.restage(features.gather(1, order[..., None].expand(-1, -1, features.shape[-1])), positions.gather(1, order))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the staged features (the caller indexes keys, values and valid)."""
        self.staged = [(features[rows], positions[rows]) for features, positions in self.staged]


@dataclass
class Draft:
    tokens: torch.Tensor  # (n, m): proposals (target ids) for the m positions after the anchor (m = config.num_drafts or fewer)
    probs: torch.Tensor | None  # (n, m, target vocab): the distribution each proposal was drawn from (None if greedy)
    confidence: torch.Tensor | None  # (n, m): survival probabilities, when the drafter has a confidence head
    copied: torch.Tensor | None = None  # (n, m) bool: proposals copied from the row's text (context lookup)


class _Copies:
    """The rows' copy runs (domino.lookup) at the current block position, as tensors for the draft loop;
    with no runs, every call leaves the drafter's own values."""

    def __init__(self, runs: list[CopyRun] | None, device: torch.device):
        self.runs, self.device = runs, device
        if runs:
            self._update([run.proposal() for run in runs])

    def _update(self, proposals: list[int | None]) -> None:
        self.copying = torch.tensor([p is not None for p in proposals], dtype=torch.bool, device=self.device)
        self.tokens = torch.tensor([p or 0 for p in proposals], dtype=torch.long, device=self.device)

    def any(self) -> bool:
        """Whether some row copies at this position."""
        return bool(self.runs) and bool(self.copying.any())

    def take(self, drafted: torch.Tensor) -> torch.Tensor:
        """The tokens at this position: copies where a row copies, `drafted` elsewhere."""
        return torch.where(self.copying, self.tokens, drafted) if self.runs else drafted

    def distribution(self, drafted: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The proposal distributions (n, V): a point mass on the copy where a row copies."""
        if not self.any():
            return drafted
        point = point_masses(tokens, drafted.shape[-1], drafted.dtype)
        return torch.where(self.copying[:, None], point, drafted)

    def confidence(self, drafted: torch.Tensor) -> torch.Tensor:
        if not self.runs:
            return drafted
        copied = torch.tensor([run.confidence for run in self.runs], dtype=drafted.dtype, device=drafted.device)
        return torch.where(self.copying, copied, drafted)

    def push(self, tokens: torch.Tensor) -> None:
        """Record this position's tokens and move to the next position."""
        if self.runs:
            for run, token in zip(self.runs, tokens.tolist()):
                run.push(token)
            self._update([run.proposal() for run in self.runs])


class Drafter(nn.Module):
    """Backbone + head. The target's embedding table and LM head are shared and frozen: they are held
    by reference, are not parameters of this module, and are not saved in its checkpoints."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.feature_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.head = build_head(config)
        self.confidence = ConfidenceHead(config) if config.confidence_head else None
        self.target_modules = (embed_tokens, lm_head)  # a tuple, so torch does not register them
        self.register_buffer("draft_to_target", None)  # draft id -> target id, with a reduced draft vocabulary
        if config.draft_vocab_size:  # saved with the checkpoint; the LM head's rows it picks are not
            self.draft_to_target = torch.arange(config.draft_vocab_size, device=lm_head.weight.device)
            self.register_buffer("head_rows", torch.empty(0), persistent=False)
            self.register_load_state_dict_post_hook(lambda module, keys: module._pick_head_rows())
            self._pick_head_rows()

    @classmethod
    def initial(cls, config: DrafterConfig, target, seed: int, vocabulary=None) -> "Drafter":
        """The drafter a training run starts from: weights drawn with `seed`, scoring `vocabulary` (target
        ids) when the config reduces the draft vocabulary. The closing evaluation rebuilds it as its
        untrained baseline."""
        torch.manual_seed(seed)
        drafter = cls(config, target.embed_tokens, target.lm_head)
        if vocabulary is not None:
            drafter.set_draft_vocabulary(torch.as_tensor(vocabulary))
        return drafter

    # -- shared target pieces --------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target_modules[0](ids).to(self.fc.weight.dtype)

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's own LM head over its whole vocabulary (what distillation compares with)."""
        head = self.target_modules[1]
        return head(h.to(head.weight.dtype)).float()

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the target's whole one unless it is reduced)."""
        if self.draft_to_target is None:
            return self.target_logits(h)
        head = self.target_modules[1]
        bias = None if head.bias is None else head.bias[self.draft_to_target]
        h = h.to(self.head_rows.dtype)
        if runs_packed(h, self.head_rows):  # drafting on a CPU: 5x faster at 8 positions
            if self.packed_head_rows is None:  # packed at the first draft, not for training or at each load
                self.packed_head_rows = pack(self.head_rows)
            return packed_linear(h, self.packed_head_rows, bias).float()
        return F.linear(h, self.head_rows, bias).float()

    # -- the reduced draft vocabulary (FR-Spec / EAGLE-3) ------------------------------------------
    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Score only `target_ids` (draft id i stands for target id target_ids[i]): the LM head and the
        head's residual shrink from the target's vocabulary to these tokens."""
        size, vocab = self.config.draft_vocab_size, self.config.target_vocab_size
        target_ids = torch.as_tensor(target_ids, dtype=torch.long)
        if not size or target_ids.shape != (size,):
            raise DominoError(f"the draft vocabulary must hold draft_vocab_size={size} target ids, got {tuple(target_ids.shape)}")
        if target_ids.min() < 0 or target_ids.max() >= vocab or len(target_ids.unique()) != size:
            raise DominoError(f"the draft vocabulary must be {size} distinct target ids in 0..{vocab - 1}")
        self.draft_to_target.copy_(target_ids)
        self._pick_head_rows()

    def _pick_head_rows(self) -> None:
        weight = self.target_modules[1].weight
        self.head_rows = weight.detach()[self.draft_to_target.to(weight.device)].to(self.draft_to_target.device)
        self.packed_head_rows = None  # these rows packed for oneDNN: by draft_logits, when first needed

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target tokens; -100 (cross-entropy's ignore index) for tokens outside the draft vocabulary."""
        if self.draft_to_target is None:
            return target_ids
        lookup = target_ids.new_full((self.config.target_vocab_size,), -100)
        lookup[self.draft_to_target] = torch.arange(len(self.draft_to_target), device=target_ids.device)
        return lookup[target_ids]

    def on_draft_vocabulary(self, target_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the target's vocabulary (…, V) restricted to the draft vocabulary (…, N)."""
        return target_probs if self.draft_to_target is None else target_probs[..., self.draft_to_target]

    def on_target_vocabulary(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary (…, N) as one over the target's (…, V): zero outside."""
        if self.draft_to_target is None:
            return draft_probs
        full = draft_probs.new_zeros(*draft_probs.shape[:-1], self.config.target_vocab_size)
        return full.index_copy_(-1, self.draft_to_target, draft_probs)

    # -- starting from the target's own layers -----------------------------------------------------
    @torch.no_grad()
    def start_from_target(self, target) -> None:
        """Start as the target's own next layer(s) reading its states: draft layer i a copy of the target
        layer right after the deepest feature layer (plus i), the feature fusion the identity on that
        layer's states, the output norm the target's final one. Llama-style layers only."""
        first, d = max(self.config.target_layer_ids) + 1, self.config.hidden_size
        if first + len(self.layers) > target.num_layers:
            raise DominoError(f"the target has no layer {first + len(self.layers) - 1} to start draft layers from: "
                              f"read shallower target layers")
        source_layers = target.decoder_layers
        try:
            pairs = [(self.norm, target.model.base_model.norm), (self.feature_norm, source_layers[first].input_layernorm)]
            for mine, theirs in zip(self.layers, source_layers[first:]):
                attn, mlp = theirs.self_attn, theirs.mlp
                pairs += [(mine.attn.q_proj, attn.q_proj), (mine.attn.k_proj, attn.k_proj), (mine.attn.v_proj, attn.v_proj),
                          (mine.attn.o_proj, attn.o_proj), (mine.attn_norm, theirs.input_layernorm),
                          (mine.mlp_norm, theirs.post_attention_layernorm), (mine.gate, mlp.gate_proj),
                          (mine.up, mlp.up_proj), (mine.down, mlp.down_proj)]
        except AttributeError as error:
            raise DominoError(f"cannot start from target '{target.name}': its layers are not Llama-style ({error})") from None
        for mine, theirs in pairs:
            mine.weight.copy_(theirs.weight)
        deepest = self.config.target_layer_ids.index(first - 1)
        self.fc.weight.zero_()
        self.fc.weight[:, deepest * d:(deepest + 1) * d] = torch.eye(d)

    # -- backbone ----------------------------------------------------------------------------------
    def _rotary(self, positions: torch.Tensor):
        return rotary(positions, self.config.head_dim, self.config.rope_theta)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fuse target features (n, t, n_layers * D) and turn them into every layer's context keys/values."""
        fused = self.feature_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self._rotary(positions)
        return [layer.attn.keys_values(fused, cos, sin) for layer in self.layers]

    def backbone(self, block_ids: torch.Tensor, positions: torch.Tensor,
                 context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (n, q, D) of the block tokens `block_ids` at `positions` (n, q). `mask`
        (n, 1, q, context + q), True where attention is allowed; None lets everything attend to everything."""
        x = self.embed(block_ids)
        cos, sin = self._rotary(positions)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def block_ids(self, anchors: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """[anchor, MASK, ..., MASK] for each anchor (…) -> (…, size), by default (…, B)."""
        ids = anchors.new_full((*anchors.shape, size or self.config.block_size), self.config.mask_token_id)
        ids[..., 0] = anchors
        return ids

    # -- drafting ----------------------------------------------------------------------------------
    def set_lookup(self, ngram: int) -> None:
        """Change the context lookup's longest repeat (0: the learned drafter alone); it is a decoding option,
        so a trained drafter can be measured with and without it."""
        self.config = replace(self.config, lookup_ngram=ngram)

    def new_history(self, tokens: list[int]) -> TokenHistory | None:
        """A request's text indexed for the context lookup (None when the drafter does not look up)."""
        if not self.config.lookup_ngram:
            return None
        return TokenHistory(self.config.lookup_ngram, tokens, self.config.lookup_min_ngram)

    def copy_runs(self, histories: list[TokenHistory | None] | None) -> list[CopyRun] | None:
        """Each row's copies for one round (domino.lookup); None when the drafter does not look up."""
        if not self.config.lookup_ngram or histories is None or None in histories:
            return None
        return [CopyRun(h) for h in histories]

    @staticmethod
    def copy_from_the_start(runs: list[CopyRun] | None) -> bool:
        """Whether every row copies from its first draft position on: such a round runs no backbone, so the
        engine drafts it whatever the speculation gate says of the drafter."""
        return runs is not None and all(run.proposal() is not None for run in runs)

    def extend_context(self, cache: ContextCache, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append tokens' features (n, t, n_layers * D) at `positions` (n, t) to the cache."""
        cache.append(self.context_kv(features, positions))

    @torch.no_grad()
    def draft(self, cache: ContextCache, anchors: torch.Tensor, sampling: RowSampling,
              positions: torch.Tensor | None = None,
              screen: Callable[[torch.Tensor], bool] | None = None, needed: torch.Tensor | None = None,
              valid: torch.Tensor | None = None, histories: list[TokenHistory] | None = None) -> Draft | None:
        """One drafting round: propose the `config.num_drafts` tokens after each anchor (n,), sitting at
        `positions` (n,) (default: right after the cached context). Each proposal is chosen by the row's
        sampling rule from a distribution conditioned on the proposals before it, and that distribution
        is returned.

        `needed` (n,): the tokens each row still needs (its drafts plus the target's own token). A
        DFlash-convention drafter then gives row r a block of at most `needed[r]` + 1 slots, as DFlash's
        reference loop does near the end of a request: the block attends to itself without a causal mask,
        so its drafts depend on its length, and this keeps our decoding of a DFlash checkpoint the
        reference's, token for token and round for round. A row's shorter block is the longest row's with
        the slots past its own end masked, so its drafts do not depend on the rows beside it.

        `valid` (n, slots): the context slots each row attends to (None: all of them).

        `screen` (drafters with a confidence head) sees the first position's survival estimates (n,),
        which need no logits, and answers whether any draft is worth verifying. When none is, the round
        ends there (None), skipping the LM head over n x B positions: at large batch the costliest part.
        Rounds in which a row copies from the first position are not screened: a copy run is worth
        judging whole (domino.scheduler).

        `histories` (each row's text so far, ending with its anchor): with `config.lookup_ngram`, a row
        copies from its own text wherever that text repeats itself (domino.lookup); a copy's distribution
        is a point mass. When every row copies from the first position on, the backbone is not run."""
        cache.catch_up()
        n, block, silent = anchors.shape[0], self.config.block_size, self.config.silent_slots
        shortened = bool(silent) and needed is not None
        if shortened:
            block = min(block, int(needed.max()) + silent)
        runs = self.copy_runs(histories)
        if self.copy_from_the_start(runs):
            return self._copied(runs, block - silent, sampling)
        offsets = torch.arange(block, device=anchors.device)
        if positions is None:
            positions = torch.full((n,), cache.length, device=anchors.device)
        mask = None
        if valid is not None or shortened:  # attend to the valid context slots and to the row's own block
            if valid is None:
                valid = torch.ones(n, cache.length, dtype=torch.bool, device=anchors.device)
            own_block = offsets[None] < (needed[:, None] + silent if shortened else block)  # (n or 1, block)
            mask = torch.cat([valid, own_block.expand(n, block)], dim=1)[:, None, None, :]
        h = self.backbone(self.block_ids(anchors, block), positions[:, None] + offsets,
                          [cache.layer(i) for i in range(len(self.layers))], mask)[:, silent:]
        prev, prev_embed = anchors, self.embed(anchors)
        copies = _Copies(runs, anchors.device)
        confidence = []
        if self.confidence is not None:
            confidence.append(copies.confidence(torch.sigmoid(self.confidence(h[:, 0], prev_embed))))
            # the screen judges first drafts alone; a row copying from the start is judged by its whole run
            if screen is not None and not copies.any() and not screen(confidence[0]):
                return None
        base = self.draft_logits(h)
        state = self.head.initial_state(n, h) if self.head is not None else None
        tokens, probs, copied = [], [], []
        for k in range(h.shape[1]):
            if k:
                prev_embed = self.embed(prev)
                if self.confidence is not None:
                    confidence.append(copies.confidence(torch.sigmoid(self.confidence(h[:, k], prev_embed))))
            logits = base[:, k]
            if self.head is not None:
                z, state = self.head.step(k, h[:, k], prev, prev_embed, state)
                logits = logits + self.head.out(z).float()
            choice, p = sampling.choose(logits)
            prev = copies.take(self.to_target_ids(choice))
            tokens.append(prev)
            probs.append(None if p is None else copies.distribution(self.on_target_vocabulary(p), prev))
            if runs is not None:
                copied.append(copies.copying)
            copies.push(prev)
        return Draft(
            tokens=torch.stack(tokens, dim=1),
            probs=None if sampling.all_greedy else torch.stack(probs, dim=1),
            confidence=torch.stack(confidence, dim=1) if confidence else None,
            copied=torch.stack(copied, dim=1) if copied else None,
        )

    def _copied(self, runs: list[CopyRun], drafts: int, sampling: RowSampling) -> Draft:
        """A round in which every row copies all its `drafts` proposals: no backbone, no LM head, and so
        nothing for a screen to save."""
        device = self.fc.weight.device
        copies = _Copies(runs, device)
        confidence, tokens = [], []
        for _ in range(drafts):
            if self.confidence is not None:
                confidence.append(copies.confidence(self.fc.weight.new_zeros(len(runs))))
            tokens.append(copies.take(torch.zeros(len(runs), dtype=torch.long, device=device)))
            copies.push(tokens[-1])
        tokens = torch.stack(tokens, dim=1)
        return Draft(
            tokens=tokens,
            probs=None if sampling.all_greedy else point_masses(tokens, self.config.target_vocab_size),
            confidence=torch.stack(confidence, dim=1) if confidence else None,
            copied=torch.ones_like(tokens, dtype=torch.bool),
        )

    # -- checkpoints -------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / CONFIG_NAME)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, path / WEIGHTS_NAME)

    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> "Drafter":
        """Load a drafter for `target` (a domino.target.Target) from a folder in our format or DFlash's
        (domino.formats), refusing one made for another target."""
        path = Path(path).expanduser()
        config, weights = read_checkpoint(path, target)
        drafter = cls(config, target.embed_tokens, target.lm_head)
        try:
            drafter.load_state_dict(weights)
        except RuntimeError as error:
            first = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
            raise DominoError(f"the weights in {path} do not match its config: {first[:300]}") from None
        drafter = drafter.to(device=target.device).eval()
        pack_linear_layers(drafter)  # for inference on a CPU in float32; training would fall back to the dense weights
        return drafter


def load_drafter(spec: str, target) -> Drafter | str | None:
    """A drafter named as users name it: 'none' (plain decoding, None), 'oracle' (the target's own greedy
    continuation, the loop's ceiling), or a checkpoint folder, loaded for `target` in its dtype."""
    if spec in ("none", "oracle"):
        return None if spec == "none" else spec
    return Drafter.from_pretrained(spec, target).to(target.model.dtype)
