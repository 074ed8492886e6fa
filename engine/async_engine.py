"""AsyncEngine: the asyncio front door to one EngineCore, for the service.

Threads: the EngineCore runs in one dedicated thread (it is not thread-safe
and never blocks the event loop); everything else here runs on the event
loop. They talk through two one-way channels:

* loop -> engine: a command queue (add a request, abort requests, stop). The
  engine thread applies every queued command before each step, so an abort
  takes effect, and frees the request's blocks, before the next step runs.
* engine -> loop: after each step, one `call_soon_threadsafe` hands the
  step's outputs to the loop, which detokenizes them (`OutputProcessor`),
  checks stop strings and feeds each request's stream.

Detokenizing on the loop rather than in the engine thread lets it overlap
the next step's forward pass, which releases the GIL inside torch. Why a
thread and not a process (as vLLM does): benchmarks/README.md, "Serving".

A request's life: `submit()` checks admission (draining, duplicate id, queue
bound) and returns a `RequestStream`; iterate it for `StreamDelta`s until
one is `finished`; `close()` it in a `finally` so a client that goes away
aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from connectors.kv_transfer_params import KVTransferParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.input_processor import InputProcessor, InvalidRequestError
from engine.kv_cache.events import AllBlocksCleared, KVCacheEvent
from engine.models.loader import load_tokenizer
from engine.output_processor import OutputProcessor, RequestOutput, TokenLogprob
from engine.outputs import EngineCoreOutputs
from engine.request import Request, RequestStatus
from engine.stats import SchedulerStats, TransferFailure
from engine.worker.worker import WorkerInfo

logger = logging.getLogger(__name__)


class EngineDrainingError(RuntimeError):
    """The engine is draining (shutting down) and admits no new requests."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can complete."""


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None  # the stop string or stop token id matched
    num_prompt_tokens: int
    num_generated_tokens: int  # cumulative
    num_cached_tokens: int
    kv_transfer_params: KVTransferParams | None


class EngineObserver(Protocol):
    """Receives timings and counts (the service's Prometheus metrics).

    Called on the event loop after the step's outputs were delivered; an
    exception from any method is logged (once per method and exception
    type), counted (``EngineStatus.metrics_errors``, ``on_metrics_error``)
    and otherwise ignored: metrics never cost a request its tokens.
    """

    def on_step(self, stats: SchedulerStats) -> None: ...

    def on_engine_step(self, seconds: float) -> None: ...

    def on_first_token(self, seconds_since_arrival: float) -> None: ...

    def on_tokens(self, num_tokens: int, seconds_since_previous: float) -> None: ...

    def on_finished(self, delta: StreamDelta, seconds_since_arrival: float) -> None: ...

    def on_metrics_error(self, where: str) -> None:
        """A call above raised: ``where`` is "step" (on_step),
        "engine_step" or "request" (the per-request calls)."""


@dataclass
class EngineStatus:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    uptime_seconds: float = 0.0
    draining: bool = False
    recent_step_ms_p50: float = 0.0
    recent_token_step_ms_p50: float = 0.0
    kv_connector_queries: int = 0
    kv_connector_hits: int = 0
    # Degradations, cumulative since start (see engine.stats).
    kv_recomputed_tokens: int = 0
    kv_leases_lapsed: int = 0
    kv_transfer_failures: dict[TransferFailure, int] = field(default_factory=dict)
    # Finished requests whose KV blocks a connector still holds (a prefill
    # pod's blocks waiting for the decode pod's READ): a drain waits for them.
    kv_held_requests: int = 0
    # Observer (metrics) calls that raised; outputs were delivered anyway.
    metrics_errors: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


# --- one request's stream ---------------------------------------------------------


