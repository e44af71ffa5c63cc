"""Checkpoint formats of the ecosystem (DESIGN §10): our own, and DFlash drafters as they are published
(z-lab's `DFlashDraftModel`, vLLM `method: dflash`, SGLang `--speculative-algorithm DFLASH`, and SGLang's
Domino format, `projector_type: domino`), read here; domino/export.py writes ours in the latter two.

A DFlash checkpoint is a Qwen3-style config plus `dflash_config`, and weights named after Qwen3's
modules. Our backbone is the same network under other names, so conversion is a renaming plus a
config translation; whatever either side has that the other cannot express is refused, by name.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from domino.config import DrafterConfig, select_layer_ids
from domino.errors import DominoError

if TYPE_CHECKING:
    from domino.target import Target

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFTER_DIR = "drafter"  # the subfolder of a training checkpoint that holds its drafter
SHARD_INDEX_NAME = "model.safetensors.index.json"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_REQUIRED = ("hidden_size", "vocab_size", "num_target_layers", "num_hidden_layers", "num_attention_heads",
                   "intermediate_size")

# Per draft layer: our parameter name -> DFlash's (Qwen3's module names).
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "gate.weight": "mlp.gate_proj.weight",
    "up.weight": "mlp.up_proj.weight",
    "down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"fc.weight": "fc.weight", "feature_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
# SGLang's Domino head: W1 and W2 around a SiLU are `embed_proj.0` and `embed_proj.2`.
SGLANG_HEAD_NAMES = {
    "head.gru.weight_ih_l0": "prefix_gru.weight_ih_l0",
    "head.gru.weight_hh_l0": "prefix_gru.weight_hh_l0",
    "head.proj.weight": "embed_proj.0.weight",
    "head.out.weight": "embed_proj.2.weight",
}


def to_dflash_name(name: str) -> str:
    """Our parameter name -> its DFlash / SGLang name (KeyError for one the formats have no place for)."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return f"layers.{index}.{LAYER_NAMES[rest]}"
    return {**TOP_NAMES, **SGLANG_HEAD_NAMES}[name]


FROM_DFLASH = {**{v: k for k, v in TOP_NAMES.items()}, **{v: k for k, v in SGLANG_HEAD_NAMES.items()}}
FROM_DFLASH_LAYER = {v: k for k, v in LAYER_NAMES.items()}


def from_dflash_name(name: str) -> str | None:
    """A DFlash / SGLang parameter name -> ours, or None when we have no such parameter."""
    if name.startswith("layers."):
        parts = name.split(".", 2)
        rest = FROM_DFLASH_LAYER.get(parts[2]) if len(parts) == 3 and parts[1].isdigit() else None
        return None if rest is None else f"layers.{parts[1]}.{rest}"
    return FROM_DFLASH.get(name)


# -- reading -------------------------------------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DominoError(f"cannot read {path}: {error}") from None
    if not isinstance(value, dict):
        raise DominoError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError) as error:
        raise unreadable(path, error) from None


def check_safetensors(folder: Path) -> None:
    """Open every safetensors file in `folder` by its header alone (mapped, not read), which names a file
    cut short or corrupt, so that it is refused where a job starts rather than where the weights load."""
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except (OSError, SafetensorError) as error:
            raise unreadable(path, error) from None


def unreadable(path: Path, error: Exception) -> DominoError:
    return DominoError(f"cannot read {path}, the checkpoint is incomplete or corrupt: {error}")


def checkpoint_format(path: Path) -> str:
    """'domino' or 'dflash' for a checkpoint folder; anything else is refused in one line."""
    if not (path / CONFIG_NAME).is_file():
        if (path / DRAFTER_DIR / CONFIG_NAME).is_file():
            raise DominoError(f"no drafter checkpoint at {path}: it is a training checkpoint; its drafter is "
                              f"{path / DRAFTER_DIR}")
        raise DominoError(
            f"no drafter checkpoint at {path}: pass the folder written by training (it holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}) or a DFlash drafter folder")
    config = read_json(path / CONFIG_NAME)
    if "target_hidden_size" in config:
        return "domino"
    architectures = config.get("architectures") or []
    if DFLASH_ARCHITECTURE in architectures:
        return "dflash"
    if any(str(a).startswith("DFlash") for a in architectures):
        raise DominoError(f"{path} holds a {architectures[0]}: only {DFLASH_ARCHITECTURE} is supported "
                          f"(DFlash 2's candidate selector and convolutions are not)")
    raise DominoError(f"{path} holds neither a domino drafter nor a DFlash one: its {CONFIG_NAME} has no "
                      f"target_hidden_size and its architectures are {architectures or 'not given'}")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or every shard a model.safetensors.index.json lists."""
    if (path / WEIGHTS_NAME).is_file():
        return read_safetensors(path / WEIGHTS_NAME)
    if (path / SHARD_INDEX_NAME).is_file():
        shards = sorted(set(read_json(path / SHARD_INDEX_NAME).get("weight_map", {}).values()))
        return {name: tensor for shard in shards for name, tensor in read_safetensors(path / shard).items()}
    raise DominoError(f"{path} has no {WEIGHTS_NAME}: the checkpoint is incomplete")


def read_checkpoint(path: str | Path, target: "Target") -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The drafter config and our-named weights of a domino or DFlash checkpoint folder for `target`,
    refused if made for another target."""
    path = Path(path)
    if checkpoint_format(path) == "domino":
        config = DrafterConfig.load(path / CONFIG_NAME)
        config.check_target(target)
        return config, read_weights(path)
    try:
        config = dflash_config(read_json(path / CONFIG_NAME), path, target)
    except DominoError:
        raise
    except (TypeError, ValueError, AttributeError) as error:  # a value of the wrong type, met while reading it
        raise DominoError(f"the DFlash config at {path} has a value of the wrong type ({error})") from None
    return config, dflash_weights(read_weights(path), path)


