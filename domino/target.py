"""The frozen target model: loading any Hugging Face causal LM (or the embedded default, embedded.py),
and a forward that returns the logits together with the hidden states of the layers the drafter reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import TemplateError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as transformers_logging

from domino.config import check_layer_ids
from domino.embedded import EMBEDDED_TARGETS, convert_embedded
from domino.errors import DominoError
from domino.formats import check_safetensors
from domino.packed_linear import pack_linear_layers

DEFAULT_TARGET = "smollm2-135m"


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Transformers' "Loading weights" bar takes a fraction of a second here and leaves a redrawn line
    in every log it reaches (Serve replicas, benchmarks, `python -m domino generate`)."""
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


COMPUTE_DTYPES = ("float32", "bfloat16")  # what training may compute in, by torch's names


def training_dtype(name: str, device: str | torch.device) -> str:
    """The dtype training computes in on `device`: feature extraction and the drafter's steps (never
    serving, whose target is the one verified against). "auto" is bfloat16 where the hardware computes
    it natively: CUDA GPUs, and CPUs with AMX tiles or AVX-512 BF16 instructions (there the same held-out
    tau takes 2.2x and 1.6x fewer CPU minutes, docs/benchmarks.md); float32 elsewhere, where bfloat16
    products are emulated."""
    if name != "auto":
        return name
    native = (torch.device(device).type == "cuda" or torch.cpu._is_amx_tile_supported()
              or torch.cpu._is_avx512_bf16_supported())
    return "bfloat16" if native else "float32"


