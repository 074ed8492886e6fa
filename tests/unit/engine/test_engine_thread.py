"""The engine thread: typed commands in, typed events out, over a scripted core."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.commands import (
    AbortRequests,
    AddRefused,
    AddRequest,
    Command,
    CommandQueue,
    EngineEvent,
    EngineFailed,
    ReleaseHeldKV,
    StepDone,
    Stop,
)
from engine.engine_thread import EngineThread
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.unit.engine.scripted_core import ScriptedCore


def _request(rid: str, max_tokens: int = 2) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def test_commands_come_out_in_order_and_take_waits_for_one() -> None:
    queue = CommandQueue()
    taken: list[list[Command]] = []
    waiter = threading.Thread(target=lambda: taken.append(list(queue.take(wait=True))))
    waiter.start()
    queue.put(ReleaseHeldKV(["x"]))
    waiter.join(10)
    assert taken == [[ReleaseHeldKV(["x"])]]
    commands: list[Command] = [AbortRequests(["a"]), Stop(), AddRequest(_request("b"))]
    for command in commands:
        queue.put(command)
    assert queue.take(wait=False) == commands
    assert queue.take(wait=False) == []
    assert AbortRequests(["a"]).status == RequestStatus.FINISHED_ABORTED


async def _collect(thread: EngineThread, until: type, deadline: float = 30.0) -> list[EngineEvent]:
    """Events the thread hands to the loop, up to the first of type ``until``."""
    events: list[EngineEvent] = []
    done = asyncio.Event()

    def on_event(event: EngineEvent) -> None:
        events.append(event)
        if isinstance(event, until):
            done.set()

    thread.handoff.start(asyncio.get_running_loop(), on_event)
    await asyncio.wait_for(done.wait(), deadline)
    return events


def test_the_thread_applies_each_command_to_the_core() -> None:
    core = ScriptedCore(held={"held"}, hold_kv=True)

    async def go() -> list[EngineEvent]:
        thread, built = await EngineThread.launch(lambda: core)  # type: ignore[arg-type,return-value]
        assert built is core  # type: ignore[comparison-overlap]
        thread.add_request(_request("a", max_tokens=1000))
        thread.add_request(_request("held"))  # the scheduler refuses it
        thread.abort_requests(["a"], RequestStatus.FINISHED_STOPPED)
        thread.release_held_kv(["done"])
        events = await _collect(thread, AddRefused)
        thread.stop()
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
        thread.handoff.close()
        return events

    events = asyncio.run(go())
    assert [e for e in events if isinstance(e, AddRefused)] == [AddRefused("held")]
    assert core.aborted == [("a", RequestStatus.FINISHED_STOPPED)]
    assert core.released == ["done"]


def test_steps_report_how_many_requests_the_core_took() -> None:
    async def go() -> list[EngineEvent]:
        thread, _ = await EngineThread.launch(lambda: ScriptedCore())  # type: ignore[arg-type,return-value]
        thread.add_request(_request("a", max_tokens=1))
        events = await _collect(thread, StepDone)
        thread.stop()
        await asyncio.to_thread(thread.join, 10)
        thread.handoff.close()
        return events

    (step,) = asyncio.run(go())
    assert isinstance(step, StepDone)
    assert step.num_added == 1 and step.seconds > 0
    assert [o.request_id for o in step.outputs.outputs] == ["a"]


def test_take_with_a_timeout_returns_empty_when_nothing_came() -> None:
    queue = CommandQueue()
    start = time.monotonic()
    assert queue.take(wait=True, timeout=0.05) == []
    assert time.monotonic() - start >= 0.05


def test_an_idle_engine_polls_a_connector_that_asks_for_it() -> None:
    """A prefill pod's NIXL connector must be polled while the engine is
    idle: a peer's READ of its blocks progresses only then."""
    core = ScriptedCore()
    core.idle_poll_seconds = 0.01

    async def go() -> None:
        thread, _ = await EngineThread.launch(lambda: core)  # type: ignore[arg-type,return-value]
        await asyncio.sleep(0.3)
        thread.stop()
        await asyncio.to_thread(thread.join, 10)
        thread.handoff.close()

    asyncio.run(go())
    assert core.idle_polls >= 5


def test_a_failing_step_is_reported_and_ends_the_thread() -> None:
    async def go() -> list[EngineEvent]:
        thread, _ = await EngineThread.launch(lambda: ScriptedCore(fail_at=1))  # type: ignore[arg-type,return-value]
        thread.add_request(_request("a"))
        events = await _collect(thread, EngineFailed)
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
        thread.handoff.close()
        return events

    (failed,) = asyncio.run(go())
    assert isinstance(failed, EngineFailed) and "boom" in repr(failed.error)


def test_a_core_that_cannot_be_built_raises_its_error() -> None:
    def build() -> ScriptedCore:
        raise OSError("no model here")

    async def go() -> None:
        await EngineThread.launch(build)  # type: ignore[arg-type]

    with pytest.raises(OSError, match="no model here"):
        asyncio.run(go())
