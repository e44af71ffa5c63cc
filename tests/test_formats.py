"""DFlash and SGLang-Domino checkpoints in and out, with z-lab's `dflash` package (PyPI, --no-deps) as the
oracle: its DFlashDraftModel loads what we export, we load what it saves, and both decode alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from domino.__main__ import main
from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.drafter import ContextCache, Drafter
from domino.errors import DominoError
from domino.export import export
from domino.objective import DraftingObjective, ObjectiveConfig
from domino.packed_linear import pack_linear_layers
from domino.sampling import GREEDY, RowSampling, SamplingParams
from domino.training import TrainConfig, train
from helpers import greedy_continuations, tiny_drafter, tiny_target, training_batches

BLOCK = 8
MASK = 95
LAYER_IDS = [1, 3]


def dflash_model(seed: int = 0, **overrides) -> DFlashDraftModel:
    """A random z-lab DFlashDraftModel for `tiny_target()`, its norms perturbed so every weight matters."""
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                  "rope_theta": 5000.0}, num_target_layers=6, block_size=BLOCK, architectures=["DFlashDraftModel"],
                  dflash_config={"mask_token_id": MASK, "target_layer_ids": LAYER_IDS})
    fields.update(overrides)
    torch.manual_seed(seed)
    model = DFlashDraftModel(Qwen3Config(**fields)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def prompts(count: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 90, (count, length), generator=torch.Generator().manual_seed(seed))


def dflash_logits(model: DFlashDraftModel, target, ids: torch.Tensor) -> torch.Tensor:
    """DFlash's draft logits for the block after `ids`: context ids[:, :-1], anchor ids[:, -1]."""
    features = target.forward(ids[:, :-1], layer_ids=model.target_layer_ids).features
    block = torch.full((ids.shape[0], model.block_size), model.mask_token_id)
    block[:, 0] = ids[:, -1]
    hidden = model(target_hidden=features, noise_embedding=target.embed_tokens(block),
                   position_ids=torch.arange(ids.shape[1] - 1 + model.block_size)[None].expand(ids.shape[0], -1))
    return model.compute_logits(hidden[:, 1:], target.lm_head)


def our_draft(drafter: Drafter, target, ids: torch.Tensor, params: SamplingParams = GREEDY):
    """Our drafts and each position's logits for the block after `ids`, through the cache as decoding does."""
    features = target.forward(ids[:, :-1], layer_ids=drafter.config.target_layer_ids).features
    cache = ContextCache()
    positions = torch.arange(ids.shape[1] - 1)[None].expand(ids.shape[0], -1)
    drafter.extend_context(cache, features, positions)
    draft = drafter.draft(cache, ids[:, -1], RowSampling([params] * len(ids), [0] * len(ids)))
    block = drafter.block_ids(ids[:, -1])
    block_positions = ids.shape[1] - 1 + torch.arange(drafter.config.block_size)[None].expand(ids.shape[0], -1)
    hidden = drafter.backbone(block, block_positions, [cache.layer(i) for i in range(len(drafter.layers))])
    return draft, drafter.draft_logits(hidden[:, drafter.config.silent_slots:])


@pytest.fixture(scope="module")
def target():
    return tiny_target(layer_scale=0.1)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    """Our drafter in the DFlash convention, trained a few steps on the target's greedy continuations
    (so that it gets drafts accepted), saved in our format."""
    drafter = tiny_drafter(target, head="none", label_convention="dflash", block_size=BLOCK)
    data = greedy_continuations(target, 64, seed=0)
    objective = DraftingObjective(drafter, ObjectiveConfig(anchors_per_sequence=16))
    summary = train(objective, training_batches(target, drafter, data, 8, seed=0), TrainConfig(steps=60, lr=3e-3),
                    progress=False)
    assert summary["accuracy"][0] > 0.5, summary
    path = tmp_path_factory.mktemp("trained")
    drafter.eval().save_pretrained(path)
    return path


