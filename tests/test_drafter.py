import pytest
import torch

from domino.config import DrafterConfig
from domino.drafter import ContextCache, Drafter
from domino.errors import DominoError
from domino.packed_linear import ONEDNN_ON_X86, PackedLinear, pack_linear_layers
from domino.sampling import GREEDY, RowSampling, SamplingParams
from helpers import tiny_drafter, tiny_target

HEADS = ["none", "domino", "sglang-domino", "markov", "rnn"]


def draft_once(drafter, target, ids, params=GREEDY, seed=0):
    features = target.forward(ids[:, :-1], layer_ids=drafter.config.target_layer_ids).features
    cache = ContextCache()
    drafter.extend_context(cache, features, torch.arange(ids.shape[1] - 1)[None])
    return drafter.draft(cache, ids[:, -1], RowSampling([params], [seed]))


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=1), "block_size must be between 2 and 64"),
    (dict(block_size=100), "block_size must be between 2 and 64"),
    (dict(head="gru"), "unknown head kind 'gru': choose one of none, domino, sglang-domino, markov, rnn"),
    (dict(layer_ids=[1, 40]), "layer id 40 is out of range"),
])
def test_bad_config_gets_one_line_error(bad, message):
    target = tiny_target()
    with pytest.raises(DominoError, match=message) as error:
        DrafterConfig.for_target(target, **bad)
    assert "\n" not in str(error.value)


def test_unknown_option_is_named():
    with pytest.raises(DominoError, match="unknown drafter option.*blok_size"):
        DrafterConfig.for_target(tiny_target(), blok_size=8)


@pytest.mark.parametrize("head", HEADS)
def test_save_load_gives_identical_drafts(tmp_path, head):
    target = tiny_target()
    drafter = tiny_drafter(target, head=head, confidence_head=True)
    pack_linear_layers(drafter)  # as loading packs it, so that the drafts compare bit for bit
    ids = torch.randint(0, 96, (1, 20))
    before = draft_once(drafter, target, ids, SamplingParams(temperature=1.0))
    drafter.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target)
    after = draft_once(loaded, target, ids, SamplingParams(temperature=1.0))
    assert torch.equal(before.tokens, after.tokens)
    assert torch.equal(before.probs, after.probs)
    assert torch.equal(before.confidence, after.confidence)
    # the target's shared embedding and LM head are not part of the checkpoint
    assert not any("embed" in k and k.startswith("target") for k in loaded.state_dict())
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in drafter.parameters())
    assert all(p.data_ptr() != target.embed_tokens.weight.data_ptr() for p in loaded.parameters())


def test_a_loaded_drafter_drafts_through_packed_weights_what_its_dense_weights_draft(tmp_path):
    """On an x86 CPU in float32, a loaded drafter's linear layers and its reduced LM head run on weights
    laid out for oneDNN (the LM head over 8 positions 5x faster): the same drafts as the dense weights'
    to float tolerance, the same tokens."""
    target = tiny_target()
    drafter = tiny_drafter(target, head="markov", confidence_head=True, draft_vocab_size=40)
    drafter.set_draft_vocabulary(torch.arange(40) * 2)
    drafter.save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    dense, packed = (draft_once(d, target, ids, SamplingParams(temperature=1.0)) for d in (drafter, loaded))
    assert isinstance(loaded.fc, PackedLinear) == ONEDNN_ON_X86 == (loaded.packed_head_rows is not None)
    assert torch.equal(dense.tokens, packed.tokens)
    assert torch.allclose(dense.probs, packed.probs, atol=1e-6)
    assert torch.allclose(dense.confidence, packed.confidence, atol=1e-6)
    assert not torch.equal(dense.probs, packed.probs) or not ONEDNN_ON_X86  # the packed path really ran


def test_screened_draft_stops_before_the_lm_head():
    """A screen sees the first position's confidences; saying no skips the LM head, saying yes
    changes nothing about the draft."""
    target = tiny_target()
    drafter = tiny_drafter(target, head="domino", confidence_head=True)
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    features = target.forward(ids[:, :-1], layer_ids=drafter.config.target_layer_ids).features
    cache = ContextCache()
    drafter.extend_context(cache, features, torch.arange(ids.shape[1] - 1).expand(3, -1))
    greedy = RowSampling([GREEDY] * 3, [None] * 3)
    calls = []
    hook = target.lm_head.register_forward_hook(lambda *args: calls.append(1))
    try:
        full = drafter.draft(cache, ids[:, -1], greedy)
        assert len(calls) == 1
        seen = []
        assert drafter.draft(cache, ids[:, -1], greedy, screen=lambda first: seen.append(first) or False) is None
        assert len(calls) == 1 and torch.equal(seen[0], full.confidence[:, 0])
        passed = drafter.draft(cache, ids[:, -1], greedy, screen=lambda first: True)
    finally:
        hook.remove()
    assert torch.equal(passed.tokens, full.tokens) and torch.equal(passed.confidence, full.confidence)


