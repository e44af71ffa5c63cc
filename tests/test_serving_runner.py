"""The engine runner on its own (no Ray): the thread that steps an engine for an asyncio server."""

import asyncio

import pytest

from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.engine import DecodingEngine
from domino.errors import DominoError
from helpers import tiny_drafter, tiny_target
from pipelines.serving.runner import EngineRunner


@pytest.fixture(scope="module")
def decoder():
    target = tiny_target(init_std=0.1)
    return SpeculativeDecoder(target, tiny_drafter(target, head="domino"))


def config(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=[])


async def wait_until(condition, timeout: float = 5.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return False


def test_concurrent_requests_get_their_own_outputs(decoder):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    expected = [decoder.generate(p, config(12 + 5 * i)).tokens for i, p in enumerate(prompts)]

    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter))

        async def one(i: int) -> list[int]:
            stream = await runner.submit(prompts[i], config(12 + 5 * i))
            tokens = []
            async for event in stream:
                tokens += event.tokens
            return tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            runner.stop()

    assert asyncio.run(main()) == expected


def test_bad_input_is_refused_at_submit_and_the_runner_goes_on(decoder):
    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter))
        try:
            with pytest.raises(DominoError, match="prompt is empty"):
                await runner.submit([], config(4))
            result = await (await runner.submit([1, 2], config(4))).result()
            return result.tokens, runner.in_flight
        finally:
            runner.stop()

    tokens, in_flight = asyncio.run(main())
    assert len(tokens) == 4 and in_flight == 0


def test_leaving_the_stream_early_cancels_the_generation(decoder):
    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter))
        try:
            stream = await runner.submit([1, 2, 3], config(900))
            async for _ in stream:
                break  # the client went away after its first chunk
            return await wait_until(lambda: runner.in_flight == 0 and not runner.engine.has_work)
        finally:
            runner.stop()

    assert asyncio.run(main())


class FailingOnce(DecodingEngine):
    """Its first round raises, as a forward that runs out of memory would."""

    def __init__(self, decoder, **options):
        super().__init__(decoder.engine.target, decoder.engine.drafter, **options)
        self.failed = False

    def _round(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("out of memory")
        return super()._round()


class FailureCount:
    def __init__(self):
        self.failed, self.cancelled = 0, []

    def on_step(self, events, in_flight, times):
        pass

    def on_cancel(self, stats):
        self.cancelled.append(stats)

    def on_fail(self, stats):
        self.failed += len(stats)


def test_cancelling_ends_a_reader_that_waits_for_the_next_event(decoder):
    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter))
        try:
            stream = await runner.submit([1, 2, 3], config(900))
            reader = asyncio.create_task(stream.result())
            await asyncio.sleep(0.05)  # the reader is waiting on the stream's queue
            stream.cancel()
            with pytest.raises(RuntimeError, match="cancelled before its result"):
                await asyncio.wait_for(reader, timeout=5)
            return await wait_until(lambda: runner.in_flight == 0 and not runner.engine.has_work)
        finally:
            runner.stop()

    assert asyncio.run(main())


def test_a_failed_step_fails_its_requests_not_the_runner(decoder):
    observer = FailureCount()

    async def main():
        runner = EngineRunner(FailingOnce(decoder), observer)
        try:
            with pytest.raises(RuntimeError, match="out of memory"):
                await (await runner.submit([1, 2, 3], config(8))).result()
            result = await (await runner.submit([1, 2, 3], config(8))).result()
            return result.tokens, runner.alive
        finally:
            runner.stop()

    tokens, alive = asyncio.run(main())
    assert tokens == decoder.generate([1, 2, 3], config(8)).tokens and alive
    assert observer.failed == 1  # counted under finish_reason "error"


def test_a_failed_round_spares_the_requests_still_queued(decoder):
    """With max_rows=1 the second request waits in the queue while the first one's round fails: it was in
    no round, and decodes on."""
    observer = FailureCount()

    async def main():
        runner = EngineRunner(FailingOnce(decoder, max_rows=1), observer)
        try:
            first = await runner.submit([1, 2, 3], config(8))
            second = await runner.submit([4, 5, 6], config(8))
            with pytest.raises(RuntimeError, match="out of memory"):
                await asyncio.wait_for(first.result(), 60)
            return (await asyncio.wait_for(second.result(), 60)).tokens
        finally:
            runner.stop()

    assert asyncio.run(main()) == decoder.generate([4, 5, 6], config(8)).tokens
    assert observer.failed == 1


def test_a_cancelled_request_reports_the_rounds_it_took(decoder):
    """The replica's speculative-decoding counters count a cancelled request's rounds too."""
    observer = FailureCount()

    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter), observer)
        try:
            stream = await runner.submit([1, 2, 3], config(400))
            assert await wait_until(lambda: runner.engine.states and runner.engine.states[stream.request_id].stats.rounds)
            stream.cancel()
            return await wait_until(lambda: observer.cancelled)
        finally:
            runner.stop()

    assert asyncio.run(main()) and observer.cancelled[0].rounds > 0


class BrokenObserver:
    def on_step(self, events, in_flight, times):
        raise ValueError("metrics backend down")

    def on_cancel(self, stats):
        raise ValueError("metrics backend down")

    def on_fail(self, stats):
        raise ValueError("metrics backend down")


def test_a_failing_observer_does_not_stop_the_decoding(decoder):
    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter), BrokenObserver())
        try:
            result = await asyncio.wait_for((await runner.submit([1, 2, 3], config(8))).result(), 60)
            return result.tokens, runner.alive
        finally:
            runner.stop()

    tokens, alive = asyncio.run(main())
    assert tokens == decoder.generate([1, 2, 3], config(8)).tokens and alive


class Wrecked(FailingOnce):
    """A step fails and so does every cancel after it: the engine is past recovering, and the thread ends."""

    def cancel(self, request_id):
        raise RuntimeError("CUDA error: an illegal memory access")


def test_requests_waiting_on_a_dead_engine_thread_get_an_error_not_a_hang(decoder):
    async def main():
        runner = EngineRunner(Wrecked(decoder))
        stream = await runner.submit([1, 2, 3], config(8))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await asyncio.wait_for(stream.result(), 60)
        assert await wait_until(lambda: not runner.alive)
        with pytest.raises(RuntimeError, match="engine thread has stopped"):
            await runner.submit([1, 2, 3], config(8))
        runner.cancel(stream.request_id)  # a client leaving now has nothing to cancel, and no error

    asyncio.run(main())


def test_stopping_the_runner_fails_the_requests_it_held(decoder):
    """A request in flight when the runner stops gets an error, not a hang; later ones are refused at once."""
    async def main():
        runner = EngineRunner(DecodingEngine(decoder.engine.target, decoder.engine.drafter))
        stream = await runner.submit([1, 2, 3], config(400))
        runner.stop()
        with pytest.raises(RuntimeError, match="the engine was stopped"):
            await asyncio.wait_for(stream.result(), 10)
        with pytest.raises(RuntimeError, match="engine thread has stopped"):
            await runner.submit([1, 2, 3], config(8))
        runner.cancel(stream.request_id)

    asyncio.run(main())
