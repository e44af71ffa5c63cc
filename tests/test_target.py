import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn
from transformers import BertConfig, T5Config

from domino.config import check_layer_ids, select_layer_ids
from domino.errors import DominoError
from domino.packed_linear import PackedLinear, pack_linear_layers, unpack_linear_layers
from domino.target import Target, resolve_target
from helpers import tiny_target


def test_layer_selection_follows_dflash_rule():
    assert select_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert select_layer_ids(36, 1) == [18]
    assert select_layer_ids(30, 3) == [1, 14, 27]
    with pytest.raises(DominoError, match="at least 1"):
        select_layer_ids(36, 0)


def test_layer_id_out_of_range_names_the_valid_range():
    with pytest.raises(DominoError, match=r"layer id 30 is out of range.*valid ids 0..29"):
        check_layer_ids([1, 30], 30)
    target = tiny_target()
    with pytest.raises(DominoError, match="out of range"):
        target.forward(torch.tensor([[1, 2]]), layer_ids=[6])


def test_missing_and_malformed_paths_are_clear(tmp_path):
    with pytest.raises(DominoError, match="not found.*smollm2-135m"):
        resolve_target(str(tmp_path / "nope"))
    with pytest.raises(DominoError, match="no config.json"):
        resolve_target(str(tmp_path))
    (tmp_path / "config.json").write_text('{"target_hidden_size": 64, "block_size": 8}')  # a drafter's
    with pytest.raises(DominoError, match="is not a Hugging Face model: its config.json names no model_type"):
        Target.load(str(tmp_path))


@pytest.mark.parametrize("config", [T5Config(num_layers=1, d_model=8, d_ff=8, num_heads=1, d_kv=8),
                                    BertConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=8,
                                               num_attention_heads=1)])
def test_non_decoder_models_are_refused(tmp_path, config):
    config.save_pretrained(tmp_path)
    with pytest.raises(DominoError, match="not a decoder-only model"):
        Target.load(str(tmp_path))


def chosen_layers(hidden_states: tuple[torch.Tensor, ...], layer_ids, final_hidden: bool):
    """The reference: (features, final hidden state) from Hugging Face's `hidden_states`, where entry
    i + 1 is layer i's output and the last entry has the final norm applied (DFlash reads them so)."""
    features = torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1) if layer_ids else None
    return features, hidden_states[-1] if final_hidden else None


def test_features_are_the_chosen_layer_outputs_and_cache_is_consistent():
    target = tiny_target()
    ids = torch.randint(0, 96, (1, 12))
    full = target.forward(ids, layer_ids=[1, 3], final_hidden=True)
    reference = target.model(ids, output_hidden_states=True)
    assert torch.equal(full.features, torch.cat([reference.hidden_states[2], reference.hidden_states[4]], -1))
    assert torch.allclose(target.lm_head(full.final_hidden), full.logits, atol=1e-5)
    hooked = target.forward(ids, layer_ids=[3, 1])  # in any order, and without the final hidden state
    assert torch.equal(hooked.features, torch.cat([reference.hidden_states[4], reference.hidden_states[2]], -1))
    assert torch.equal(hooked.logits, full.logits)
    last = target.forward(ids, layer_ids=[5, 1])  # the last layer's output comes after the final norm
    assert torch.equal(last.features, torch.cat([reference.hidden_states[6], reference.hidden_states[2]], -1))
    # prefill + incremental steps give the same logits and features as one full pass
    cache = target.new_cache()
    first = target.forward(ids[:, :7], cache, layer_ids=[1, 3])
    rest = target.forward(ids[:, 7:], cache, layer_ids=[1, 3])
    assert torch.allclose(torch.cat([first.logits, rest.logits], 1), full.logits, atol=1e-5)
    assert torch.allclose(torch.cat([first.features, rest.features], 1), full.features, atol=1e-5)


def test_training_features_equal_forward_and_skip_the_layers_past_the_deepest():
    target = tiny_target()  # 6 layers
    ids = torch.randint(0, 96, (2, 10))
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0  # a right-padded row, as the feature actors batch them
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(target.model.model.layers)]
    hooks.append(target.lm_head.register_forward_hook(lambda m, a, o: ran.append("lm_head")))
    for layer_ids, final_hidden in [([3, 1], False), ([2], False), ([1, 5], False), ([2], True)]:
        ran.clear()
        out = target.features(ids, layer_ids, final_hidden=final_hidden, attention_mask=attention)
        deepest = 5 if final_hidden or 5 in layer_ids else max(layer_ids)
        assert ran == list(range(deepest + 1))  # in order, once each, and never the LM head
        hidden = target.model(ids, attention_mask=attention, output_hidden_states=True).hidden_states
        features, last = chosen_layers(hidden, layer_ids, final_hidden)
        assert out.logits is None and torch.equal(out.features, features)
        assert (out.final_hidden is None) == (not final_hidden)
        if final_hidden:
            assert torch.equal(out.final_hidden, last)
        assert target.num_layers == 6
    for hook in hooks:
        hook.remove()
    with pytest.raises(DominoError, match="out of range"):
        target.features(ids, [6])


