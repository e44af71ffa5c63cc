"""Tiny random targets and drafters for tests: small enough to run hundreds of forwards in seconds."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from domino.config import DrafterConfig
from domino.drafter import Drafter
from domino.target import Target


def tiny_target(seed: int = 0, vocab_size: int = 96, hidden_size: int = 64, num_layers: int = 6,
                init_std: float = 0.02, layer_scale: float = 1.0) -> Target:
    """A random Llama. `layer_scale` < 1 weakens every layer's output, so that the next token depends
    mostly on the last few tokens: a target whose continuations a tiny drafter can learn quickly."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=init_std,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    return Target(model, tokenizer=None, name=f"tiny-{seed}")


def tiny_drafter(target: Target, seed: int = 0, randomize_heads: bool = True, **overrides) -> Drafter:
    """A random drafter; with `randomize_heads` the zero-initialised head outputs get random weights too,
    so tests see heads that really change the logits."""
    options = dict(num_layers=2, block_size=8, rank=16, gru_hidden=32, intermediate_size=128)
    options.update(overrides)
    config = DrafterConfig.for_target(target, **options)
    torch.manual_seed(seed)
    drafter = Drafter(config, target.embed_tokens, target.lm_head)
    if randomize_heads and drafter.head is not None:
        torch.nn.init.normal_(drafter.head.out.weight, std=0.5)
    return drafter.eval()


def greedy_continuations(target: Target, count: int, seed: int, new_tokens: int = 40, prompt: int = 8) -> torch.Tensor:
    """`count` random prompts of `prompt` tokens, each followed by the target's greedy continuation."""
    prompts = torch.randint(0, target.vocab_size, (count, prompt), generator=torch.Generator().manual_seed(seed))
    return target.model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def training_batches(target: Target, drafter: Drafter, data: torch.Tensor, size: int, seed: int, prompt: int = 8):
    """Endless batches for DraftingObjective drawn from `data`, training every token after the prompt."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        ids = data[torch.randint(0, data.shape[0], (size,), generator=generator)]
        loss_mask = torch.zeros_like(ids, dtype=torch.bool)
        loss_mask[:, prompt:] = True
        yield dict(input_ids=ids, loss_mask=loss_mask, lengths=torch.full((size,), ids.shape[1]),
                   features=target.forward(ids, layer_ids=drafter.config.target_layer_ids).features)
