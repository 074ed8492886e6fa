"""RequestStreams and the GuardedObserver: outputs first, metrics never in the way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from engine.observer import GuardedObserver, RequestTiming
from engine.output_processor import RequestOutput
from engine.request import FinishReason
from engine.stats import SchedulerStats
from engine.streams import RequestStreams


def _output(rid: str, token_ids: list[int], reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(rid, None, [1], "", token_ids, None, reason, None, len(token_ids), 0)


@dataclass
class Recorder:
    calls: list[str] = field(default_factory=list)
    raise_on: set[str] = field(default_factory=set)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.raise_on:
            raise ValueError(name)

    def on_step(self, stats: SchedulerStats) -> None:
        self._call("step")

    def on_engine_step(self, seconds: float) -> None:
        self._call("engine_step")

    def on_first_token(self, seconds_since_arrival: float) -> None:
        self._call("first_token")

    def on_tokens(self, num_tokens: int, seconds_since_previous: float) -> None:
        self._call(f"tokens:{num_tokens}")

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self._call(f"finished:{output.finish_reason}")

    def on_metrics_error(self, where: str) -> None:
        self.calls.append(f"error:{where}")


def test_the_observer_hears_first_token_later_tokens_and_the_end() -> None:
    recorder = Recorder()
    observer = GuardedObserver(recorder)
    timing = RequestTiming(arrival=0.0)
    observer.on_output(timing, _output("a", [5]), 1.0)
    observer.on_output(timing, _output("a", []), 1.5)  # no tokens: nothing to time
    observer.on_output(timing, _output("a", [6, 7], FinishReason.LENGTH), 2.0)
    assert recorder.calls == ["first_token", "tokens:2", "finished:length"]
    assert timing.last_token_at == 2.0


def test_a_raising_observer_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder(raise_on={"step", "first_token"})
    observer = GuardedObserver(recorder)
    for _ in range(3):
        observer.on_step(SchedulerStats())
        observer.on_output(RequestTiming(0.0), _output("a", [5]), 1.0)
    observer.on_engine_step(0.01)
    assert observer.errors == 6
    assert recorder.calls.count("error:step") == 3 and recorder.calls.count("error:request") == 3
    logged = [r for r in caplog.records if "outputs were delivered regardless" in r.message]
    assert len(logged) == 2  # once per (where, exception type)
    GuardedObserver(None).on_step(SchedulerStats())  # no observer: nothing to call


def test_streams_end_once_and_report_idle() -> None:
    async def go() -> None:
        recorder = Recorder()
        aborted: list[list[str]] = []
        streams = RequestStreams(GuardedObserver(recorder), aborted.append)
        assert streams.idle.is_set()
        done, failed, closed = streams.open("done"), streams.open("failed"), streams.open("closed")
        assert not streams.idle.is_set() and len(streams) == 3
        streams.deliver(_output("done", [5]), 1.0)
        streams.deliver(_output("done", [6], FinishReason.STOP), 2.0)
        streams.deliver(_output("done", [7]), 3.0)  # no longer live: dropped
        assert [o.token_ids async for o in done] == [[5], [6]]
        streams.end(_output("failed", [], FinishReason.ERROR), RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await failed.__anext__()
        closed.close()  # the client went away: the owner aborts it
        closed.close()
        assert aborted == [["closed"]]
        streams.end(_output("closed", [], FinishReason.ABORT))
        assert streams.idle.is_set() and "closed" not in streams
        finished = [c for c in recorder.calls if c.startswith("finished")]
        assert finished == ["finished:stop", "finished:error", "finished:abort"]

    asyncio.run(go())


def test_a_slow_reader_gets_what_piled_up_at_once() -> None:
    async def go() -> None:
        streams = RequestStreams(GuardedObserver(None), lambda ids: None)
        stream = streams.open("a")
        for token in (5, 6):
            streams.deliver(_output("a", [token]), 1.0)
        streams.deliver(_output("a", [7], FinishReason.LENGTH), 1.0)
        first = await stream.__anext__()
        rest = stream.drain_ready()
        assert [o.token_ids for o in [first, *rest]] == [[5], [6], [7]]
        assert stream.finished
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(go())
