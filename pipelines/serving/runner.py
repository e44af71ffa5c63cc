"""Driving a decoding engine from a server.

An engine (domino.engine.DecodingEngine) is a plain synchronous
object: `add` a request, `cancel` it, and call `step` to advance every active request by one round.
`EngineRunner` owns one engine and calls `step` in a loop on its own thread, so the replica's event
loop stays free to accept connections while the model runs, and all requests on the replica make
progress together. Requests and cancellations reach the thread through an inbox; each round's events
go back to the asyncio queue of the request they belong to.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from domino.engine import Event, StepTimes
from domino.decoding import GenerationConfig, GenerationResult, GenerationStats
from domino.requests import RequestState

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the server needs from an engine. Only the runner's thread calls it."""

    def add(self, request_id: str, prompt_ids: list[int], config: GenerationConfig) -> None: ...

    def cancel(self, request_id: str) -> RequestState | None: ...

    def step(self) -> list[Event]: ...

    pending: dict[str, RequestState]  # queued, not yet in the batch

    @property
    def has_work(self) -> bool: ...

    @property
    def last_step(self) -> StepTimes: ...


class Observer(Protocol):
    """Told what happens on the engine thread (the replica's metrics)."""

    def on_step(self, events: list[Event], in_flight: int, times: StepTimes) -> None: ...

    def on_cancel(self, stats: GenerationStats | None) -> None:
        """A request cancelled (its stats so far; None if the engine no longer held it)."""

    def on_fail(self, stats: list[GenerationStats]) -> None:
        """Requests ended by a failed round (requests failing alone end in on_step's events)."""


class RequestStream:
    """One request as its HTTP handler sees it: iterate for its events. Leaving the iteration early
    or calling `cancel` (a client that disconnected) stops the generation at the next round."""

    def __init__(self, runner: "EngineRunner", prompt_ids: list[int], config: GenerationConfig):
        self.request_id = f"req-{uuid.uuid4().hex}"
        self.prompt_ids, self.config = prompt_ids, config
        self.runner = runner
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future = self.loop.create_future()
        self.queue: asyncio.Queue[Event | Exception | None] = asyncio.Queue()  # None: cancelled
        self.done = False
        self.in_engine = False  # set by the engine thread once `add` took it

    # called from the engine thread: every hand-over goes through the request's own event loop
    def _call(self, function, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass

    def _settle(self, error: Exception | None) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None) if error is None else self.accepted.set_exception(error)

    def accept(self) -> None:
        self._call(self._settle, None)

    def refuse(self, error: Exception) -> None:
        self._call(self._settle, error)

    def push(self, item: Event | Exception) -> None:
        self._call(self.queue.put_nowait, item)

    # the handler's side
    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while not self.done:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, Exception):
                    self.done = True
                    raise item
                if item.finished:  # (a cancel may have set done already: it stays)
                    self.done = True
                yield item
        finally:
            self.cancel()

    async def result(self) -> GenerationResult:
        """Wait for the whole generation."""
        async for event in self:
            if event.finished:
                return event.result
        raise RuntimeError("the request was cancelled before its result")

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.queue.put_nowait(None)  # wakes a reader that is waiting for the next event
            self.runner.cancel(self.request_id)


class EngineRunner:
    def __init__(self, engine: Engine, observer: Observer | None = None):
        self.engine = engine
        self.observer = observer
        self._lock = threading.Condition()
        self._inbox: list[RequestStream | str] = []  # a stream to add, or the id of a request to cancel
        self._streams: dict[str, RequestStream] = {}  # submitted, not yet finished or cancelled
        self._stopping = False
        self._closed = False  # set, under the lock, once nothing will answer a new request
        self._thread = threading.Thread(target=self._run, name="domino-engine", daemon=True)
        self._thread.start()

    # -- called from the event loop ----------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished or cancelled: the replica's queue depth."""
        with self._lock:
            return len(self._streams)

    async def submit(self, prompt_ids: list[int], config: GenerationConfig) -> RequestStream:
        """Hand a request to the engine and wait until it is accepted. Bad input raises the engine's
        error (DominoError) here, before any response is sent."""
        stream = RequestStream(self, prompt_ids, config)
        self._post(stream)
        try:
            await stream.accepted
        except BaseException:  # refused, or the client left while waiting
            stream.cancel()
            raise
        return stream

    def cancel(self, request_id: str) -> None:
        self._post(request_id)

    def stop(self) -> None:
        """End the engine thread; requests still waiting on it get an error."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join()
        self._abandon(RuntimeError("the engine was stopped"))

    def _post(self, command: RequestStream | str) -> None:
        with self._lock:  # checked under the lock that _abandon closes with: no request slips in after it
            if self._closed or not self.alive:
                if isinstance(command, str):  # a cancel: a closed runner failed every request it held
                    return
                raise RuntimeError("the engine thread has stopped")  # the replica's health check restarts it
            if isinstance(command, RequestStream):
                self._streams[command.request_id] = command
            self._inbox.append(command)
            self._lock.notify()

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (inbox := self._wait_for_work()) is not None:
                for command in inbox:
                    self._add(command) if isinstance(command, RequestStream) else self._cancel(command)
                events = []
                if self.engine.has_work:
                    try:
                        events = self.engine.step()
                    except Exception as error:  # a failed round fails the requests in it, not the replica
                        self._fail_all(error)
                for event in events:
                    stream = self._forget(event.request_id) if event.finished else self._streams.get(event.request_id)
                    if stream is not None:
                        stream.push(event)
                self._observe("on_step", events, self.in_flight, self.engine.last_step)
        except BaseException as error:  # the thread ends: no waiting request may hang on it
            logger.exception("the engine thread stopped")
            self._abandon(error)

    def _abandon(self, error: BaseException) -> None:
        """End every request still waiting on this thread, with `error`."""
        failure = error if isinstance(error, Exception) else RuntimeError("the engine thread stopped")
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.refuse(failure)  # one still waiting to be accepted
            stream.push(failure)  # one already streaming

    def _wait_for_work(self) -> list[RequestStream | str] | None:
        """The commands that arrived since the last step; blocks while there is nothing to do."""
        with self._lock:
            while not (self._inbox or self.engine.has_work or self._stopping):
                self._lock.wait()
            if self._stopping:
                return None
            inbox, self._inbox = self._inbox, []
            return inbox

    def _forget(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _add(self, stream: RequestStream) -> None:
        try:
            self.engine.add(stream.request_id, stream.prompt_ids, stream.config)
        except Exception as error:  # DominoError for bad input; anything else is a server error
            self._forget(stream.request_id)
            stream.refuse(error)
            return
        stream.in_engine = True
        stream.accept()

    def _observe(self, event: str, *args) -> None:
        """Tell the observer; its failures are logged, since metrics never stop the decoding."""
        if self.observer is not None:
            try:
                getattr(self.observer, event)(*args)
            except Exception:
                logger.exception("the engine observer failed")

    def _cancel(self, request_id: str) -> None:
        state = self.engine.cancel(request_id)
        if self._forget(request_id) is not None:
            self._observe("on_cancel", state.stats if state is not None else None)

    def _fail_all(self, error: Exception) -> None:
        """A round raised: its requests fail (with the prefills begun in its step); those still queued go on."""
        with self._lock:
            streams = [stream for stream in self._streams.values()
                       if stream.in_engine and stream.request_id not in self.engine.pending]
        stats = []
        for stream in streams:
            state = self.engine.cancel(stream.request_id)
            if state is not None:
                stats.append(state.stats)
            self._forget(stream.request_id)
            stream.push(error)
        if streams:
            self._observe("on_fail", stats)