class RequestStream:
    """Async iterator of one request's deltas; `close()` aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request: Request) -> None:
        self.request_id = request.request_id
        self.arrival = time.monotonic()
        self.last_token_at: float | None = None
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def drain_ready(self) -> list[StreamDelta]:
        """Deltas already queued (to coalesce into one message for a slow reader)."""
        ready: list[StreamDelta] = []
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
            self._engine.abort([self.request_id])

    def _push(self, item: StreamDelta | BaseException) -> None:
        self._queue.put_nowait(item)


# --- the engine thread --------------------------------------------------------------


@dataclass
class _Commands:
    """Commands from the loop to the engine thread, applied before each step."""

    lock: threading.Condition = field(default_factory=threading.Condition)
    queue: deque[tuple[str, Any]] = field(default_factory=deque)

    def put(self, kind: str, payload: Any = None) -> None:
        with self.lock:
            self.queue.append((kind, payload))
            self.lock.notify()

    def take(self, wait: bool) -> list[tuple[str, Any]]:
        with self.lock:
            if wait:
                while not self.queue:
                    self.lock.wait()
            items = list(self.queue)
            self.queue.clear()
            return items


class _EngineThread(threading.Thread):
    """Builds the EngineCore and then steps it, all on this one thread.

    Building it here matters: torch's CPU kernels run OpenMP thread teams,
    one per calling thread, and a second team left over from loading the
    model on another thread measured a 2x slower decode step on two cores.
    """

    def __init__(self, build: Callable[[], EngineCore], commands: _Commands) -> None:
        super().__init__(name="tandem-engine", daemon=True)
        self.build = build
        self.commands = commands
        self.ready: threading.Event = threading.Event()
        self.core: EngineCore | None = None
        self.build_error: BaseException | None = None
        self.deliver: Callable[[dict[int, EngineCoreOutputs], int, float], None] = (
            lambda outputs, applied, seconds: None
        )
        self.fail: Callable[[BaseException], None] = lambda exc: None
        self.reject: Callable[[str, ValueError], None] = lambda request_id, exc: None

    def run(self) -> None:
        try:
            self.core = self.build()
        except BaseException as exc:
            self.build_error = exc
            return
        finally:
            self.ready.set()
        self._serve(self.core)

    def _serve(self, core: EngineCore) -> None:
        applied = 0  # adds applied so far, reported with each step
        try:
            while True:
                commands = self.commands.take(wait=not core.has_work())
                for kind, payload in commands:
                    if kind == "stop":
                        return
                    if kind == "add":
                        self._add(core, payload)
                        applied += 1
                    elif kind == "abort":
                        ids, status = payload
                        core.abort_requests(ids, status)
                    elif kind == "release":
                        core.release_held_kv(payload)
                if core.has_work():
                    start = time.perf_counter()
                    outputs = core.step()
                    self.deliver(outputs, applied, time.perf_counter() - start)
                elif commands:
                    # Idle now (e.g. the last request was aborted): report
                    # the freed blocks instead of the last step's figures.
                    self.deliver(core.stats_only(), applied, 0.0)
        except BaseException as exc:  # the loop must hear of any failure
            logger.exception("engine thread failed")
            self.fail(exc)
        finally:
            core.shutdown()

    def _add(self, core: EngineCore, request: Request) -> None:
        """One request into the scheduler. What the scheduler refuses (an id
        still in use by a finished request whose KV blocks it holds for a
        remote decode, which the front door cannot see) fails that request
        alone, not the engine and everyone else's work."""
        try:
            core.add_request(request)
        except ValueError as exc:
            logger.warning("request %s refused by the scheduler: %s", request.request_id, exc)
            self.reject(request.request_id, exc)


# --- the front door -----------------------------------------------------------------


