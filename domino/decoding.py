"""Speculative decoding of one request at a time: the library's simple entry point.

    decoder = SpeculativeDecoder(target, drafter)        # drafter: a Drafter, "oracle", or None
    result = decoder.generate(prompt_ids, GenerationConfig(max_new_tokens=128))
    result.tokens, result.text, result.stats.tau

It runs the batched engine (engine.py) with a single request, so one code path serves the library,
the command line, the benchmarks and the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from domino.drafter import Drafter
from domino.engine import DecodingEngine
from domino.requests import GenerationConfig, GenerationResult, GenerationStats, RequestState
from domino.scheduler import VerifyPolicy
from domino.target import Target

__all__ = ["GenerationConfig", "GenerationResult", "GenerationStats", "Generation", "SpeculativeDecoder"]
REQUEST_ID = "request"


class SpeculativeDecoder:
    """One engine, used by one request at a time (the arguments are DecodingEngine's, checked here)."""

    def __init__(self, target: Target, drafter: Drafter | str | None = None, block_size: int | None = None,
                 policy: VerifyPolicy | None = None):
        self.engine = DecodingEngine(target, drafter, block_size, policy)

    def start(self, prompt_ids: list[int], config: GenerationConfig) -> "Generation":
        """Begin one request; one this decoder was still running (its caller stopped iterating) is dropped."""
        self.engine.cancel(REQUEST_ID)
        return Generation(self.engine, prompt_ids, config)

    def generate(self, prompt_ids: list[int], config: GenerationConfig,
                 on_tokens: Callable[[list[int], str], None] | None = None) -> GenerationResult:
        generation = self.start(prompt_ids, config)
        for tokens, text in generation:
            if on_tokens is not None:
                on_tokens(tokens, text)
        return generation.result


class Generation:
    """One request being decoded. Iterating runs it a round at a time, yielding (new token ids, new
    text); `result` holds the outcome. Stop iterating early (a client went away) and no further
    target forwards run."""

    def __init__(self, engine: DecodingEngine, prompt_ids: list[int], config: GenerationConfig):
        self.engine = engine
        self.state: RequestState = engine.add(REQUEST_ID, prompt_ids, config)

    @property
    def result(self) -> GenerationResult:
        return self.state.result

    def __iter__(self) -> Iterator[tuple[list[int], str]]:
        while self.engine.has_work:
            for event in self.engine.step():
                yield event.tokens, event.text
