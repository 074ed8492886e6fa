"""The engine's observer (the service's Prometheus metrics), called safely.

Metrics never cost a request its tokens: the async engine delivers a
step's outputs first and only then tells the observer, through
``GuardedObserver``, which logs a raising call (once per place and
exception type), counts it (``errors``, reported as ``metrics_errors``),
tells the observer's ``on_metrics_error`` and otherwise ignores it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from engine.output_processor import RequestOutput
from engine.stats import SchedulerStats

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Receives timings and counts, on the event loop, after the step's
    outputs were delivered."""

    def on_step(self, stats: SchedulerStats) -> None: ...

    def on_engine_step(self, seconds: float) -> None: ...

    def on_first_token(self, seconds_since_arrival: float) -> None: ...

    def on_tokens(self, num_tokens: int, seconds_since_previous: float) -> None: ...

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        """Once per request, whatever ended it (its last output)."""

    def on_metrics_error(self, where: str) -> None:
        """A call above raised: ``where`` is "step" (on_step),
        "engine_step" or "request" (the per-request calls)."""


@dataclass
class RequestTiming:
    """When a request arrived and last got tokens (monotonic seconds)."""

    arrival: float
    last_token_at: float | None = None


class GuardedObserver:
    """Calls an optional EngineObserver; a call that raises is counted and
    logged, never raised."""

    def __init__(self, observer: EngineObserver | None) -> None:
        self._observer = observer
        self.errors = 0
        # (where, exception type) already logged: log each once.
        self._logged: set[tuple[str, str]] = set()

    def on_step(self, stats: SchedulerStats) -> None:
        if self._observer is not None:
            try:
                self._observer.on_step(stats)
            except Exception as exc:
                self._failed("step", exc)

    def on_engine_step(self, seconds: float) -> None:
        if self._observer is not None:
            try:
                self._observer.on_engine_step(seconds)
            except Exception as exc:
                self._failed("engine_step", exc)

    def on_output(self, timing: RequestTiming, output: RequestOutput, now: float) -> None:
        """A request's delivered output: its first token, later tokens, its end."""
        if self._observer is not None:
            try:
                _observe(self._observer, timing, output, now)
            except Exception as exc:
                self._failed("request", exc)

    def _failed(self, where: str, exc: Exception) -> None:
        self.errors += 1
        key = (where, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            logger.error(
                "metrics (%s) raised %r; the outputs were delivered regardless "
                "(further %s there are counted in metrics_errors, not logged)",
                where,
                exc,
                type(exc).__name__,
                exc_info=exc,
            )
        try:
            assert self._observer is not None
            self._observer.on_metrics_error(where)
        except Exception:  # a broken observer: the count above still has it
            pass


def _observe(
    observer: EngineObserver, timing: RequestTiming, output: RequestOutput, now: float
) -> None:
    if output.token_ids:
        if timing.last_token_at is None:
            observer.on_first_token(now - timing.arrival)
        else:
            observer.on_tokens(len(output.token_ids), now - timing.last_token_at)
        timing.last_token_at = now
    if output.finished:
        observer.on_finished(output, now - timing.arrival)