class AsyncEngine:
    def __init__(
        self,
        thread: _EngineThread,
        tokenizer: PreTrainedTokenizerBase,
        loop: asyncio.AbstractEventLoop,
        *,
        max_waiting_requests: int = 1024,
        observer: EngineObserver | None = None,
    ) -> None:
        """Use `AsyncEngine.create`: it starts the engine thread, which loads
        the model, without blocking the event loop."""
        core = thread.core
        if core is None:
            raise RuntimeError("the engine thread has not built its EngineCore")
        info = core.info
        self.config = core.config
        self.info: WorkerInfo = info
        self.tokenizer = tokenizer
        self.inputs = InputProcessor(
            tokenizer,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            eos_token_id=info.eos_token_id,
        )
        self.max_waiting_requests = max_waiting_requests
        self.observer = observer
        self._loop = loop
        self._processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._status = EngineStatus()
        self._started = time.monotonic()
        self._submitted = 0  # adds sent to the engine thread
        self._applied = 0  # adds the engine thread reported applied
        self._dead: BaseException | None = None
        self._subscribers: set[KvEventSubscription] = set()
        self._step_seconds: deque[float] = deque(maxlen=128)
        # (step seconds, tokens it produced after a request's first): the
        # token-weighted step time, what inter-token latency is compared with.
        self._token_steps: deque[tuple[float, int]] = deque(maxlen=128)
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        # (observer method, exception type) already logged: log each once.
        self._metrics_failures_logged: set[tuple[str, str]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        # Set while no finished request's KV is held for a peer to read.
        self._kv_released = asyncio.Event()
        self._kv_released.set()
        # (callback, args) for the loop, in the engine thread's order.
        self._handoff: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._hand_off, name="engine-handoff", daemon=True).start()
        self._commands = thread.commands
        self._thread = thread
        thread.deliver, thread.fail = self._from_engine, self._engine_failed
        thread.reject = self._engine_rejected

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        *,
        max_waiting_requests: int = 1024,
        observer: EngineObserver | None = None,
    ) -> AsyncEngine:
        thread = _EngineThread(lambda: EngineCore(config), _Commands())
        thread.start()
        await asyncio.to_thread(thread.ready.wait)
        if thread.core is None:
            raise thread.build_error or RuntimeError("the engine thread failed to start")
        tokenizer = await asyncio.to_thread(load_tokenizer, thread.core.info.model_path)
        return cls(
            thread,
            tokenizer,
            asyncio.get_running_loop(),
            max_waiting_requests=max_waiting_requests,
            observer=observer,
        )

    # --- admission --------------------------------------------------------------

    def submit(self, request: Request, prompt_text: str | None = None) -> RequestStream:
        """Queue `request` (already validated by `self.inputs`) and return its stream.

        Raises EngineDeadError, EngineDrainingError, InvalidRequestError
        ("request_id", for an id that is live) or QueueFullError.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead!r}")
        if self._status.draining:
            raise EngineDrainingError("the server is draining and accepts no new requests")
        if request.request_id in self._streams:
            raise InvalidRequestError(
                "request_id", f"{request.request_id!r} is already in use by a live request"
            )
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{self.num_waiting} requests are waiting (the bound is "
                f"{self.max_waiting_requests}); retry later"
            )
        stream = RequestStream(self, request)
        self._streams[request.request_id] = stream
        self._processor.add_request(request, prompt_text)
        self._idle.clear()
        self._submitted += 1
        self._commands.put("add", request)
        return stream

    def abort(self, request_ids: list[str]) -> list[str]:
        """Aborts the live requests among `request_ids`; returns those ids.
        Their streams end with a finished delta, finish_reason "abort".

        The others may have finished with KV blocks still held for a remote
        decode (a prefill leg): those blocks are released, since whoever
        aborts them says no decode will fetch them (the router, when the
        decode pod refused the request). Unknown ids are ignored.
        """
        live = [rid for rid in request_ids if rid in self._streams]
        finished = [rid for rid in request_ids if rid not in self._streams]
        if finished:
            self._commands.put("release", finished)
        if not live:
            return []
        self._commands.put("abort", (live, RequestStatus.FINISHED_ABORTED))
        for rid in live:
            self._end(rid, "abort")
        self._check_idle()
        return live

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's waiting queue as of the
        last step plus those submitted since that the engine has not taken."""
        return self._status.num_waiting + (self._submitted - self._applied)

    @property
    def num_live(self) -> int:
        return len(self._streams)

    # --- status, events, shutdown --------------------------------------------------

    def status(self) -> EngineStatus:
        status = EngineStatus(**vars(self._status))
        status.num_waiting = self.num_waiting
        status.uptime_seconds = time.monotonic() - self._started
        if self._step_seconds:
            status.recent_step_ms_p50 = statistics.median(self._step_seconds) * 1e3
        if self._token_steps:
            status.recent_token_step_ms_p50 = _weighted_median(self._token_steps) * 1e3
        return status

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def connector_health(self) -> str | None:
        """Why the KV connector is not working (a dead or wedged transfer
        thread), or None. Safe from any thread: it reads flags only."""
        core = self._thread.core
        return core.connector_health() if core is not None else None

    def side_channel_payload(self) -> bytes | None:
        """The KV connector's handshake for its peers, or None. Safe from
        any thread: the connector computed it when the engine started."""
        core = self._thread.core
        connector = core.worker_connector if core is not None else None
        return connector.side_channel_payload() if connector is not None else None

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Called on the event loop if the engine thread fails (e.g. to turn
        health NOT_SERVING)."""
        self._failure_listeners.append(listener)

    def subscribe_kv_events(self, max_pending: int = 1024) -> KvEventSubscription:
        sub = KvEventSubscription(self, max_pending)
        self._subscribers.add(sub)
        return sub

    def begin_drain(self) -> None:
        self._status.draining = True

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until no request is live; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def num_held_kv(self) -> int:
        """Finished requests whose KV blocks the connector still holds (as
        of the last step): a prefill pod's blocks a decode pod is to READ."""
        return self._status.kv_held_requests

    async def wait_kv_released(self, timeout: float) -> bool:
        """Waits until the connector holds no finished request's KV (each
        hold ends with the peer's read, its refusal, or the lease lapsing);
        False if `timeout` passed first or the engine died."""
        if self._dead is not None or self._kv_released.is_set():
            return self._kv_released.is_set()
        try:
            await asyncio.wait_for(self._kv_released.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def shutdown(self) -> None:
        """Aborts what is left and stops the engine thread."""
        self.begin_drain()
        self.abort(list(self._streams))
        self._commands.put("stop")
        await asyncio.to_thread(self._thread.join, 30)
        self._handoff.put(None)
        for sub in list(self._subscribers):
            sub.close()

    # --- engine -> loop ------------------------------------------------------------

    def _from_engine(
        self, outputs: dict[int, EngineCoreOutputs], applied: int, step_seconds: float
    ) -> None:
        """Engine thread: hand a step's outputs (and how long it took) to the loop.

        Through the handoff thread: waking the loop is a write to its
        self-pipe, which releases the GIL, and getting the GIL back from a
        loop busy with the last step's 64 streams cost the next step ~3-5 ms.
        Putting into a SimpleQueue never releases the GIL.
        """
        self._handoff.put((self._on_step, (outputs, applied, step_seconds, time.time())))

    def _hand_off(self) -> None:
        """Handoff thread: wakes the loop for each item, in order."""
        while (item := self._handoff.get()) is not None:
            try:
                self._loop.call_soon_threadsafe(item[0], *item[1])
            except RuntimeError:  # the loop closed: nobody is listening
                return

    def _engine_rejected(self, request_id: str, exc: ValueError) -> None:
        # Through the handoff queue, behind the steps already handed off.
        self._handoff.put((self._on_rejected, (request_id, exc)))

    def _on_rejected(self, request_id: str, exc: ValueError) -> None:
        if request_id in self._streams:
            # The scheduler's messages start with the field they are about.
            field_name, _, message = str(exc).partition(": ")
            error = InvalidRequestError(field_name, message or field_name)
            self._end(request_id, "error", error)
        self._check_idle()

    def _engine_failed(self, exc: BaseException) -> None:
        # The same queue as the steps, so the last step's tokens come first.
        self._handoff.put((self._on_failure, (exc,)))

    def _on_failure(self, exc: BaseException) -> None:
        self._dead = exc
        error = EngineDeadError(f"the engine failed: {exc!r}")
        for rid in list(self._streams):
            self._end(rid, "error", error)
        self._check_idle()
        for listener in self._failure_listeners:
            listener(exc)

    def _on_step(
        self,
        outputs: dict[int, EngineCoreOutputs],
        applied: int,
        step_seconds: float,
        timestamp: float,
    ) -> None:
        self._applied = applied
        now = time.monotonic()
        later_tokens = 0
        # Tokens first: nothing the figures below do may cost a request them.
        for engine_outputs in outputs.values():
            results, stop_matched = self._processor.process(engine_outputs.outputs)
            if stop_matched:
                self._commands.put("abort", (stop_matched, RequestStatus.FINISHED_STOPPED))
            for out in results:
                # A request's first token ends its TTFT, not an inter-token gap.
                later_tokens += min(len(out.new_token_ids), len(out.token_ids) - 1)
                self._deliver(out, now)
        if step_seconds > 0:
            self._step_seconds.append(step_seconds)
            if later_tokens > 0:
                self._token_steps.append((step_seconds, later_tokens))
            if self.observer is not None:
                try:
                    self.observer.on_engine_step(step_seconds)
                except Exception as exc:
                    self._metrics_failed("engine_step", exc)
        for engine_outputs in outputs.values():
            if engine_outputs.scheduler_stats is not None:
                self._record_stats(engine_outputs.scheduler_stats)
            if engine_outputs.kv_events:
                for sub in self._subscribers:
                    sub.publish(engine_outputs.kv_events, timestamp)
        self._check_idle()

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        new_logprobs = out.logprobs[-len(out.new_token_ids) :] if out.logprobs else []
        if not out.new_token_ids:
            new_logprobs = []
        delta = self._delta(out, new_logprobs)
        if out.finished:
            del self._streams[out.request_id]
        stream._push(delta)
        self._notify(stream, delta, now)

    def _notify(self, stream: RequestStream, delta: StreamDelta, now: float) -> None:
        """The observer hears of a delivered delta; a failure there is
        counted, never raised into delivery."""
        if self.observer is not None:
            try:
                self._observe(self.observer, stream, delta, now)
            except Exception as exc:
                self._metrics_failed("request", exc)

    @staticmethod
    def _observe(
        observer: EngineObserver, stream: RequestStream, delta: StreamDelta, now: float
    ) -> None:
        if delta.new_token_ids:
            if stream.last_token_at is None:
                observer.on_first_token(now - stream.arrival)
            else:
                observer.on_tokens(len(delta.new_token_ids), now - stream.last_token_at)
            stream.last_token_at = now
        if delta.finished:
            observer.on_finished(delta, now - stream.arrival)

    def _end(self, request_id: str, reason: str, error: BaseException | None = None) -> None:
        """Ends a live request outside a step's outputs (aborted, refused by
        the scheduler, or the engine died): it leaves the live set, the
        observer hears of it (as of every finished request, exactly once),
        and its stream ends with a final delta, or raises ``error``."""
        stream = self._streams.pop(request_id)
        out = self._processor.abort(request_id)
        if out is None:  # not expected: every live request has a state
            out = RequestOutput(request_id, None, [], finished=True)
        out.finish_reason = reason
        delta = self._delta(out, [])
        stream._push(delta if error is None else error)
        self._notify(stream, delta, time.monotonic())

    @staticmethod
    def _delta(out: RequestOutput, new_logprobs: list[TokenLogprob]) -> StreamDelta:
        return StreamDelta(
            request_id=out.request_id,
            new_token_ids=list(out.new_token_ids),
            new_text=out.delta_text,
            new_logprobs=list(new_logprobs),
            finished=out.finished,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generated_tokens=len(out.token_ids),
            num_cached_tokens=out.num_cached_tokens,
            kv_transfer_params=out.kv_transfer_params,
        )

    def _record_stats(self, stats: SchedulerStats) -> None:
        s = self._status
        s.num_running = stats.num_running_reqs
        s.num_waiting = stats.num_waiting_reqs
        s.kv_cache_usage = stats.kv_cache_usage
        s.num_preemptions = stats.num_preemptions
        s.prefix_cache_queries += stats.prefix_cache_stats.queries
        s.prefix_cache_hits += stats.prefix_cache_stats.hits
        connector = stats.connector_prefix_cache_stats
        if connector is not None:
            s.kv_connector_queries += connector.queries
            s.kv_connector_hits += connector.hits
        s.kv_held_requests = stats.num_held_requests
        if stats.num_held_requests:
            self._kv_released.clear()
        else:
            self._kv_released.set()
        s.kv_recomputed_tokens = stats.num_kv_recomputed_tokens
        totals = stats.kv_connector_totals
        s.kv_leases_lapsed = totals.leases_lapsed
        s.kv_transfer_failures = totals.failures  # a snapshot: never mutated
        if self.observer is not None:
            try:
                self.observer.on_step(stats)
            except Exception as exc:
                self._metrics_failed("step", exc)

    def _metrics_failed(self, where: str, exc: Exception) -> None:
        """An observer call raised: count it, log it once per (where, type)."""
        self._status.metrics_errors += 1
        key = (where, type(exc).__name__)
        if key not in self._metrics_failures_logged:
            self._metrics_failures_logged.add(key)
            logger.error(
                "metrics (%s) raised %r; the outputs were delivered regardless "
                "(further %s there are counted in metrics_errors, not logged)",
                where,
                exc,
                type(exc).__name__,
                exc_info=exc,
            )
        try:
            assert self.observer is not None
            self.observer.on_metrics_error(where)
        except Exception:  # a broken observer: the status still counts it
            pass

    def _check_idle(self) -> None:
        if not self._streams:
            self._idle.set()


# --- KV events ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    sequence: int
    timestamp: float
    events: list[KVCacheEvent]


class KvEventSubscription:
    """A bounded queue of KV event batches for one subscriber. When it is full
    the oldest batches are dropped and the next batch starts with an
    AllBlocksCleared, so the subscriber knows to forget what it knew."""

    def __init__(self, engine: AsyncEngine, max_pending: int) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue()
        self._max_pending = max_pending
        self._sequence = 0
        self._overflowed = False

    def publish(self, events: list[KVCacheEvent], timestamp: float) -> None:
        if self._queue.qsize() >= self._max_pending:
            while not self._queue.empty():
                self._queue.get_nowait()
            self._overflowed = True
        batch_events = list(events)
        if self._overflowed:
            batch_events.insert(0, AllBlocksCleared())
            self._overflowed = False
        self._sequence += 1
        self._queue.put_nowait(KvEventBatch(self._sequence, timestamp, batch_events))

    async def next(self) -> KvEventBatch | None:
        """The next batch, or None once the subscription is closed."""
        return await self._queue.get()

    def close(self) -> None:
        self._engine._subscribers.discard(self)
        self._queue.put_nowait(None)


def _weighted_median(samples: Iterable[tuple[float, int]]) -> float:
    """The value below which half the total weight lies."""
    ordered = sorted(samples)
    half = sum(weight for _, weight in ordered) / 2
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]
