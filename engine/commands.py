"""What crosses between the event loop and the engine thread, typed.

loop -> engine thread: ``Command``s, queued in a ``CommandQueue`` and
applied by the engine thread before its next step (so an abort frees the
request's blocks before that step runs).

engine thread -> loop: ``EngineEvent``s, handed over in order
(``engine.engine_thread.LoopHandoff``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.outputs import EngineCoreOutputs
from engine.request import Request, RequestStatus

# --- loop -> engine thread ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request the front door admitted."""

    request: Request


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """End unfinished requests with ``status`` (aborted by a client, or
    stopped by a stop string the front end matched); others are ignored."""

    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass(frozen=True, slots=True)
class ReleaseHeldKV:
    """Free the KV blocks that finished requests hold for a remote decode
    nobody will run (``EngineCore.release_held_kv``); other ids are ignored."""

    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Forget every cached block not in use (FlushCache). ``done`` gets
    whether it happened: not while a running request holds blocks."""

    done: Future[bool]


@dataclass(frozen=True, slots=True)
class AddLoRA:
    """Give the engine a LoRA adapter the front door read and checked;
    ``done`` resolves once requests may run under it."""

    request: LoRARequest
    adapter: LoRAAdapter
    done: Future[None]


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    """Drop an adapter's weights once its running requests finish."""

    lora_int_id: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Shut the core down and end the engine thread."""


Command = (
    AddRequest | AbortRequests | ReleaseHeldKV | ResetPrefixCache | AddLoRA | RemoveLoRA | Stop
)


@dataclass
class CommandQueue:
    """Commands from the loop to the engine thread, applied before each step."""

    lock: threading.Condition = field(default_factory=threading.Condition)
    queue: deque[Command] = field(default_factory=deque)

    def put(self, command: Command) -> None:
        with self.lock:
            self.queue.append(command)
            self.lock.notify()

    def take(self, wait: bool, timeout: float | None = None) -> list[Command]:
        """Every queued command, oldest first; with ``wait``, blocks until
        there is one (or ``timeout`` seconds passed: then maybe none)."""
        with self.lock:
            if wait:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self.queue:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self.lock.wait(left)
            items = list(self.queue)
            self.queue.clear()
            return items


# --- engine thread -> loop ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepDone:
    """A step's outputs, or (``seconds`` 0) the stats of an idle engine
    after commands changed its state."""

    outputs: EngineCoreOutputs
    num_added: int  # AddRequest commands applied so far
    seconds: float  # how long the step took
    timestamp: float  # wall clock at hand-off (KV events carry it)


@dataclass(frozen=True, slots=True)
class AddRefused:
    """The scheduler refused a request the front door admitted (the engine
    thread logs the scheduler's reason)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine thread failed; it steps no more."""

    error: BaseException


EngineEvent = StepDone | AddRefused | EngineFailed
