"""Writing our drafters in other engines' formats: DFlash's (z-lab's `DFlashDraftModel`, vLLM `method:
dflash`, SGLang `--speculative-algorithm DFLASH`) and SGLang's Domino head (`projector_type: domino`). The
weights are renamed (domino.formats owns the names) and the config translated; a drafter a format cannot
express is refused with every reason, and an export is written whole or not at all.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.errors import DominoError
from domino.formats import (CONFIG_NAME, DFLASH_ARCHITECTURE, WEIGHTS_NAME, checkpoint_format, read_weights,
                            to_dflash_name)

FORMATS = ("dflash", "sglang-domino")
MAX_POSITIONS = 131072  # written for engines that read it; default rotary embeddings do not depend on it


def export(drafter_path: str | Path, fmt: str, out: str | Path) -> Path:
    """Write the domino drafter at `drafter_path` in `fmt` ('dflash' or 'sglang-domino') to `out`, a new
    or empty folder. Everything is checked before anything is written, and the files are written to a
    temporary folder beside `out` that becomes `out` only once whole."""
    drafter_path, out = Path(drafter_path).expanduser(), Path(out).expanduser()
    if fmt not in FORMATS:
        raise DominoError(f"unknown export format '{fmt}': choose one of {', '.join(FORMATS)}")
    if checkpoint_format(drafter_path) != "domino":
        raise DominoError(f"{drafter_path} is already a DFlash checkpoint: export converts domino drafters")
    config = DrafterConfig.load(drafter_path / CONFIG_NAME)
    refuse_unexpressible(config, fmt)
    weights = read_weights(drafter_path)
    check_weights(weights, config, drafter_path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never over the checkpoint it reads, or others
        raise DominoError(f"--out {out} is {'not empty' if out.is_dir() else 'a file'}: export into a new folder")
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    partial = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        (partial / CONFIG_NAME).write_text(json.dumps(exported_config(config, fmt, dtype), indent=2) + "\n")
        save_file({to_dflash_name(k): v.contiguous() for k, v in weights.items()}, partial / WEIGHTS_NAME,
                  metadata={"format": "pt"})
        partial.chmod(0o755)  # mkdtemp's folder is private; an export is read by other engines and users
        partial.replace(out)  # onto a missing or empty folder
    except (OSError, SafetensorError) as error:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        raise DominoError(f"cannot write {out}: {getattr(error, 'strerror', None) or error}") from None
    return out


def check_weights(weights: dict[str, torch.Tensor], config: DrafterConfig, path: Path) -> None:
    """Refuse weights that are not the ones `config` describes (names and shapes), as loading would: a
    drafter built on the meta device stands for the config, with no memory and no target."""
    with torch.device("meta"):
        expected = Drafter(config, nn.Embedding(config.target_vocab_size, config.hidden_size),
                           nn.Linear(config.hidden_size, config.target_vocab_size, bias=False)).state_dict()
    problems = [f"missing {name}" for name in sorted(set(expected) - set(weights))]
    problems += [f"unexpected {name}" for name in sorted(set(weights) - set(expected))]
    problems += [f"{name} is {tuple(weights[name].shape)}, not {tuple(tensor.shape)}"
                 for name, tensor in expected.items() if name in weights and weights[name].shape != tensor.shape]
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise DominoError(f"the weights in {path} do not match its config: {shown}")


def refuse_unexpressible(config: DrafterConfig, fmt: str) -> None:
    """Refuse a drafter whose shape `fmt` cannot express, naming every reason at once with the training
    key that changes it (each is a retrain)."""
    reasons = []
    if config.confidence_head:
        reasons.append(f"the {fmt} format has no confidence head (train with confidence_head false)")
    if config.draft_vocab_size:
        reasons.append(f"the {fmt} format scores the target's whole vocabulary, and this drafter scores "
                       f"{config.draft_vocab_size} tokens of it (train with draft_vocab_size 0)")
    if fmt == "dflash":
        if config.label_convention != "dflash":
            reasons.append("DFlash checkpoints use DFlash's labels, where the anchor's slot proposes nothing (train "
                           "with label_convention dflash, or export with --format sglang-domino)")
        if config.head != "none":
            reasons.append(f"DFlash checkpoints have no sequential head, and this drafter's '{config.head}' head "
                           f"shapes its drafts (train with head none, or export with --format sglang-domino)")
    else:
        if config.head != "sglang-domino":
            reasons.append(f"SGLang's Domino head is a bias-free GRU primed with the anchor; this drafter's "
                           f"'{config.head}' head is not it (train with head sglang-domino)")
        if config.label_convention != "shifted":
            reasons.append("SGLang's Domino path takes shifted labels only, shift_label true (train with "
                           "label_convention shifted)")
    if reasons:
        raise DominoError(f"cannot export this drafter as {fmt}: " + "; ".join(reasons))


def lost_in_export(config: DrafterConfig) -> list[str]:
    """What an exported drafter keeps no trace of, for the user to know before serving it elsewhere."""
    if not config.lookup_ngram:
        return []
    return [f"context lookup (lookup_ngram {config.lookup_ngram}) is domino's own: an engine serving the export "
            f"drafts without copies from the text"]


def exported_config(config: DrafterConfig, fmt: str, dtype: str) -> dict[str, Any]:
    """A Qwen3-style config.json that z-lab's DFlashDraftModel, vLLM and SGLang read."""
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if fmt == "sglang-domino":
        dflash.update(projector_type="domino", shift_label=True, pure_draft_prefix_len=1,
                      gru_hidden_dim=config.gru_hidden, emb_dim=config.rank)
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * config.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "vocab_size": config.target_vocab_size,
        "block_size": config.block_size,
        "num_target_layers": config.target_num_layers,
        "dflash_config": dflash,
        "dtype": dtype,
    }
