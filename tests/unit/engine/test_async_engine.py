"""AsyncEngine's plumbing (admission, aborts, failure) over a stand-in core.

A unit test of the front door alone: the core here is a scripted double that
emits one token per step. The real engine behind a real server is covered
by tests/integration.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import (
    EngineDeadError,
    EngineDrainingError,
    InvalidRequestError,
    QueueFullError,
)
from engine.output_processor import RequestOutput
from engine.request import RequestStatus
from engine.stats import SchedulerStats
from tests.unit.engine.scripted_core import ScriptedCore, make_request, start_engine


def test_stream_delivers_every_step_then_finishes() -> None:
    async def go() -> None:
        engine = await start_engine(ScriptedCore())
        stream = engine.submit(make_request(engine, "a", max_tokens=3))
        deltas = [d async for d in stream]
        assert [d.token_ids for d in deltas] == [[42], [42], [42]]
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert deltas[-1].num_generated_tokens == 3 and deltas[-1].num_prompt_tokens == 3
        assert engine.num_live == 0
        await engine.shutdown()

    asyncio.run(go())


def test_token_weighted_step_time_counts_each_inter_token_gap() -> None:
    """Each step counts once per token it gave a request that already had
    one: "a" (3 tokens) ends two gaps, "b" (1 token) none."""

    async def go() -> None:
        engine = await start_engine(ScriptedCore())
        streams = [
            engine.submit(make_request(engine, "a", 3)),
            engine.submit(make_request(engine, "b", 1)),
        ]
        for stream in streams:
            async for _ in stream:
                pass
        assert engine.front._step_times.num_inter_token_gaps == 2
        assert engine.status().recent_token_step_ms_p50 > 0
        await engine.shutdown()

    asyncio.run(go())


def test_duplicate_ids_queue_bound_and_draining_are_refused() -> None:
    async def go() -> None:
        core = ScriptedCore()
        engine = await start_engine(core, max_waiting_requests=1)
        stream = engine.submit(make_request(engine, "a", max_tokens=1000))
        with pytest.raises(InvalidRequestError, match="request_id"):
            engine.submit(make_request(engine, "a"))
        with pytest.raises(QueueFullError):  # "a" is not yet taken by the engine
            engine.submit(make_request(engine, "b"))
        await stream.__anext__()
        engine.begin_drain()
        with pytest.raises(EngineDrainingError):
            engine.submit(make_request(engine, "c"))
        stream.close()  # the client went away: aborted in the core
        await engine.wait_idle(5)
        for _ in range(50):
            if core.aborted:
                break
            await asyncio.sleep(0.01)
        assert core.aborted == [("a", RequestStatus.FINISHED_ABORTED)]
        await engine.shutdown()

    asyncio.run(go())


def test_engine_failure_ends_streams_and_tells_listeners() -> None:
    async def go() -> None:
        engine = await start_engine(ScriptedCore(fail_at=2))
        failures: list[BaseException] = []
        engine.add_failure_listener(failures.append)
        stream = engine.submit(make_request(engine, "a", max_tokens=10))
        first = await stream.__anext__()
        assert first.token_ids == [42]
        with pytest.raises(EngineDeadError, match="boom"):
            await stream.__anext__()
        assert len(failures) == 1 and not engine.healthy
        with pytest.raises(EngineDeadError):
            engine.submit(make_request(engine, "b"))

    asyncio.run(go())


def test_abort_ends_live_requests_and_release_frees_held_kv() -> None:
    """Abort reaches the core for live ids only; releasing KV held for a
    remote decode is its own command, for finished ids."""

    async def run() -> tuple[list[str], list[str], list[tuple[str, RequestStatus]]]:
        core = ScriptedCore()
        engine = await start_engine(core)
        try:
            stream = engine.submit(make_request(engine, "live", max_tokens=100))
            await stream.__anext__()
            aborted = engine.abort(["live", "done-earlier"])
            engine.release_held_kv(["done-earlier"])
            await engine.wait_idle(5.0)
            for _ in range(100):  # the engine thread applies commands between steps
                if core.released:
                    break
                await asyncio.sleep(0.01)
            return aborted, core.released, core.aborted
        finally:
            await engine.shutdown()

    aborted, released, core_aborted = asyncio.run(run())
    assert aborted == ["live"]
    assert released == ["done-earlier"]
    assert core_aborted == [("live", RequestStatus.FINISHED_ABORTED)]


def test_an_id_the_scheduler_still_holds_fails_that_request_alone() -> None:
    """The front door cannot see ids the scheduler keeps for finished
    requests (KV held for a remote decode): reusing one fails that request
    with INVALID_ARGUMENT's error, and the engine serves on."""

    async def go() -> None:
        core = ScriptedCore(held={"held"})
        engine = await start_engine(core)
        try:
            refused = engine.submit(make_request(engine, "held"))
            with pytest.raises(InvalidRequestError, match="request_id: 'held' is already in use"):
                await refused.__anext__()
            ok = engine.submit(make_request(engine, "ok", max_tokens=2))
            deltas = [delta async for delta in ok]
            assert deltas[-1].finished and len(deltas) == 2
            assert engine.healthy and engine.num_live == 0
        finally:
            await engine.shutdown()

    asyncio.run(go())


