"""Exactness of the decoding loop: at T = 0 the output is the target's own greedy output, token for token."""

import subprocess
import sys

import pytest
import torch

from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.engine import DecodingEngine
from domino.errors import DominoError
from domino.sampling import SamplingParams
from helpers import tiny_drafter, tiny_target

HEADS = ["none", "domino", "markov", "rnn"]


@pytest.fixture(scope="module")
def target():
    target = tiny_target(init_std=0.1)
    target.model.double()  # float64: no argmax near-ties between block and step-by-step forwards
    return target


def hf_greedy(target, prompt, max_new_tokens, stop=None):
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(count, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        length = int(torch.randint(1, 40, (1,), generator=generator))
        yield torch.randint(0, 96, (length,), generator=generator).tolist()


class NoisyOracle(DecodingEngine):
    """Proposes the target's greedy continuation with every token corrupted with probability 0.3,
    so that rounds accept every possible number of drafts."""

    corruption: torch.Generator | None = None

    def _propose(self, states, anchors, positions, sampling, caps):
        draft = super()._propose(states, anchors, positions, sampling, caps)
        if self.corruption is None:  # seeded by the first request's seed: a pattern per test case
            self.corruption = torch.Generator().manual_seed(states[0].seed)
        corrupt = torch.rand(draft.tokens.shape, generator=self.corruption) < 0.3
        draft.tokens = torch.where(corrupt, (draft.tokens + 1) % self.target.vocab_size, draft.tokens)
        return draft


def run_alone(engine, prompt, config):
    """Decode one request on `engine` to the end."""
    state = engine.add("only", prompt, config)
    while engine.has_work:
        engine.step()
    return state.result


@pytest.mark.parametrize("head", HEADS)
def test_greedy_output_equals_target_with_random_drafters(target, head):
    drafter = tiny_drafter(target, head=head, seed=hash(head) % 100).double()
    decoder = SpeculativeDecoder(target, drafter)
    for i, prompt in enumerate(random_prompts(6, seed=len(head))):
        max_new = 5 + 7 * i  # budgets that end mid-block
        result = decoder.generate(prompt, GenerationConfig(max_new_tokens=max_new, stop_token_ids=[], seed=i))
        assert result.tokens == hf_greedy(target, prompt, max_new)
        assert result.finish_reason == "length"


def test_greedy_output_equals_target_with_context_lookup(target):
    """Copies from the text replace some drafts (random targets repeat themselves too); the output stays the
    target's, and the copies are what lets a random drafter's rounds accept several drafts."""
    drafter = tiny_drafter(target, head="markov", seed=8, lookup_ngram=3, lookup_min_ngram=1).double()
    plain = tiny_drafter(target, head="markov", seed=8).double()
    accepted = {}
    for name, decoder in (("lookup", SpeculativeDecoder(target, drafter)), ("plain", SpeculativeDecoder(target, plain))):
        accepted[name] = 0
        for i, prompt in enumerate(random_prompts(6, seed=21)):
            max_new = 20 + 7 * i
            result = decoder.generate(prompt, GenerationConfig(max_new_tokens=max_new, stop_token_ids=[], seed=i))
            assert result.tokens == hf_greedy(target, prompt, max_new)
            accepted[name] += sum(result.stats.accepted)
    assert accepted["lookup"] > 2 * accepted["plain"] + 10, accepted


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_greedy_output_equals_target_at_every_acceptance_length(target, block_size):
    lengths = set()
    for i, prompt in enumerate(random_prompts(8, seed=block_size)):
        engine = NoisyOracle(target, "oracle", block_size=block_size)
        result = run_alone(engine, prompt, GenerationConfig(max_new_tokens=30 + i, stop_token_ids=[], seed=i))
        assert result.tokens == hf_greedy(target, prompt, 30 + i)
        lengths.update(result.stats.accept_lengths)
    assert lengths >= set(range(1, min(block_size + 1, 8) + 1))


def test_stop_tokens_inside_a_block(target):
    """A stop token accepted in the middle of a block ends the output right after it."""
    decoder = SpeculativeDecoder(target, "oracle", block_size=8)
    checked = 0
    for prompt in random_prompts(12, seed=7):
        reference = hf_greedy(target, prompt, 40)
        stop = reference[len(reference) // 2]  # a token the target really produces mid-way
        result = decoder.generate(prompt, GenerationConfig(max_new_tokens=40, stop_token_ids=[stop]))
        first = reference.index(stop)
        assert result.tokens == reference[: first + 1] == hf_greedy(target, prompt, 40, stop=stop)
        assert result.finish_reason == "stop"
        checked += first % 9 != 0  # the stop fell strictly inside a verified block
    assert checked >= 6


def test_baseline_and_oracle_statistics(target):
    prompt = next(random_prompts(1, seed=3))
    plain = SpeculativeDecoder(target, None).generate(prompt, GenerationConfig(max_new_tokens=20, stop_token_ids=[]))
    assert plain.stats.tau == 1.0 and plain.stats.rounds == 19 and plain.stats.new_tokens == 20
    oracle = SpeculativeDecoder(target, "oracle", block_size=4).generate(
        prompt, GenerationConfig(max_new_tokens=20, stop_token_ids=[]))
    assert oracle.tokens == plain.tokens
    # 1 token from prefill, then rounds of 4 drafts + 1 bonus: 5 + 5 + 5 + (4 left: 3 drafts + 1)
    assert oracle.stats.accept_lengths == [5, 5, 5, 4]
    assert oracle.stats.acceptance_by_position == [1.0, 1.0, 1.0, 1.0]
    assert oracle.stats.proposed == [4, 4, 4, 3]


def test_stop_strings_end_the_text_before_them(embedded_target):
    decoder = SpeculativeDecoder(embedded_target, "oracle", block_size=8)
    prompt = embedded_target.encode_prompt("List the days of the week, one per line.")
    full = decoder.generate(prompt, GenerationConfig(max_new_tokens=40))
    stop = "Wednesday"
    cut = decoder.generate(prompt, GenerationConfig(max_new_tokens=40, stop_strings=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.tokens) < len(full.tokens)


@pytest.mark.parametrize("make, message", [
    (lambda: GenerationConfig(max_new_tokens=0), "max_new_tokens must be positive"),
    (lambda: SamplingParams(temperature=-0.5), "temperature must be a finite number >= 0"),
    (lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (lambda: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda: SamplingParams(top_k=-1), "top_k must be >= 0"),
    (lambda: SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
    (lambda: GenerationConfig(seed=1 << 64), "seed must fit in 64 bits"),
    (lambda: GenerationConfig(logprobs=-1), "logprobs .* must be >= 0"),
])
def test_bad_parameters_are_refused(make, message):
    with pytest.raises(DominoError, match=message):
        make()


def test_bad_prompts_are_refused(target):
    decoder = SpeculativeDecoder(target, None)
    with pytest.raises(DominoError, match="prompt is empty"):
        decoder.start([], GenerationConfig())
    with pytest.raises(DominoError, match=r"prompt token ids must lie in 0\.\.95"):
        decoder.start([3, 96], GenerationConfig())
    with pytest.raises(DominoError, match="prompt has 1024 tokens but the target's context holds 1024"):
        decoder.start([1] * 1024, GenerationConfig())
    with pytest.raises(DominoError, match="lower max_new_tokens to 24"):
        decoder.start([1] * 1000, GenerationConfig(max_new_tokens=100))


def test_drafter_for_another_target_is_refused(target):
    with pytest.raises(DominoError, match="made for a target with hidden size"):
        SpeculativeDecoder(target, tiny_drafter(tiny_target(hidden_size=32)))


def test_a_block_size_the_drafter_does_not_have_is_refused(target):
    drafter = tiny_drafter(target, block_size=4)
    assert SpeculativeDecoder(target, drafter, block_size=4).engine.max_drafts == drafter.config.num_drafts
    with pytest.raises(DominoError, match="the drafter drafts blocks of 4 tokens, not 8"):
        SpeculativeDecoder(target, drafter, block_size=8)


@pytest.mark.parametrize("block_size", [0, -4, 1, 1000])
def test_an_oracle_block_size_out_of_range_is_refused(target, block_size):
    """0 once meant the default and a negative size drafted nothing, silently."""
    with pytest.raises(DominoError, match=f"block_size must be between 2 and 64.*got {block_size}"):
        SpeculativeDecoder(target, "oracle", block_size=block_size)


def test_a_decoder_left_mid_generation_starts_the_next_one_clean(target):
    decoder = SpeculativeDecoder(target, "oracle", block_size=4)
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=[])
    alone = decoder.generate([5, 6, 7], config).tokens
    next(iter(decoder.start([1, 2, 3], config)))  # the caller stops iterating after one round
    assert decoder.generate([5, 6, 7], config).tokens == alone


def test_stop_strings_give_the_same_tokens_speculative_or_plain(embedded_target):
    """A round commits several tokens at once; those after the one that completed the stop string are
    dropped, so tokens and their count are what plain decoding (one token a round) gives."""
    prompt = embedded_target.encode_prompt("List the days of the week, one per line.")
    config = GenerationConfig(max_new_tokens=40, stop_strings=["day\n", "Thu"])
    plain = SpeculativeDecoder(embedded_target, None).generate(prompt, config)
    oracle = SpeculativeDecoder(embedded_target, "oracle", block_size=8).generate(prompt, config)
    assert oracle.finish_reason == plain.finish_reason == "stop"
    assert oracle.tokens == plain.tokens and oracle.text == plain.text
    assert max(oracle.stats.accept_lengths) > 1  # rounds did commit several tokens
    decode = embedded_target.tokenizer.decode
    assert any(s in decode(oracle.tokens) for s in config.stop_strings)
    assert not any(s in decode(oracle.tokens[:-1]) for s in config.stop_strings)


def test_command_line_generate_with_confidence_scheduling_prints_the_targets_own_text(embedded_target, tmp_path,
                                                                                      capsys):
    from domino.__main__ import main

    path = tmp_path / "drafter"
    tiny_drafter(embedded_target, num_layers=1, confidence_head=True, lookup_ngram=3).save_pretrained(path)
    prompt = ["--prompt", "Repeat twice: the cat sat on the mat.", "--max-new-tokens", "24"]
    main(["generate", "--drafter", "none", *prompt])
    plain = capsys.readouterr().out
    main(["generate", "--drafter", str(path), "--verify", "confidence", *prompt])
    out, err = capsys.readouterr()
    assert out == plain and "tau" in err
    with pytest.raises(SystemExit):  # plain decoding has no confidence head to schedule by
        main(["generate", "--drafter", "none", "--verify", "confidence", *prompt])
    assert "confidence head" in capsys.readouterr().err
    # options that the other choices would ignore are refused, not ignored
    for ignored, message in ((["--threshold", "0.9"], "--threshold is read by --verify threshold only"),
                             (["--block-size", "4"], "--block-size sets the oracle's draft length")):
        with pytest.raises(SystemExit):
            main(["generate", "--drafter", "none", *ignored, *prompt])
        assert message in capsys.readouterr().err
    assert plain.endswith("\n")  # the text ends its line, so a file it is written to does too


def test_command_line_generate_piped_into_head_ends_quietly():
    """`| head` closes stdout early: no BrokenPipeError traceback."""
    command = f"{sys.executable} -m domino generate --prompt 'Count to twenty.' --max-new-tokens 64 | head -c 1"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert len(result.stdout) == 1 and "Error" not in result.stderr, result.stderr
