"""Delivery: what the event loop does with each event the engine thread reports.

A step's outputs go through the shared ``FrontEnd`` (detokenizing, stop
strings, status) to each request's stream first; only then do the observer
(metrics) and the KV event subscribers hear of the step, so nothing they do
can cost a request its tokens. A request the scheduler refused, and every
live request when the engine thread fails, ends here with an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from engine.commands import AddRefused, EngineEvent, EngineFailed, StepDone
from engine.errors import DuplicateRequestIdError, EngineDeadError
from engine.frontend import FrontEnd
from engine.kv_events import KvEventHub
from engine.observer import GuardedObserver
from engine.request import FinishReason
from engine.streams import RequestStreams


class Delivery:
    """Called on the loop with each engine event, in the thread's order."""

    def __init__(
        self,
        front: FrontEnd,
        streams: RequestStreams,
        observer: GuardedObserver,
        kv_events: KvEventHub,
        on_added: Callable[[int], None],
    ) -> None:
        self._front = front
        self._streams = streams
        self._observer = observer
        self._kv_events = kv_events
        self._on_added = on_added  # told how many requests the core has taken
        # Why the engine thread failed, once it has.
        self.dead: BaseException | None = None
        self.failure_listeners: list[Callable[[BaseException], None]] = []
        # Set while no finished request's KV is held for a peer to read.
        self.kv_released = asyncio.Event()
        self.kv_released.set()

    def __call__(self, event: EngineEvent) -> None:
        match event:
            case StepDone():
                self._on_step(event)
            case AddRefused(request_id):
                self._on_refused(request_id)
            case EngineFailed(error):
                self._on_failure(error)

    def _on_step(self, event: StepDone) -> None:
        self._on_added(event.num_added)
        step = self._front.process_step(event.outputs, event.seconds)
        now = time.monotonic()
        # Tokens first: nothing the figures below do may cost a request them.
        for output in step.outputs:
            self._streams.deliver(output, now)
        if event.seconds > 0:
            self._observer.on_engine_step(event.seconds)
        for stats in step.scheduler_stats:
            self._observer.on_step(stats)
        if step.kv_events:
            self._kv_events.publish(step.kv_events, event.timestamp)
        if self._front.status.kv_held_requests:
            self.kv_released.clear()
        else:
            self.kv_released.set()

    def _on_refused(self, request_id: str) -> None:
        """The front door checked everything of the request but whether the
        scheduler still holds its id (a finished request's, whose KV it
        keeps for a remote decode): that is what the scheduler refused."""
        if request_id in self._streams:
            error = DuplicateRequestIdError(
                request_id, "a finished request whose KV blocks are held for a remote decode"
            )
            self._streams.end(self._front.abort(request_id, FinishReason.ERROR), error)

    def _on_failure(self, exc: BaseException) -> None:
        self.dead = exc
        error = EngineDeadError(f"the engine failed: {exc!r}")
        for rid in self._streams.ids():
            self._streams.end(self._front.abort(rid, FinishReason.ERROR), error)
        for listener in self.failure_listeners:
            listener(exc)