class RaisingObserver:
    """Every metrics call raises, as the Prometheus counter did when handed
    a negative connector hit count."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def on_step(self, stats: SchedulerStats) -> None:
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    def on_engine_step(self, seconds: float) -> None:
        raise ValueError("engine step")

    def on_first_token(self, seconds_since_arrival: float) -> None:
        raise ValueError("first token")

    def on_tokens(self, num_tokens: int, seconds_since_previous: float) -> None:
        raise ValueError("tokens")

    def on_finished(self, delta: RequestOutput, seconds_since_arrival: float) -> None:
        raise ValueError("finished")

    def on_metrics_error(self, where: str) -> None:
        self.errors.append(where)


def test_a_failing_observer_never_costs_a_token(caplog: pytest.LogCaptureFixture) -> None:
    """Metrics that raise on every call: every request still gets every
    token and its end; the failures are counted, and logged once per kind."""

    async def go() -> tuple[list[list[RequestOutput]], AsyncEngine]:
        observer = RaisingObserver()
        engine = await start_engine(ScriptedCore(), observer=observer)
        try:
            streams = [engine.submit(make_request(engine, f"r{i}", max_tokens=5)) for i in range(4)]

            async def collect() -> list[list[RequestOutput]]:
                return [[d async for d in stream] for stream in streams]

            # A lost step never ends its requests: a bound, not a timing.
            deltas = await asyncio.wait_for(collect(), 60)
            assert observer.errors and set(observer.errors) <= {"step", "engine_step", "request"}
            return deltas, engine
        finally:
            await engine.shutdown()

    deltas, engine = asyncio.run(go())
    for request_deltas in deltas:
        assert [t for d in request_deltas for t in d.token_ids] == [42] * 5
        assert request_deltas[-1].finished and request_deltas[-1].finish_reason == "length"
    status = engine.status()
    assert status.metrics_errors >= 4 * 5  # at least one per token delivered
    logged = [r for r in caplog.records if "outputs were delivered regardless" in r.message]
    assert 1 <= len(logged) <= 3  # once per (where, exception type)


@dataclass
class FinishRecorder:
    """An EngineObserver that records each on_finished call."""

    finished: list[tuple[str, str | None]] = field(default_factory=list)

    def on_step(self, stats: SchedulerStats) -> None:
        pass

    def on_engine_step(self, seconds: float) -> None:
        pass

    def on_first_token(self, seconds_since_arrival: float) -> None:
        pass

    def on_tokens(self, num_tokens: int, seconds_since_previous: float) -> None:
        pass

    def on_finished(self, delta: RequestOutput, seconds_since_arrival: float) -> None:
        assert delta.finished
        self.finished.append((delta.request_id, delta.finish_reason))


def test_every_finished_request_reaches_the_observer_once() -> None:
    """Finished by its length, cancelled by its client, aborted by id,
    refused by the scheduler after admission: each is observed once."""

    async def go() -> list[tuple[str, str | None]]:
        recorder = FinishRecorder()
        core = ScriptedCore(held={"refused"})
        engine = await start_engine(core, observer=recorder)
        try:
            done = engine.submit(make_request(engine, "done", max_tokens=2))
            cancelled = engine.submit(make_request(engine, "cancelled", max_tokens=1000))
            aborted = engine.submit(make_request(engine, "aborted", max_tokens=1000))
            refused = engine.submit(make_request(engine, "refused"))
            await cancelled.__anext__()
            cancelled.close()  # the client went away
            assert engine.abort(["aborted"]) == ["aborted"]
            assert [d async for d in aborted][-1].finish_reason == "abort"
            assert [d async for d in done][-1].finish_reason == "length"
            with pytest.raises(InvalidRequestError):
                await refused.__anext__()
            assert await engine.wait_idle(5)
            engine.abort(["done", "cancelled", "aborted"])  # no longer live: no effect
            return recorder.finished
        finally:
            await engine.shutdown()

    finished = asyncio.run(go())
    assert sorted(finished) == [
        ("aborted", "abort"),
        ("cancelled", "abort"),
        ("done", "length"),
        ("refused", "error"),
    ]


def test_requests_ended_by_an_engine_failure_are_observed() -> None:
    async def go() -> list[tuple[str, str | None]]:
        recorder = FinishRecorder()
        engine = await start_engine(ScriptedCore(fail_at=2), observer=recorder)
        stream = engine.submit(make_request(engine, "a", max_tokens=10))
        await stream.__anext__()
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        return recorder.finished

    assert asyncio.run(go()) == [("a", "error")]


def test_wait_kv_released_waits_for_held_blocks() -> None:
    """A finished request whose KV is held for a peer keeps the engine
    unreleased (what a drain waits for) until the hold ends."""

    async def go() -> None:
        engine = await start_engine(ScriptedCore(hold_kv=True))
        try:
            assert await engine.wait_kv_released(0)  # nothing held
            stream = engine.submit(make_request(engine, "a", max_tokens=1))
            assert [d.finished async for d in stream] == [True]
            assert engine.num_held_kv == 1
            assert not await engine.wait_kv_released(0.2)  # still held: nobody released it
            assert engine.abort(["a"]) == []  # finished: nothing to abort
            engine.release_held_kv(["a"])
            assert await engine.wait_kv_released(30)
            assert engine.num_held_kv == 0 and engine.status().kv_held_requests == 0
        finally:
            await engine.shutdown()

    asyncio.run(go())