def resolve_target(name_or_path: str) -> str:
    """Turn a target name into something `from_pretrained` accepts, with a clear error when it cannot."""
    if name_or_path in EMBEDDED_TARGETS:
        return str(convert_embedded(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise DominoError(f"{path} has no config.json: pass a Hugging Face model folder (save_pretrained output)")
        return str(path)
    looks_like_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if looks_like_hub_id:
        return name_or_path
    raise DominoError(
        f"target '{name_or_path}' not found: pass a local model folder, a hub id (org/name, needs network), "
        f"or the embedded default '{DEFAULT_TARGET}'"
    )


def causal_lm_config(path: str, name: str):
    """The config of the model at `path` (resolve_target's answer for `name`), refused with a clear error
    when it cannot be read or is not a decoder-only language model."""
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as error:
        raise DominoError(f"cannot read the model config of '{name}': {error}") from None
    except ValueError:  # a config.json without a model_type transformers knows: a drafter checkpoint, say
        raise DominoError(f"'{name}' is not a Hugging Face model: its config.json names no model_type that "
                          f"transformers knows (a drafter checkpoint is passed as the drafter)") from None
    check_causal_lm(config)
    return config


def check_causal_lm(config) -> None:
    if config.is_encoder_decoder or getattr(config, "is_decoder", None) is False:
        raise DominoError(
            f"'{config.model_type}' is not a decoder-only model: speculative decoding here needs a causal LM "
            f"such as Llama, Qwen or Mistral"
        )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise DominoError(f"'{config.model_type}' has no causal-LM head in transformers: pick a decoder-only model")


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (batch, tokens, vocab); None from `features`
    features: torch.Tensor | None  # (batch, tokens, n_layers * hidden): the chosen layers, concatenated
    final_hidden: torch.Tensor | None  # (batch, tokens, hidden): the LM head's input


class Target:
    """A frozen causal LM with its tokenizer, used for prefill, verification and feature extraction."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, name: str):
        self.model = model.eval().requires_grad_(False)
        pack_linear_layers(model)  # frozen, so on a CPU in float32 its weights can be laid out for oneDNN once
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config

    @classmethod
    def load(cls, name_or_path: str = DEFAULT_TARGET, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> "Target":
        resolved = resolve_target(name_or_path)
        causal_lm_config(resolved, name_or_path)
        if dtype is None:
            dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        with no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(resolved, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(resolved)
        return cls(model, tokenizer, name_or_path)

    @classmethod
    def shape_only(cls, name_or_path: str = DEFAULT_TARGET) -> "Target":
        """The target's config and tokenizer, its weights left on the meta device: enough to size or check a
        drafter where the model itself is not needed (the training job's driver, Serve's application builder).
        A local model's safetensors files are checked by their headers, so a damaged one is named here."""
        resolved = resolve_target(name_or_path)
        config = causal_lm_config(resolved, name_or_path)
        if Path(resolved).is_dir():
            check_safetensors(Path(resolved))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls(model, AutoTokenizer.from_pretrained(resolved), name_or_path)

    # -- shape facts the drafter is built from -------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The model's list of decoder layers (`layers` in Llama's kin, `h` in GPT-2's)."""
        for module in self.model.base_model.children():
            if isinstance(module, nn.ModuleList) and len(module) == self.num_layers:
                return module
        raise DominoError(f"target '{self.name}' has no list of {self.num_layers} decoder layers to read features from")

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        """A linear layer (packed on a CPU, packed_linear.py), with the dense `weight` it computes."""
        return self.model.get_output_embeddings()

    @property
    def max_length(self) -> int:
        return getattr(self.config, "max_position_embeddings", None) or 2**31

    @property
    def stop_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def check_batchable(self) -> None:
        """Refuse targets the batched engine would decode wrongly: its caches keep every slot of every
        layer (sliding-window, chunked, linear-attention and shared-KV layers drop or never hold
        them), and a row's positions must not change another row's rotary scaling (dynamic NTK)."""
        text_config = self.config.get_text_config(decoder=True)
        kinds = get_layer_types_and_kwargs(text_config)[0]
        for i, kind in enumerate(kinds):
            if kind != "full_attention":
                raise DominoError(f"target '{self.name}' layer {i} is '{kind}': only targets with full attention "
                                  f"in every layer are supported (its cache must keep every slot)")
        rope = getattr(text_config, "rope_parameters", None) or {}
        for params in ([rope] if "rope_type" in rope else rope.values()):
            if isinstance(params, dict) and params.get("rope_type") == "dynamic":
                raise DominoError(f"target '{self.name}' uses dynamic NTK RoPE scaling, which rescales every row of "
                                  f"a batch by its longest: not supported")

    # -- running it ----------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def synchronize(self) -> None:
        """Wait for the device's queued work, so that a clock read afterwards times it (CUDA runs
        asynchronously; on a CPU this does nothing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache | None = None,
                layer_ids: list[int] | tuple[int, ...] = (), final_hidden: bool = False,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, last_logits_only: bool = False) -> TargetOutput:
        """Run the target on `input_ids` (appending to `cache` when given).

        `layer_ids` selects which layers' outputs come back as `features` (0-based layer index);
        `final_hidden` also returns the normalised last hidden state that feeds the LM head;
        `last_logits_only` runs the LM head on the last position only (a prefill needs no more)."""
        check_layer_ids(list(layer_ids), self.num_layers)
        with self._layer_outputs(layer_ids, final_hidden) as taken:
            out = self.model(input_ids=input_ids, cache=cache, use_cache=cache is not None,
                             attention_mask=attention_mask, position_ids=position_ids,
                             logits_to_keep=1 if last_logits_only else 0)
        return TargetOutput(out.logits, *taken())

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, layer_ids: list[int] | tuple[int, ...], final_hidden: bool = False,
                 attention_mask: torch.Tensor | None = None) -> TargetOutput:
        """`forward`'s features without the logits, for training: the LM head and every layer after the
        deepest chosen one would be wasted work there (with DFlash's middle layer, half the target).
        The layers past that depth are switched off for this call only (in models that run
        `layers[:num_hidden_layers]`, as Llama's kin do), so it is not for a target that another
        thread is running at the same time."""
        check_layer_ids(list(layer_ids), self.num_layers)
        base = self.model.base_model  # the model without its LM head
        depth = self.config.num_hidden_layers
        with self._layer_outputs(layer_ids, final_hidden) as taken:
            if not final_hidden and isinstance(getattr(base, "layers", None), nn.ModuleList):
                self.config.num_hidden_layers = max(layer_ids) + 1
            try:
                base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            finally:
                self.config.num_hidden_layers = depth
        return TargetOutput(None, *taken())

    @contextmanager
    def _layer_outputs(self, layer_ids, final_hidden: bool) -> Iterator[Callable[[], tuple]]:
        """Hooks that keep the chosen layers' outputs while the model runs; yields a function that
        returns (features, final hidden state) as Hugging Face's `hidden_states` would hold them:
        layer i's output, but the last layer's after the final norm (the base model's own output,
        the LM head's input). Cheaper than `output_hidden_states`, which made a 32-row decode step
        about 2 % slower on CPU (docs/benchmarks.md, batched decoding)."""
        outputs: dict[int, torch.Tensor] = {}
        last = self.num_layers - 1

        def keep(key: int):
            def hook(module, args, output):
                outputs[key] = output[0] if isinstance(output, tuple) else output
            return hook

        def keep_final(module, args, output):
            outputs[last] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        inside = set(layer_ids) - {last}  # read from their decoder layers
        layers = self.decoder_layers if inside else None
        hooks = [layers[i].register_forward_hook(keep(i)) for i in inside]
        if final_hidden or last in layer_ids:
            hooks.append(self.model.base_model.register_forward_hook(keep_final))
        try:
            yield lambda: (torch.cat([outputs[i] for i in layer_ids], dim=-1) if layer_ids else None,
                           outputs[last] if final_hidden else None)
        finally:
            for hook in hooks:
                hook.remove()

    # -- text ----------------------------------------------------------------------------------
    @property
    def is_chat_model(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str | list[dict], chat: bool | None = None) -> list[int]:
        """Token ids for a prompt string or a list of chat messages; chat templating by default for
        chat models. A list of messages always goes through the chat template."""
        if self.tokenizer is None:
            raise DominoError(f"target '{self.name}' has no tokenizer: pass token ids")
        if isinstance(prompt, list) or (chat if chat is not None else self.is_chat_model):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if not self.is_chat_model:
                raise DominoError(f"target '{self.name}' has no chat template: pass a plain prompt (--no-chat)")
            try:
                encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except TemplateError as error:  # templates refuse what their model was not trained on (raise_exception)
                raise DominoError(f"the chat template of '{self.name}' refuses these messages: {error}") from None
            return list(encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded)
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:  # text that tokenises to nothing (a lone control character) starts from the start token,
            start = self.tokenizer.bos_token_id  # as OpenAI's completions start an empty prompt
            start = self.tokenizer.eos_token_id if start is None else start
            ids = [] if start is None else [start]
        return ids
