"""Per-request streams of the async engine, on the event loop.

``RequestStreams`` holds the live requests' streams: each output is pushed
to its request's stream, and only then does the observer hear of it. Every
request ends exactly once: with its last output from a step, or through
``end`` (aborted, refused by the scheduler, the engine died), and the
observer's ``on_finished`` hears of each either way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from engine.observer import GuardedObserver, RequestTiming
from engine.output_processor import RequestOutput


class RequestStream:
    """Async iterator of one request's outputs; `close()` aborts it if unfinished."""

    def __init__(self, request_id: str, abort: Callable[[list[str]], object]) -> None:
        self.request_id = request_id
        self.timing = RequestTiming(time.monotonic())
        self.finished = False
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def drain_ready(self) -> list[RequestOutput]:
        """Outputs already queued (to coalesce into one message for a slow reader)."""
        ready: list[RequestOutput] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._queue.put_nowait(item)  # raised by the next __anext__
                break
            ready.append(item)
            if item.finished:
                self.finished = True
                break
        return ready

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._abort([self.request_id])

    def push(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


class RequestStreams:
    """The live requests' streams; ``idle`` is set while there are none."""

    def __init__(self, observer: GuardedObserver, abort: Callable[[list[str]], object]) -> None:
        self._observer = observer
        self._abort = abort
        self._streams: dict[str, RequestStream] = {}
        self.idle = asyncio.Event()
        self.idle.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def ids(self) -> list[str]:
        return list(self._streams)

    def open(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, self._abort)
        self._streams[request_id] = stream
        self.idle.clear()
        return stream

    def deliver(self, output: RequestOutput, now: float) -> None:
        """A step's output to its stream (ignored for a request no longer live)."""
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            self._remove(output.request_id)
        stream.push(output if output.error is None else output.error)
        self._observer.on_output(stream.timing, output, now)

    def end(self, output: RequestOutput, error: BaseException | None = None) -> None:
        """Ends a live request outside a step's outputs with its final
        ``output``: its stream gets that output, or raises ``error``."""
        stream = self._remove(output.request_id)
        stream.push(output if error is None else error)
        self._observer.on_output(stream.timing, output, time.monotonic())

    def _remove(self, request_id: str) -> RequestStream:
        stream = self._streams.pop(request_id)
        if not self._streams:
            self.idle.set()
        return stream
