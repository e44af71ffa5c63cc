"""Small inputs for the pipeline tests: a tiny chat target on disk and conversation files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from domino.embedded import cache_dir


def save_tiny_chat_target(folder: Path, seed: int = 0) -> Path:
    """A random 6-layer Llama (hidden 32) with the embedded target's tokenizer and chat template:
    the pipeline needs a real chat template, and 49k vocabulary rows of 32 are still small."""
    tokenizer = AutoTokenizer.from_pretrained(cache_dir() / "smollm2-135m")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def conversation(i: int, style: str = "sharegpt") -> dict:
    turns = [("user", f"Question {i}: what is {i} plus {i}?"), ("assistant", f"{i} plus {i} is {2 * i}."),
             ("user", "And times two?"), ("assistant", f"{i} times two is {2 * i}, the same.")]
    if style == "sharegpt":
        return {"conversations": [{"from": "human" if r == "user" else "gpt", "value": t} for r, t in turns]}
    return {"messages": [{"role": r, "content": t} for r, t in turns]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path
