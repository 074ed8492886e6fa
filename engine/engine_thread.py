"""The engine thread, which owns the EngineCore, and its hand-off to the loop.

The core runs on one dedicated thread (it is not thread-safe and must never
block the event loop). ``EngineThread`` is the core's control surface seen
from the loop: ``add_request``, ``abort_requests`` and ``release_held_kv``
queue typed commands (``engine.commands``) that the thread applies before
its next step. Each step's outputs go back as events through a
``LoopHandoff`` (``handoff``). Why a thread and not a process (as vLLM does):
benchmarks/JOURNAL.md, "serving_bench.py".
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from engine.commands import (
    AbortRequests,
    AddLoRA,
    AddRefused,
    AddRequest,
    Command,
    CommandQueue,
    EngineEvent,
    EngineFailed,
    ReleaseHeldKV,
    RemoveLoRA,
    ResetPrefixCache,
    StepDone,
    Stop,
)
from engine.core import EngineCore
from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class LoopHandoff:
    """Engine thread -> event loop, in order.

    The engine thread only puts into a SimpleQueue, which never releases the
    GIL; a handoff thread wakes the loop for each event. Waking it directly
    is a write to its self-pipe, which releases the GIL, and getting the GIL
    back from a loop busy with the last step's 64 streams cost the next step
    ~3-5 ms. Events put before ``start`` wait for it.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[EngineEvent | None] = queue.SimpleQueue()

    def put(self, event: EngineEvent) -> None:
        """Any thread."""
        self._queue.put(event)

    def start(
        self, loop: asyncio.AbstractEventLoop, on_event: Callable[[EngineEvent], None]
    ) -> None:
        """Calls ``on_event`` on ``loop`` for each event until ``close``."""

        def run() -> None:
            while (event := self._queue.get()) is not None:
                try:
                    loop.call_soon_threadsafe(on_event, event)
                except RuntimeError:  # the loop closed: nobody is listening
                    return

        threading.Thread(target=run, name="engine-handoff", daemon=True).start()

    def close(self) -> None:
        self._queue.put(None)


class EngineThread(threading.Thread):
    """Builds the EngineCore and then steps it, all on this one thread.

    Building it here matters: torch's CPU kernels run OpenMP thread teams,
    one per calling thread, and a second team left over from loading the
    model on another thread measured a 2x slower decode step on two cores.
    """

    def __init__(self, build: Callable[[], EngineCore]) -> None:
        super().__init__(name="tandem-engine", daemon=True)
        self._build = build
        self._commands = CommandQueue()
        self.handoff = LoopHandoff()
        self._emit = self.handoff.put
        self.ready = threading.Event()
        self.core: EngineCore | None = None
        self.build_error: BaseException | None = None

    @classmethod
    async def launch(cls, build: Callable[[], EngineCore]) -> tuple[EngineThread, EngineCore]:
        """Starts the thread and waits (off the loop) until it has built
        its core; raises what the build raised."""
        thread = cls(build)
        thread.start()
        await asyncio.to_thread(thread.ready.wait)
        if thread.core is None:
            raise thread.build_error or RuntimeError("the engine thread failed to start")
        return thread, thread.core

    # --- the loop's side: commands ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._commands.put(AddRequest(request))

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self._commands.put(AbortRequests(request_ids, status))

    def release_held_kv(self, request_ids: list[str]) -> None:
        self._commands.put(ReleaseHeldKV(request_ids))

    def reset_prefix_cache(self) -> Future[bool]:
        done: Future[bool] = Future()
        self._commands.put(ResetPrefixCache(done))
        return done

    def add_lora(self, request: LoRARequest, adapter: LoRAAdapter) -> Future[None]:
        done: Future[None] = Future()
        self._commands.put(AddLoRA(request, adapter, done))
        return done

    def remove_lora(self, lora_int_id: int) -> None:
        self._commands.put(RemoveLoRA(lora_int_id))

    def stop(self) -> None:
        self._commands.put(Stop())

    # --- the engine thread ------------------------------------------------------------

    def run(self) -> None:
        try:
            self.core = self._build()
        except BaseException as exc:
            self.build_error = exc
            return
        finally:
            self.ready.set()
        self._serve(self.core)

    def _serve(self, core: EngineCore) -> None:
        num_added = 0  # reported with each step: the loop's admission counts on it
        try:
            while True:
                idle = not core.has_work()
                commands = self._commands.take(wait=idle, timeout=core.idle_poll_seconds)
                if idle and not commands:
                    core.poll_idle()  # a peer may be reading our KV cache
                for command in commands:
                    if isinstance(command, Stop):
                        return
                    num_added += self._apply(core, command)
                if core.has_work():
                    start = time.perf_counter()
                    outputs = core.step()
                    self._emit(
                        StepDone(outputs, num_added, time.perf_counter() - start, time.time())
                    )
                elif commands:
                    # Idle now (e.g. the last request was aborted): report
                    # the freed blocks instead of the last step's figures.
                    self._emit(StepDone(core.stats_only(), num_added, 0.0, time.time()))
        except BaseException as exc:  # the loop must hear of any failure
            logger.exception("engine thread failed")
            self._emit(EngineFailed(exc))
        finally:
            core.shutdown()

    def _apply(self, core: EngineCore, command: Command) -> int:
        """Applies one command; returns how many requests it added."""
        match command:
            case AddRequest(request):
                self._add(core, request)
                return 1
            case AbortRequests(request_ids, status):
                core.abort_requests(request_ids, status)
            case ReleaseHeldKV(request_ids):
                core.release_held_kv(request_ids)
            case ResetPrefixCache(done):
                done.set_result(core.reset_prefix_cache())
            case AddLoRA(request, adapter, done):
                try:
                    core.add_lora(request, adapter)
                except Exception as exc:  # the caller hears of it, the engine goes on
                    done.set_exception(exc)
                else:
                    done.set_result(None)
            case RemoveLoRA(lora_int_id):
                core.remove_lora(lora_int_id)
        return 0

    def _add(self, core: EngineCore, request: Request) -> None:
        """One request into the scheduler. What the scheduler refuses (an id
        still in use by a finished request whose KV blocks it holds for a
        remote decode, which the front door cannot see) fails that request
        alone, not the engine and everyone else's work."""
        try:
            core.add_request(request)
        except ValueError as exc:
            logger.warning("request %s refused by the scheduler: %s", request.request_id, exc)
            self._emit(AddRefused(request.request_id))