def test_interrupted_conversion_leaves_no_cache(tmp_path):
    """Kill a conversion mid-way: the cache folder must not exist, so the next run converts afresh."""
    env = {**os.environ, "DOMINO_CACHE": str(tmp_path)}
    code = "from domino.embedded import convert_embedded; convert_embedded('smollm2-135m')"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".smollm2") for p in tmp_path.iterdir()):
        time.sleep(0.2)
    time.sleep(2)  # well inside the GGUF read
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "smollm2-135m").exists()


def test_embedded_target_loads_and_chats(embedded_target):
    target = embedded_target
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    ids = target.encode_prompt("What is 2+2?")
    assert ids[:2] == target.tokenizer("<|im_start|>system")["input_ids"][:2]
    assert target.stop_token_ids == [target.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_loading_a_target_draws_no_progress_bar(capfd):
    Target.load("smollm2-135m")
    assert "Loading weights" not in capfd.readouterr().err


def test_text_that_tokenises_to_nothing_starts_from_the_start_token(embedded_target):
    """A non-empty prompt can tokenise to no ids (a lone control character); the server's schema accepts
    it, so it must not fail as an empty prompt: it starts from the start token, as OpenAI's API does."""
    tokenizer = embedded_target.tokenizer
    assert tokenizer("\u0016", add_special_tokens=True)["input_ids"] == []
    assert embedded_target.encode_prompt("\u0016", chat=False) == [tokenizer.bos_token_id]
    assert embedded_target.encode_prompt("Hello", chat=False) == tokenizer("Hello")["input_ids"]


def test_a_chat_template_that_refuses_the_messages_raises_a_clear_error(embedded_target):
    """Templates refuse roles or orders their model was not trained on (Gemma's has no system role):
    that is the caller's input, a DominoError naming the template's reason, not a crash."""
    tokenizer = copy.deepcopy(embedded_target.tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    target = Target(tiny_target().model, tokenizer, "no-system")
    assert target.encode_prompt([{"role": "user", "content": "hi"}])
    with pytest.raises(DominoError, match="chat template of 'no-system' refuses these messages: System role not supported"):
        target.encode_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_layers_compute_what_their_dense_weights_do(bias):
    torch.manual_seed(0)
    dense = nn.Linear(64, 48, bias=bias)
    packed = PackedLinear(dense)
    with torch.no_grad():
        for rows in (1, 2, 9, 17):
            x = torch.randn(2, rows, 64)
            assert torch.allclose(packed(x), dense(x), atol=1e-5)
            assert torch.allclose(packed(x.transpose(0, 1)), dense(x.transpose(0, 1)), atol=1e-5)  # strided input
    x = torch.randn(3, 64, requires_grad=True)  # training through a target's LM head: the dense weight's backward
    packed(x).square().sum().backward()
    assert torch.allclose(x.grad, 2 * dense(x).detach() @ dense.weight.detach(), atol=1e-5)


def test_a_float32_target_on_a_cpu_runs_packed_layers_and_keeps_its_tied_weights(embedded_target):
    model = embedded_target.model
    assert not [name for name, module in model.named_modules() if type(module) is nn.Linear]
    assert isinstance(embedded_target.lm_head, PackedLinear)
    assert embedded_target.lm_head.weight is embedded_target.embed_tokens.weight  # still tied, not copied
    assert pack_linear_layers(tiny_target().model.to(torch.bfloat16)) == 0  # bf16: left dense


def test_unpacking_gives_back_dense_layers_over_the_same_weights():
    target = tiny_target()
    ids = torch.randint(0, 96, (2, 9))
    packed_logits = target.forward(ids).logits
    weights = {name: module.weight for name, module in target.model.named_modules() if isinstance(module, PackedLinear)}
    assert unpack_linear_layers(target.model) == len(weights) == 6 * 7 + 1  # q k v o gate up down per layer, the head
    dense = dict(target.model.named_modules())
    assert all(type(dense[name]) is nn.Linear and dense[name].weight is weight for name, weight in weights.items())
    assert torch.allclose(target.forward(ids).logits, packed_logits, atol=1e-5)


def test_a_packed_layer_follows_its_weight_when_it_is_changed_or_cast():
    torch.manual_seed(0)
    dense = nn.Linear(16, 8)
    packed = PackedLinear(dense)
    x = torch.randn(3, 16)
    with torch.no_grad():
        dense.weight.mul_(2)  # in place, after packing
        assert torch.allclose(packed(x), dense(x), atol=1e-5)
        packed.double(), dense.double()  # cast, as the exactness tests cast their targets
        assert torch.allclose(packed(x.double()), dense(x.double()))
