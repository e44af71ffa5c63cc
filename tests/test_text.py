"""Streamed text and token bytes against the tokenizer's own decoding of the whole output, on the
target's byte-level BPE tokenizer and on two built here, a SentencePiece-style one (leading-space
marker, byte fallback) and a WordPiece one that cleans up spaces before punctuation, for any way a
generation splits its tokens into rounds."""

import string

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from domino.embedded import convert_embedded
from domino.text import TextStream, TokenBytes

# words with characters of 1 to 4 UTF-8 bytes, which tokenizers split across tokens
WORDS = ["the", "cat", "at", "mat", "naïve", "café", "中文", "😀", "🤖🤖", "—", "x", "\n", "  ", "ok.", "don't",
         "it's", "n", "'", "?"]
STOPS = ["cat", "😀", "t\n", "é", "e c", "'s"]


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """A small Llama-style tokenizer: '▁' marks spaces, the first token's leading space is dropped when
    decoding, and characters outside the vocabulary become one token per byte (<0xE2>)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for character in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(character, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("▁", "c")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def wordpiece() -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer: its decoding joins tokens with spaces, then removes those before
    punctuation and in contractions ("don ' t" -> "don't"), so later tokens rewrite earlier text."""
    words = ["the", "cat", "at", "mat", "ok", "don", "it", "n", "t", "s", "x", "##s", "##t"]
    vocab = {"[UNK]": 0, "[SEP]": 1} | {w: i + 2 for i, w in enumerate(words + list(string.punctuation))}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte-level": AutoTokenizer.from_pretrained(convert_embedded("smollm2-135m")),
              "sentencepiece": sentencepiece_style(), "wordpiece": wordpiece()}


def generated(tokenizer, words: list[str]) -> list[int]:
    """Token ids of the words, with the end-of-text token after the third (decoding skips it)."""
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    return ids[:3] + [tokenizer.eos_token_id] + ids[3:]


def rounds(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """`ids` cut into rounds of the given sizes (cycled)."""
    cut, start = [], 0
    while start < len(ids):
        size = sizes[len(cut) % len(sizes)]
        cut.append(ids[start:start + size])
        start += size
    return cut


def stream(tokenizer, ids: list[int], sizes: list[int], stops: list[str] = ()) -> tuple[TextStream, list[str]]:
    text, released = TextStream(tokenizer, stops), []
    chunks = rounds(ids, sizes)
    for i, chunk in enumerate(chunks):
        released.append(text.push(chunk, final=i == len(chunks) - 1))
        if text.stopped:
            break
    return text, released


words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=40)
sizes = st.lists(st.integers(1, 9), min_size=1, max_size=6)


@pytest.mark.parametrize("kind", TOKENIZERS)
@given(words=words, sizes=sizes)
@example(words=["cat", "n", "'", "the"], sizes=[1])  # WordPiece: "cat n '" becomes "catn'the"
@settings(max_examples=60, deadline=None, database=None)
def test_released_text_is_the_decode_of_the_whole_output(kind, words, sizes):
    tokenizer = TOKENIZERS[kind]
    ids = generated(tokenizer, words)
    text, released = stream(tokenizer, ids, sizes)
    assert "".join(released) == text.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in released)  # no half characters on the way


@pytest.mark.parametrize("kind", TOKENIZERS)
@given(words=words, sizes=sizes, stops=st.lists(st.sampled_from(STOPS), min_size=1, max_size=2))
@settings(max_examples=60, deadline=None, database=None)
def test_a_stop_string_cuts_tokens_and_text_as_one_token_rounds_would(kind, words, sizes, stops):
    tokenizer = TOKENIZERS[kind]
    ids = generated(tokenizer, words)
    text, released = stream(tokenizer, ids, sizes, stops)
    one_at_a_time, _ = stream(tokenizer, ids, [1], stops)
    assert (text.tokens, text.text, text.stopped) == (one_at_a_time.tokens, one_at_a_time.text, one_at_a_time.stopped)
    assert "".join(released) == text.text
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    if text.stopped:
        assert text.text == whole[:min(whole.index(s) for s in stops if s in whole)]
        kept = tokenizer.decode(text.tokens, skip_special_tokens=True)
        assert any(s in kept for s in stops)
        assert not any(s in tokenizer.decode(text.tokens[:-1], skip_special_tokens=True) for s in stops)
    else:
        assert not any(s in whole for s in stops) and text.text == whole


@pytest.mark.parametrize("kind", TOKENIZERS)
@given(words=words, sizes=sizes, stops=st.lists(st.sampled_from(STOPS), max_size=1))
@settings(max_examples=40, deadline=None, database=None)
def test_text_offsets_are_where_each_token_starts_whatever_the_rounds(kind, words, sizes, stops):
    tokenizer = TOKENIZERS[kind]
    ids = generated(tokenizer, words)
    text = TextStream(tokenizer, stops, offsets=True)
    for i, chunk in enumerate(rounds(ids, sizes)):
        text.push(chunk, final=False)
        if text.stopped:
            break
    decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    assert text.offsets == [len(decode(text.tokens[:i]).rstrip("\ufffd")) for i in range(len(text.tokens))]


@given(words=words)
@settings(max_examples=60, deadline=None, database=None)
def test_token_bytes_join_into_the_text_even_inside_a_character(words):
    tokenizer = TOKENIZERS["byte-level"]
    text = " ".join(words)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(token) for token in ids) == text.encode()


def test_byte_fallback_tokens_are_their_bytes_and_special_tokens_their_text():
    tokenizer = TOKENIZERS["sentencepiece"]
    ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(token) for token in ids[-4:]) == "😀".encode()
    assert token_bytes(tokenizer.eos_token_id) == b"</s>"
    smollm = TOKENIZERS["byte-level"]
    assert TokenBytes(smollm)(smollm.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