def dflash_value(config: dict, name: str, default: Any = None) -> Any:
    """A DFlash option: `dflash_config` first, then the top level (the order z-lab's loader reads)."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def refuse_unsupported(config: dict, path: Path) -> None:
    """Name the first thing in a DFlash config that our drafter cannot reproduce exactly."""
    layer_types = config.get("layer_types") or []
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    projector = dflash_value(config, "projector_type")
    problems = [
        ("sliding_attention" in layer_types or config.get("use_sliding_window"),
         "sliding-window layers (domino's draft layers attend to the whole context)"),
        (config.get("attention_bias") or config.get("mlp_bias"), "attention or MLP biases"),
        (config.get("hidden_act", "silu") != "silu", f"the activation {config.get('hidden_act')!r} (only silu)"),
        (config.get("is_causal"), "a causal mask inside the draft block"),
        (rope.get("rope_type", rope.get("type", "default")) != "default",
         f"rope scaling {rope.get('rope_type', rope.get('type'))!r} (only default rotary embeddings)"),
        (projector not in (None, "domino"), f"the projector_type {projector!r} (only none or domino)"),
        (projector == "domino" and dflash_value(config, "pure_draft_prefix_len", 1) != 1,
         "a Domino head whose pure_draft_prefix_len is not 1"),
        (projector == "domino" and None in (dflash_value(config, "emb_dim"), dflash_value(config, "gru_hidden_dim")),
         "a Domino head without emb_dim or gru_hidden_dim"),
        (float(dflash_value(config, "input_embedding_scale", 1.0)) != 1.0, "input_embedding_scale"),
        (float(dflash_value(config, "output_multiplier", 1.0)) != 1.0, "output_multiplier"),
        (float(dflash_value(config, "final_logit_softcapping", 0) or 0) > 0, "final_logit_softcapping"),
        (dflash_value(config, "mask_token_id") is None, "no dflash_config.mask_token_id"),
    ]
    for present, what in problems:
        if present:
            raise DominoError(f"the DFlash drafter at {path} has {what}: domino cannot serve it as it is")


def dflash_config(config: dict, path: Path, target: "Target") -> DrafterConfig:
    """Our config for a DFlash (or SGLang Domino) checkpoint's config.json."""
    missing = [name for name in DFLASH_REQUIRED if name not in config]
    if missing:
        raise DominoError(f"the DFlash config at {path} lacks {', '.join(missing)}: it is not a complete checkpoint")
    refuse_unsupported(config, path)
    layer_ids = dflash_value(config, "target_layer_ids")
    if layer_ids is None:  # z-lab's loader derives them from the two depths
        layer_ids = select_layer_ids(config["num_target_layers"], config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    domino = dflash_value(config, "projector_type") == "domino"
    options = dict(
        target_hidden_size=config["hidden_size"], target_vocab_size=config["vocab_size"],
        target_num_layers=config["num_target_layers"], target_layer_ids=layer_ids,
        mask_token_id=int(dflash_value(config, "mask_token_id")),
        block_size=int(dflash_value(config, "block_size", 16)),
        head="sglang-domino" if domino else "none",
        label_convention="shifted" if dflash_value(config, "shift_label", False) else "dflash",
        num_layers=config["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
    )
    if domino:
        options.update(rank=int(dflash_value(config, "emb_dim")),
                       gru_hidden=int(dflash_value(config, "gru_hidden_dim")))
    drafter = DrafterConfig.from_dict(options, f"the DFlash config at {path} describes no drafter domino can build")
    drafter.check_target(target, f"the DFlash drafter at {path}")
    return replace(drafter, target_name=target.name)  # DFlash configs do not name their target


def dflash_weights(weights: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Rename a DFlash checkpoint's weights to ours, refusing any we have no place for."""
    renamed, unknown = {}, []
    for name, tensor in weights.items():
        ours = from_dflash_name(name)
        if ours is None:
            unknown.append(name)
        else:
            renamed[ours] = tensor
    if unknown:
        what = "a learned mask embedding" if any("mask" in n or "embed_tokens" in n for n in unknown) else \
            "weights domino has no place for"
        shown = ", ".join(sorted(unknown)[:3]) + (" ..." if len(unknown) > 3 else "")
        raise DominoError(f"the DFlash drafter at {path} has {what} ({shown}): domino cannot serve it as it is")
    return renamed
