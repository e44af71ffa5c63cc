"""Many requests in flight on one target: requests join and leave between rounds, and every call to
`step` advances each active request by one round. A server runs `step` in a loop and forwards each
request's events to its client."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from domino.decoding import Generation, GenerationConfig, GenerationResult, SpeculativeDecoder
from domino.errors import DominoError


@dataclass
class Event:
    request_id: str
    tokens: list[int]  # committed this round
    text: str  # text released this round
    result: GenerationResult | None  # set on the request's last event

    @property
    def finished(self) -> bool:
        return self.result is not None


class InterleavedEngine:
    """Runs the requests' rounds one after another (no batched forwards yet): none waits for another
    to finish, and a cancelled request stops at the next round boundary."""

    def __init__(self, decoder: SpeculativeDecoder):
        self.decoder = decoder
        self.active: dict[str, tuple[Generation, Iterator]] = {}

    def add(self, request_id: str, prompt_ids: list[int], config: GenerationConfig) -> None:
        """Queue a request; it starts at the next step. Bad input raises DominoError here."""
        if request_id in self.active:
            raise DominoError(f"request id {request_id!r} is already in flight")
        generation = self.decoder.start(prompt_ids, config)
        self.active[request_id] = (generation, iter(generation))

    def cancel(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> list[Event]:
        events = []
        for request_id, (generation, rounds) in list(self.active.items()):
            try:
                tokens, text = next(rounds)
            except StopIteration:  # finished on its previous round
                tokens, text = [], ""
            done = generation.finish_reason is not None
            if done:
                del self.active[request_id]
            events.append(Event(request_id, tokens, text, generation.result if done else None))
        return events