def test_dflash_checkpoint_loads_and_drafts_as_dflash_does(target, tmp_path):
    model = dflash_model()
    model.save_pretrained(tmp_path)
    drafter = Drafter.from_pretrained(tmp_path, target)
    assert (drafter.config.label_convention, drafter.config.head, drafter.config.num_drafts) == ("dflash", "none", 7)
    ids = prompts()
    with torch.no_grad():
        expected = dflash_logits(model, target, ids)
    draft, logits = our_draft(drafter, target, ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(draft.tokens, expected.argmax(-1))


def test_shift_label_in_a_dflash_config_means_shifted_labels(target, tmp_path):
    dflash_model(dflash_config={"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, "shift_label": True}
                 ).save_pretrained(tmp_path)
    config = Drafter.from_pretrained(tmp_path, target).config
    assert (config.label_convention, config.num_drafts) == ("shifted", BLOCK)


def test_sharded_dflash_checkpoint_loads(target, tmp_path):
    model = dflash_model()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    drafter = Drafter.from_pretrained(tmp_path, target)
    ids = prompts()
    with torch.no_grad():
        expected = dflash_logits(model, target, ids)
    torch.testing.assert_close(our_draft(drafter, target, ids)[1], expected, rtol=1e-4, atol=1e-4)


def test_our_dflash_export_loads_in_dflash_with_the_same_logits(target, trained, tmp_path):
    export(trained, "dflash", tmp_path)
    model = DFlashDraftModel.from_pretrained(tmp_path).float().eval()
    ours = Drafter.from_pretrained(trained, target)
    ids = prompts(seed=1)
    with torch.no_grad():
        expected = dflash_logits(model, target, ids)
    draft, logits = our_draft(ours, target, ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(draft.tokens, expected.argmax(-1))
    # and our loader reads the export back to the same drafter
    again = Drafter.from_pretrained(tmp_path, target)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def reference_rounds(model: DFlashDraftModel, target, ids: torch.Tensor, max_new_tokens: int):
    """`dflash_generate`'s new tokens and the tokens it committed in each round. Its own statistics need
    CUDA timers, so the rounds are read off the positions where each verify forward starts."""
    starts = []

    def record(module, args, kwargs):
        starts.append(int(kwargs["position_ids"][0, 0]))

    hook = target.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        output = dflash_generate(model, target.model, ids[None], max_new_tokens=max_new_tokens, stop_token_ids=None)
    finally:
        hook.remove()
    end = output.shape[1] - 1  # the last token's position: where the next round would start
    rounds = [b - a for a, b in zip(starts[1:], starts[2:] + [end])]  # starts[0] is the prefill
    return output[0, len(ids):].tolist(), rounds


def test_dflash_generate_and_our_engine_agree_round_by_round(target, trained, tmp_path):
    """Greedy, same checkpoint: the same tokens and the same tokens committed in every round, including
    the last rounds, where the reference loop shortens the block."""
    export(trained, "dflash", tmp_path)
    model = DFlashDraftModel.from_pretrained(tmp_path).float().eval()
    decoder = SpeculativeDecoder(target, Drafter.from_pretrained(tmp_path, target))
    for ids in prompts(3, 8, seed=5):
        tokens, rounds = reference_rounds(model, target, ids, max_new_tokens=27)
        ours = decoder.generate(ids.tolist(), GenerationConfig(max_new_tokens=27, stop_token_ids=[]))
        assert ours.tokens == tokens
        assert ours.stats.accept_lengths == rounds
        assert max(rounds) > 1  # the drafter gets drafts accepted: a real comparison


def test_dflash_generate_and_our_engine_agree_on_the_embedded_target(embedded_target, tmp_path):
    """The same on SmolLM2-135M with a random 1-layer DFlash drafter saved by z-lab's class, a chat prompt
    and its template: the tokens and every round's length."""
    from domino.config import default_mask_token_id

    target = embedded_target
    tc = target.config
    model = dflash_model(vocab_size=target.vocab_size, hidden_size=tc.hidden_size, intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=tc.num_attention_heads,
                         num_key_value_heads=tc.num_key_value_heads, head_dim=tc.hidden_size // tc.num_attention_heads,
                         num_target_layers=tc.num_hidden_layers, block_size=4,
                         dflash_config={"mask_token_id": default_mask_token_id(target)})
    model.save_pretrained(tmp_path)
    decoder = SpeculativeDecoder(target, Drafter.from_pretrained(tmp_path, target))
    ids = torch.tensor(target.encode_prompt("Name three colours."))
    tokens, rounds = reference_rounds(model, target, ids, max_new_tokens=10)
    ours = decoder.generate(ids.tolist(), GenerationConfig(max_new_tokens=10, stop_token_ids=[]))
    assert ours.tokens == tokens and ours.stats.accept_lengths == rounds


def sglang_rollout(exported: dict[str, torch.Tensor], hidden: torch.Tensor, anchor: torch.Tensor, target) -> list:
    """Greedy drafts as SGLang's Domino loader computes them from the exported weights (shifted labels,
    the first position from base logits alone, a bias-free GRU primed with the anchor and the first draft)."""
    gru_weight = exported["prefix_gru.weight_hh_l0"]
    gru = torch.nn.GRU(hidden.shape[-1], gru_weight.shape[1], batch_first=True, bias=False)
    gru.load_state_dict({"weight_ih_l0": exported["prefix_gru.weight_ih_l0"], "weight_hh_l0": gru_weight})
    w1, w2 = exported["embed_proj.0.weight"], exported["embed_proj.2.weight"]
    base = target.lm_head(hidden)
    tokens = [base[:, 0].argmax(-1)]
    _, state = gru(target.embed_tokens(torch.stack([anchor, tokens[0]], dim=1)))
    for k in range(1, hidden.shape[1] - 1):  # SGLang proposes block_size - 1 tokens
        bias = torch.nn.functional.silu(torch.cat([hidden[:, k], state[0]], dim=-1) @ w1.T) @ w2.T
        tokens.append((base[:, k] + bias).argmax(-1))
        _, state = gru(target.embed_tokens(tokens[-1][:, None]), state)
    return tokens


def test_sglang_domino_export_holds_what_sglangs_loader_reads(target, tmp_path):
    drafter = tiny_drafter(target, head="sglang-domino", block_size=BLOCK)
    drafter.save_pretrained(tmp_path / "ours")
    export(tmp_path / "ours", "sglang-domino", tmp_path / "sglang")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    weights = load_file(tmp_path / "sglang" / "model.safetensors")
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"] == {"mask_token_id": drafter.config.mask_token_id, "target_layer_ids":
                                       drafter.config.target_layer_ids, "projector_type": "domino",
                                       "shift_label": True, "pure_draft_prefix_len": 1, "gru_hidden_dim": 32,
                                       "emb_dim": 16}
    d, gru, rank, vocab = 64, 32, 16, 96
    head = {"prefix_gru.weight_ih_l0": (3 * gru, d), "prefix_gru.weight_hh_l0": (3 * gru, gru),
            "embed_proj.0.weight": (rank, d + gru), "embed_proj.2.weight": (vocab, rank)}
    assert {k: tuple(v.shape) for k, v in weights.items() if not k.startswith(("layers.", "fc", "hidden_norm",
                                                                               "norm"))} == head
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.1.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} <= set(weights)

    ids = prompts(seed=2)
    draft, _ = our_draft(drafter, target, ids)
    features = target.forward(ids[:, :-1], layer_ids=drafter.config.target_layer_ids).features
    cache = ContextCache()
    drafter.extend_context(cache, features, torch.arange(ids.shape[1] - 1)[None].expand(len(ids), -1))
    hidden = drafter.backbone(drafter.block_ids(ids[:, -1]), ids.shape[1] - 1 + torch.arange(BLOCK)[None],
                              [cache.layer(i) for i in range(len(drafter.layers))])
    with torch.no_grad():
        expected = torch.stack(sglang_rollout(weights, hidden, ids[:, -1], target), dim=1)
    assert torch.equal(draft.tokens[:, :BLOCK - 1], expected)
    # our loader reads SGLang's format back: the same drafts, sampled ones included
    loaded = Drafter.from_pretrained(tmp_path / "sglang", target)
    pack_linear_layers(drafter)  # as loading packs it, so that the drafts compare bit for bit
    hot = SamplingParams(temperature=1.0)
    assert torch.equal(our_draft(loaded, target, ids, hot)[0].probs, our_draft(drafter, target, ids, hot)[0].probs)


@pytest.mark.parametrize("fmt, options, message", [
    ("sglang-domino", dict(head="domino"), "bias-free GRU primed with the anchor.*'domino' head is not it"),
    ("sglang-domino", dict(head="markov"), "'markov' head is not it"),
    ("sglang-domino", dict(head="sglang-domino", label_convention="dflash"), "shifted labels only"),
    ("sglang-domino", dict(head="sglang-domino", confidence_head=True), "no confidence head"),
    ("dflash", dict(head="none"), "DFlash's labels.*label_convention dflash"),
    ("dflash", dict(head="domino", label_convention="dflash"), "no sequential head"),
    ("dflash", dict(head="none", label_convention="dflash", draft_vocab_size=12), "scores 12 tokens of it"),
    # every reason at once, each with the key that changes it
    ("dflash", dict(head="markov", confidence_head=True, draft_vocab_size=12),
     r"as dflash: .*confidence_head false.*draft_vocab_size 0.*label_convention dflash.*head none"),
])
def test_export_refuses_what_the_format_cannot_express(target, tmp_path, fmt, options, message):
    tiny_drafter(target, **options).save_pretrained(tmp_path / "ours")
    with pytest.raises(DominoError, match=message) as error:
        export(tmp_path / "ours", fmt, tmp_path / "out")
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update({"head.gru.bias_ih_l0": torch.zeros(96)}), "unexpected head.gru.bias_ih_l0"),
    (lambda w: w.pop("fc.weight"), "missing fc.weight"),
    (lambda w: w.update({"norm.weight": torch.zeros(3)}), r"norm.weight is \(3,\), not \(64,\)"),
])
def test_export_refuses_weights_the_config_does_not_describe(target, tmp_path, change, message):
    """As loading would: an export that no engine could load is not written."""
    tiny_drafter(target, head="sglang-domino").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    change(weights)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(DominoError, match=f"do not match its config: {message}"):
        export(tmp_path, "sglang-domino", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_export_that_cannot_be_written_whole_leaves_nothing(target, tmp_path):
    """A disk that fills mid-export (here a file size limit) gets one line, and no half-written folder
    stands in the way of the next try."""
    tiny_drafter(target, head="none", label_convention="dflash").save_pretrained(tmp_path / "ours")
    command = (f"ulimit -f 8; {sys.executable} -m domino export --drafter {tmp_path / 'ours'} --format dflash "
               f"--out {tmp_path / 'out'}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(f"error: cannot write {tmp_path / 'out'}: ")
    assert result.stderr.count("\n") == 1 and sorted(tmp_path.iterdir()) == [tmp_path / "ours"]


def edit_checkpoint(path, config_edit=None, extra_weight=None) -> None:
    config = json.loads((path / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (path / "config.json").write_text(json.dumps(config))
    if extra_weight:
        weights = load_file(path / "model.safetensors")
        weights[extra_weight] = torch.zeros(64)
        save_file(weights, path / "model.safetensors")


@pytest.mark.parametrize("edit, other_target, message", [
    (dict(), dict(hidden_size=32), "made for a target with hidden size 64, but 'tiny-0' has 32"),
    (dict(), dict(vocab_size=128), "made for a target with vocabulary size 96, but 'tiny-0' has 128"),
    (dict(), dict(num_layers=8), "made for a target with number of layers 6"),
    (dict(config_edit=lambda c: c["dflash_config"].update(target_layer_ids=[1, 40])), dict(),
     r"the DFlash config at .* target layer id 40 is out of range: the target has 6 layers"),
    (dict(config_edit=lambda c: c.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4)),
     dict(), "has sliding-window layers"),
    (dict(config_edit=lambda c: c.update(architectures=["DFlash2DraftModel"])), dict(),
     "DFlash 2's candidate selector"),
    (dict(config_edit=lambda c: c["dflash_config"].update(projector_type="dspark")), dict(), "projector_type 'dspark'"),
    (dict(extra_weight="mask_embedding.weight"), dict(), r"a learned mask embedding \(mask_embedding.weight\)"),
    (dict(extra_weight="layers.0.self_attn.q_proj.bias"), dict(), "weights domino has no place for"),
    (dict(config_edit=lambda c: c.pop("num_target_layers")), dict(), "lacks num_target_layers"),
    (dict(config_edit=lambda c: c["dflash_config"].update(mask_token_id="zero")), dict(),
     r"has a value of the wrong type \(invalid literal for int\(\) with base 10: 'zero'\)"),
    (dict(config_edit=lambda c: c.update(dflash_config=[1])), dict(), "has a value of the wrong type"),
    (dict(config_edit=lambda c: c.update(intermediate_size=8.5)), dict(),
     "describes no drafter domino can build: intermediate_size: Input should be a valid integer"),
])
def test_bad_dflash_checkpoint_gets_one_line_naming_the_problem(tmp_path, edit, other_target, message):
    dflash_model().save_pretrained(tmp_path)
    edit_checkpoint(tmp_path, **edit)
    with pytest.raises(DominoError, match=message) as error:
        Drafter.from_pretrained(tmp_path, tiny_target(**other_target))
    assert "\n" not in str(error.value)


def test_folder_in_neither_format_is_refused(tmp_path):
    tiny_target().model.save_pretrained(tmp_path)  # a Llama model folder, not a drafter
    with pytest.raises(DominoError, match="holds neither a domino drafter nor a DFlash one.*LlamaForCausalLM"):
        Drafter.from_pretrained(tmp_path, tiny_target())


def test_a_training_checkpoint_folder_points_to_its_drafter(target, tmp_path):
    tiny_drafter(target).save_pretrained(tmp_path / "step_000320" / "drafter")
    with pytest.raises(DominoError, match=f"it is a training checkpoint; its drafter is {tmp_path}/step_000320/drafter"):
        Drafter.from_pretrained(tmp_path / "step_000320", target)


def test_export_never_writes_over_a_folder_that_holds_files(target, tmp_path):
    """Exporting into the checkpoint it reads would replace it; into any other folder with files, mix two."""
    ours = tmp_path / "ours"
    tiny_drafter(target, head="none", label_convention="dflash").save_pretrained(ours)
    before = {p.name: p.read_bytes() for p in ours.iterdir()}
    for out, message in [(ours, "is not empty"), (ours / "config.json", "is a file")]:
        with pytest.raises(DominoError, match=f"--out {out} {message}: export into a new folder"):
            export(ours, "dflash", out)
    assert {p.name: p.read_bytes() for p in ours.iterdir()} == before
    export(ours, "dflash", tmp_path / "empty-or-new")


@pytest.mark.parametrize("damage, message", [
    (lambda path: (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:100]),
     "the checkpoint is incomplete or corrupt"),
    (lambda path: (path / "config.json").write_text("[1, 2]"), r"config.json holds a JSON list, not an object"),
    (lambda path: save_file({k: v for k, v in load_file(path / "model.safetensors").items() if k != "fc.weight"},
                            path / "model.safetensors"), r"do not match its config: Missing key\(s\).*fc.weight"),
    (lambda path: edit_checkpoint(path, lambda c: c.update(block_size=8.5, target_layer_ids="3")),
     "is not a valid drafter config: target_layer_ids: Input should be a valid list; block_size: Input should be "
     "a valid integer, got a number with a fractional part"),
])
def test_a_damaged_checkpoint_gets_one_line_naming_the_damage(target, tmp_path, damage, message):
    tiny_drafter(target).save_pretrained(tmp_path)
    damage(tmp_path)
    with pytest.raises(DominoError, match=message) as error:
        Drafter.from_pretrained(tmp_path, target)
    assert "\n" not in str(error.value)


def test_export_command_line(target, tmp_path, capsys):
    tiny_drafter(target, head="none", label_convention="dflash").save_pretrained(tmp_path / "ours")
    main(["export", "--drafter", str(tmp_path / "ours"), "--format", "dflash", "--out", str(tmp_path / "out")])
    assert DFlashDraftModel.from_pretrained(tmp_path / "out").block_size == 8
    out = capsys.readouterr().out
    assert "wrote" in out and "note" not in out
    # context lookup has no field in either format: the user is told it is left behind
    tiny_drafter(target, head="none", label_convention="dflash", lookup_ngram=3).save_pretrained(tmp_path / "copies")
    main(["export", "--drafter", str(tmp_path / "copies"), "--format", "dflash", "--out", str(tmp_path / "out2")])
    assert "note: context lookup (lookup_ngram 3) is domino's own" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--drafter", str(tmp_path / "ours"), "--format", "sglang-domino", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
