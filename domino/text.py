"""Token ids -> text as they are committed, with stop strings."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Decodes the generated tokens incrementally. Text is released only when it can no longer change:
    a trailing partial UTF-8 character is held back, and so is any tail that could still grow into a
    stop string. A stop string ends the text before it (it is not part of the output)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.tokens: list[int] = []
        self.text = ""  # everything released so far
        self.stopped = False

    def push(self, tokens: list[int], final: bool = False) -> str:
        """Add committed tokens; return the newly released text. `final` releases everything left.
        When a stop string appears, `tokens` keeps only those up to the one that completed it, as
        decoding one token at a time would have: the token output must not depend on how many
        tokens a round commits."""
        before = len(self.tokens)
        self.tokens.extend(tokens)
        full = self._decode(len(self.tokens))
        if self._stop_at(full) != -1:
            kept = next(k for k in range(before + 1, len(self.tokens) + 1) if self._stop_at(self._decode(k)) != -1)
            del self.tokens[kept:]
            full = self._decode(kept)
            full, self.stopped, final = full[:self._stop_at(full)], True, True
        if not final:
            if full.endswith("\ufffd"):  # a multi-byte character still arriving
                full = full.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stop_strings), default=0)
            full = full[: max(len(self.text), len(full) - hold)]
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def _decode(self, count: int) -> str:
        return self.tokenizer.decode(self.tokens[:count], skip_special_tokens=True)

    def _stop_at(self, full: str) -> int:
        """Where the earliest stop string starts in `full` past the released text, or -1."""
        found = [full.find(stop, max(0, len(self.text) - len(stop))) for stop in self.stop_strings]
        return min((at for at in found if at != -1), default=-1)
