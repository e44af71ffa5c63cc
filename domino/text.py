"""Token ids -> text as they are committed, with stop strings; each token's own bytes."""

from __future__ import annotations

import functools
import json
import re

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

BYTE_OF_CHARACTER = {character: byte for byte, character in bytes_to_unicode().items()}  # byte-level BPE's alphabet
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


# transformers' clean-up of spaces (" ' " -> "'", then " n't" -> "n't") rewrites text up to this many
# characters before its end (the space before "n '"), so a tokenizer that cleans up holds them back
CLEAN_UP_REACH = 4


@functools.lru_cache(maxsize=16)  # a fact about the tokenizer, asked by every request's TextStream
def cleans_up_spaces(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether decoding removes spaces before punctuation: a rewrite of text already decoded when the
    next token comes (WordPiece tokenizers do; transformers skips it for BPE ones)."""
    ids = tokenizer("a . b 's", add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids) != tokenizer.decode(ids, clean_up_tokenization_spaces=False)


class TextStream:
    """Decodes the generated tokens incrementally. Text is released only when it can no longer change:
    a trailing partial UTF-8 character is held back, and so is any tail that could still grow into a
    stop string. A stop string ends the text before it (it is not part of the output).

    Each push decodes the tokens of the last two pushes or so, not the whole output (quadratic in its
    length): the text up to the last complete character is kept (`settled`), and the tokens after it
    are decoded together with those of the push before, so that a tokenizer that treats a sequence's
    first token specially (SentencePiece drops its leading space) decodes them as in the whole text.
    A tokenizer that cleans up spaces rewrites earlier text, so it is decoded whole each time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str] | tuple[str, ...] = (),
                 offsets: bool = False):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.tokens: list[int] = []
        # with `offsets`, where each token's text starts in the text (OpenAI's text_offset): the length of
        # the text before it, less a character it completes
        self.offsets: list[int] | None = [] if offsets else None
        self.text = ""  # everything released so far
        self.stopped = False
        self.whole = cleans_up_spaces(tokenizer)  # decode everything each push
        self.hold = max([len(s) - 1 for s in self.stop_strings] + [CLEAN_UP_REACH if self.whole else 0])
        self._settled = 0  # the text of tokens[:_settled] is _settled_text, whatever tokens follow
        self._settled_text = ""
        # where each decode starts: the settled point before the last one that added text, so that the
        # tokens decoded again always hold one that is not a special token (decoding skips those)
        self._context = 0

    def push(self, tokens: list[int], final: bool = False) -> str:
        """Add committed tokens; return the newly released text. `final` releases everything left.
        When a stop string appears, `tokens` keeps only those up to the one that completed it, as
        decoding one token at a time would have: the token output must not depend on how many
        tokens a round commits."""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        if self.offsets is not None:
            self.offsets += [len(self._text(k).rstrip("\ufffd")) for k in range(before, len(self.tokens))]
        full = self._text(len(self.tokens))
        if self._stop_at(full) != -1:
            kept = next(k for k in range(before + 1, len(self.tokens) + 1) if self._stop_at(self._text(k)) != -1)
            del self.tokens[kept:]
            if self.offsets is not None:
                del self.offsets[kept:]
            full = self._text(kept)
            full, self.stopped, final = full[:self._stop_at(full)], True, True
        elif not full.endswith("\ufffd") and len(self.tokens) > self._settled:
            if full != self._settled_text:
                self._context = self._settled
            self._settled, self._settled_text = len(self.tokens), full
        if not final:
            if full.endswith("\ufffd"):  # a multi-byte character still arriving
                full = full.rstrip("\ufffd")
            full = full[: max(len(self.text), len(full) - self.hold)]
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, count: int) -> str:
        """The text of tokens[:count], for count >= the settled point."""
        if self.whole:
            return self._decode(self.tokens[:count])
        known = self._decode(self.tokens[self._context:self._settled])
        text = self._decode(self.tokens[self._context:count])
        if not text.startswith(known):  # decoding is not local for this tokenizer here
            return self._decode(self.tokens[:count])
        return self._settled_text + text[len(known):]

    def _stop_at(self, full: str) -> int:
        """Where the earliest stop string starts in `full` past the released text, or -1."""
        found = [full.find(stop, max(0, len(self.text) - len(stop))) for stop in self.stop_strings]
        return min((at for at in found if at != -1), default=-1)


class TokenBytes:
    """Each token's own UTF-8 bytes (OpenAI's logprob `bytes`). Decoding one token alone cannot give
    them when the token holds part of a character (an emoji is often three tokens): it gives U+FFFD.
    So byte-level BPE tokens are read through their byte alphabet and SentencePiece byte tokens
    (<0xE2>) as their byte; any other token is its decoded text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        steps = [] if decoder is None else [json.loads(decoder.__getstate__())]
        steps += steps[0].get("decoders", []) if steps else []  # the steps of a Sequence decoder
        kinds = {step["type"] for step in steps}
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
        self.added = set(tokenizer.added_tokens_decoder)  # written as text, not through the byte alphabet

    def __call__(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token not in self.added and isinstance(piece, str):
            if self.byte_fallback and (match := BYTE_TOKEN.fullmatch(piece)):
                return bytes([int(match.group(1), 16)])
            if self.byte_level and all(character in BYTE_OF_CHARACTER for character in piece):
                return bytes(BYTE_OF_CHARACTER[character] for character in piece)
        return self.tokenizer.decode([token]).encode()
