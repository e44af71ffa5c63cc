"""The drafter's configuration: what it was built for (checked on load) and its own shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from domino.errors import DominoError

if TYPE_CHECKING:
    from domino.target import Target

HEAD_KINDS = ("none", "domino", "sglang-domino", "markov", "rnn")
# "shifted" (Domino): block position k proposes the (k+1)-th token after the anchor, B drafts per block.
# "dflash": the anchor's slot proposes nothing and position k proposes the k-th token, B - 1 drafts.
LABEL_CONVENTIONS = ("shifted", "dflash")
MAX_BLOCK_SIZE = 64
DEFAULT_BLOCK_SIZE = 16  # DFlash's block; also the oracle's draft length unless one is given


def select_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule: n layers spread evenly from the second to the third-from-last
    (the middle layer when n = 1)."""
    if num_draft_layers < 1:
        raise DominoError(f"num_draft_layers must be at least 1, got {num_draft_layers}")
    if num_target_layers < 4:
        raise DominoError(f"the target needs at least 4 layers to feed a drafter, it has {num_target_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def check_layer_ids(layer_ids: list[int], num_target_layers: int) -> None:
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_target_layers:
            raise DominoError(
                f"target layer id {layer_id} is out of range: the target has {num_target_layers} layers "
                f"(valid ids 0..{num_target_layers - 1})"
            )


def check_block_size(block_size: int) -> None:
    if not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise DominoError(f"block_size must be between 2 and {MAX_BLOCK_SIZE} ({DEFAULT_BLOCK_SIZE} is the usual choice), got {block_size}")


@dataclass
class DrafterConfig:
    # The target this drafter reads: a checkpoint is refused by a target that differs in any of these.
    target_hidden_size: int
    target_vocab_size: int
    target_num_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    # The drafter itself.
    block_size: int = DEFAULT_BLOCK_SIZE
    head: str = "domino"
    label_convention: str = "shifted"
    confidence_head: bool = False
    num_layers: int = 1
    draft_vocab_size: int = 0  # tokens the drafter scores (its most frequent in training); 0: the target's whole vocabulary
    # copy drafts from the request's own text after a repeat of its last n <= this many tokens (0: off); a decoding
    # option, not part of what was trained, so a run may resume with another value
    lookup_ngram: int = field(default=0, compare=False)
    lookup_min_ngram: int = field(default=2, compare=False)  # the shortest repeat a copy may follow
    rank: int = 256  # low rank of the head's logit residual
    gru_hidden: int = 256  # state size of the Domino GRU / DSpark RNN head
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_name: str = field(default="", compare=False)  # for messages only

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        check_block_size(self.block_size)
        if self.head not in HEAD_KINDS:
            raise DominoError(f"unknown head kind '{self.head}': choose one of {', '.join(HEAD_KINDS)}")
        if self.label_convention not in LABEL_CONVENTIONS:
            raise DominoError(f"unknown label_convention '{self.label_convention}': choose one of "
                              f"{', '.join(LABEL_CONVENTIONS)}")
        if self.num_layers < 1:
            raise DominoError(f"num_layers (draft layers) must be at least 1, got {self.num_layers}")
        if not self.target_layer_ids:
            raise DominoError("target_layer_ids is empty: the drafter needs at least one target layer")
        check_layer_ids(self.target_layer_ids, self.target_num_layers)
        if not 0 <= self.mask_token_id < self.target_vocab_size:
            raise DominoError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.target_vocab_size - 1})")
        if not (self.draft_vocab_size == 0 or 2 <= self.draft_vocab_size <= self.target_vocab_size):
            raise DominoError(f"draft_vocab_size must be 0 (the whole vocabulary) or between 2 and the target's "
                              f"{self.target_vocab_size}, got {self.draft_vocab_size}")
        if not 0 <= self.lookup_ngram <= 16:
            raise DominoError(f"lookup_ngram must be between 0 (off) and 16, got {self.lookup_ngram}")
        if self.lookup_min_ngram < 1 or (self.lookup_ngram and self.lookup_min_ngram > self.lookup_ngram):
            raise DominoError(f"lookup_min_ngram must be between 1 and lookup_ngram ({self.lookup_ngram}), "
                              f"got {self.lookup_min_ngram}")
        for name in ("rank", "gru_hidden", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise DominoError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DominoError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def hidden_size(self) -> int:
        return self.target_hidden_size

    @property
    def scored_vocab_size(self) -> int:
        """How many tokens the drafter's LM head scores."""
        return self.draft_vocab_size or self.target_vocab_size

    @property
    def silent_slots(self) -> int:
        """Block positions at the start that propose nothing: the anchor's slot in the DFlash convention."""
        return 1 if self.label_convention == "dflash" else 0

    @property
    def num_drafts(self) -> int:
        """Tokens proposed per block."""
        return self.block_size - self.silent_slots

    @classmethod
    def for_target(cls, target: "Target", num_layers: int = 1, layer_ids: list[int] | None = None,
                   **overrides) -> "DrafterConfig":
        """A drafter shaped like the target's own layers, reading `layer_ids` (negative ids count from the
        last layer, -1) or by default DFlash's choice of target layers."""
        tc = target.config
        heads = tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        defaults = dict(
            target_hidden_size=tc.hidden_size,
            target_vocab_size=target.vocab_size,
            target_num_layers=tc.num_hidden_layers,
            target_layer_ids=select_layer_ids(tc.num_hidden_layers, num_layers) if layer_ids is None
            else [i + tc.num_hidden_layers if i < 0 else i for i in layer_ids],  # -1: the last layer
            mask_token_id=default_mask_token_id(target),
            num_layers=num_layers,
            gru_hidden=max(64, tc.hidden_size // 4),
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)),
            target_name=target.name,
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise DominoError(f"unknown drafter option(s): {', '.join(sorted(unknown))}")
        return cls(**{**defaults, **overrides})

    def check_target(self, target: "Target", source: str = "this drafter") -> None:
        """Refuse a target this drafter was not made for, saying which fact differs."""
        facts = [
            ("hidden size", self.target_hidden_size, target.hidden_size),
            ("vocabulary size", self.target_vocab_size, target.vocab_size),
            ("number of layers", self.target_num_layers, target.num_layers),
        ]
        named = f" ('{self.target_name}')" if self.target_name else ""
        for what, mine, theirs in facts:
            if mine != theirs:
                raise DominoError(
                    f"{source} was made for a target with {what} {mine}{named}, but '{target.name}' has "
                    f"{theirs}: load the target it was made for, or train a drafter for this one"
                )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "DrafterConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise DominoError(f"cannot read drafter config {path}: {error}") from None
        if not isinstance(data, dict):
            raise DominoError(f"{path} holds a JSON {type(data).__name__}, not a drafter config")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise DominoError(f"{path} has unknown keys {sorted(unknown)}: it was not written by this version of domino")
        return cls.from_dict(data, f"{path} is not a valid drafter config")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> "DrafterConfig":
        """A config from a file's values, each checked against its field's type first (pydantic, leniently:
        "8" is 8, 8.5 is refused), then by __post_init__; any problem is one DominoError that begins with
        `source`."""
        try:
            return TypeAdapter(cls).validate_python(data)
        except ValidationError as error:
            problems = [(f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "") + e["msg"].removeprefix("Value error, ")
                        for e in error.errors()]
            raise DominoError(f"{source}: {'; '.join(problems)}") from None


def default_mask_token_id(target: "Target") -> int:
    """DFlash embeds MASK with the target's frozen table; any id the drafter reserves works. We take the
    tokenizer's unknown/pad token, which is never a label in chat data, else the last id."""
    tokenizer = target.tokenizer
    candidates = () if tokenizer is None else (tokenizer.unk_token_id, tokenizer.pad_token_id)
    for candidate in candidates:
        if candidate is not None and candidate < target.vocab_size:
            return int(candidate)
    return target.vocab_size - 1