@pytest.mark.parametrize("other, fact", [
    (dict(hidden_size=32), "hidden size 64"),
    (dict(vocab_size=80), "vocabulary size 96"),
    (dict(num_layers=8), "number of layers 6"),
])
def test_checkpoint_for_another_target_is_refused(tmp_path, other, fact):
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path)
    with pytest.raises(DominoError, match=f"made for a target with {fact}.*train a drafter for this one"):
        Drafter.from_pretrained(tmp_path, tiny_target(**other))


def test_missing_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(DominoError, match="no drafter checkpoint.*folder written by training") as error:
        Drafter.from_pretrained(tmp_path / "missing", tiny_target())
    assert "'none'" not in str(error.value)  # a command line's own word: meaningless to export or a library user


def test_greedy_draft_is_deterministic_and_sampling_is_seeded():
    target = tiny_target()
    drafter = tiny_drafter(target, head="domino")
    ids = torch.randint(0, 96, (1, 16))
    assert torch.equal(draft_once(drafter, target, ids).tokens, draft_once(drafter, target, ids).tokens)
    hot = SamplingParams(temperature=1.5)
    a, b = draft_once(drafter, target, ids, hot, seed=1), draft_once(drafter, target, ids, hot, seed=1)
    assert torch.equal(a.tokens, b.tokens)
    # each proposal is a draw from the distribution returned for it: it has positive mass there
    assert (a.probs.gather(-1, a.tokens[..., None]) > 0).all()
    # greedy proposals are the argmax of the (temperature-free) distribution
    greedy = draft_once(drafter, target, ids)
    assert greedy.probs is None and greedy.tokens.shape == (1, drafter.config.block_size)


def test_head_changes_later_positions_only_through_the_drafted_prefix():
    """With the Domino head, position k's distribution depends on the token drafted at k-1: sampling two
    different first tokens gives different second-position distributions, the first position unchanged."""
    target = tiny_target()
    drafter = tiny_drafter(target, head="domino")
    ids = torch.randint(0, 96, (1, 16))
    hot = SamplingParams(temperature=3.0)
    runs = [draft_once(drafter, target, ids, hot, seed=s) for s in range(20)]
    firsts = {int(r.tokens[0, 0]) for r in runs}
    assert len(firsts) > 1
    assert all(torch.allclose(r.probs[0, 0], runs[0].probs[0, 0]) for r in runs)
    differing = [r for r in runs if r.tokens[0, 0] != runs[0].tokens[0, 0]]
    assert not torch.allclose(differing[0].probs[0, 1], runs[0].probs[0, 1])


def test_starting_from_the_target_copies_its_next_layer_and_passes_the_deepest_states_through():
    target = tiny_target()
    config = DrafterConfig.for_target(target, num_layers=1, layer_ids=[1, 3], head="none")
    drafter = Drafter(config, target.embed_tokens, target.lm_head)
    drafter.start_from_target(target)
    source = target.decoder_layers[4]
    assert torch.equal(drafter.layers[0].attn.k_proj.weight, source.self_attn.k_proj.weight)
    assert torch.equal(drafter.layers[0].down.weight, source.mlp.down_proj.weight)
    assert torch.equal(drafter.feature_norm.weight, source.input_layernorm.weight)
    assert torch.equal(drafter.norm.weight, target.model.model.norm.weight)
    states = torch.randn(2, 5, 2 * config.hidden_size)
    assert torch.equal(drafter.fc(states), states[..., config.hidden_size:])  # layer 3's states, as they are
    too_deep = Drafter(DrafterConfig.for_target(target, layer_ids=[5], head="none"), target.embed_tokens, target.lm_head)
    with pytest.raises(DominoError, match="no layer 6 to start draft layers from"):
        too_deep.start_from_target(target)


def test_the_initial_drafter_is_drawn_from_its_seed_and_scores_its_vocabulary():
    """What training starts from, and what the closing evaluation rebuilds as its untrained baseline."""
    target = tiny_target()
    config = DrafterConfig.for_target(target, num_layers=1, block_size=4, draft_vocab_size=8)
    vocabulary = torch.tensor([5, 3, 90, 7, 11, 40, 2, 60])
    first, again = (Drafter.initial(config, target, seed=3, vocabulary=vocabulary) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert torch.equal(first.draft_to_target, vocabulary)
    other = Drafter.initial(config, target, seed=4, vocabulary=vocabulary)
    assert not torch.equal(first.fc.weight, other.fc.weight)
