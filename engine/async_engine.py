"""AsyncEngine: the service's asyncio front door to one EngineCore.

Only transport and streams: the core runs on its engine thread
(``engine.engine_thread``), which applies typed commands (``engine.commands``)
before each step and hands each step's outputs to the event loop. There
``engine.delivery`` passes them through the shared ``FrontEnd`` (the one
``LLM`` uses too: detokenizing, stop strings, status) to each request's
stream (``engine.streams``), then tells the observer (metrics) and the KV
event subscribers (``engine.kv_events``). Detokenizing on the loop rather
than in the engine thread lets it overlap the next step's forward pass,
which releases the GIL inside torch.

A request's life: ``submit()`` checks admission (draining, duplicate id,
queue bound) and returns a ``RequestStream``; iterate it for outputs until
one is ``finished``; ``close()`` it in a ``finally`` so a client that goes
away aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.delivery import Delivery
from engine.engine_thread import EngineThread
from engine.errors import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
)
from engine.frontend import FrontEnd
from engine.kv_events import KvEventHub, KvEventSubscription
from engine.lora.request import LoRARequest
from engine.models.loader import load_tokenizer, resolve_model
from engine.observer import EngineObserver, GuardedObserver
from engine.output_processor import OutputKind
from engine.request import FinishReason, Request
from engine.status import EngineStatus
from engine.streams import RequestStream, RequestStreams
from engine.worker.worker import WorkerInfo

if TYPE_CHECKING:
    from engine.kv_transfer.base import Claim


@dataclass
class Admission:
    """Whether the front door takes one more request."""

    max_waiting_requests: int
    draining: bool = False
    num_submitted: int = 0  # requests sent to the engine thread
    num_added: int = 0  # of those, added to the core as of the last step

    def num_waiting(self, scheduler_waiting: int) -> int:
        """Requests not yet running: the scheduler's waiting queue as of the
        last step plus those submitted since that the core has not taken."""
        return scheduler_waiting + (self.num_submitted - self.num_added)

    def admit(self, request_id: str, is_live: bool, scheduler_waiting: int) -> None:
        """Counts one more request submitted, or raises EngineDrainingError,
        DuplicateRequestIdError (an id that is live) or QueueFullError."""
        if self.draining:
            raise EngineDrainingError("the server is draining and accepts no new requests")
        if is_live:
            raise DuplicateRequestIdError(request_id, "a live request")
        waiting = self.num_waiting(scheduler_waiting)
        if waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} requests are waiting (the bound is "
                f"{self.max_waiting_requests}); retry later"
            )
        self.num_submitted += 1

    def took(self, num_added: int) -> None:
        """The engine thread has added ``num_added`` requests to the core."""
        self.num_added = num_added


class AsyncEngine:
    def __init__(
        self,
        thread: EngineThread,
        core: EngineCore,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_waiting_requests: int = 1024,
        observer: EngineObserver | None = None,
    ) -> None:
        """Use ``create``: the engine thread loads the model without
        blocking the event loop. ``core`` is the thread's, read here only
        for what never changes (config, model info, the connector's health
        flags)."""
        self.config = core.config
        self.info: WorkerInfo = core.info
        self.front = FrontEnd(thread, tokenizer, core.info)
        self._core = core
        self._thread = thread
        self._admission = Admission(max_waiting_requests)
        self._observer = GuardedObserver(observer)
        self._streams = RequestStreams(self._observer, self.abort)
        self._kv_events = KvEventHub()
        self._started = time.monotonic()
        self._delivery = Delivery(
            self.front, self._streams, self._observer, self._kv_events, self._admission.took
        )
        thread.handoff.start(asyncio.get_running_loop(), self._delivery)

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        *,
        max_waiting_requests: int = 1024,
        observer: EngineObserver | None = None,
    ) -> AsyncEngine:
        # First: a template that does not render fails before the weights
        # load (a GGUF not converted yet converts first, once).
        model = config.model
        tokenizer = await asyncio.to_thread(
            lambda: load_tokenizer(resolve_model(model.model), model.chat_template)
        )
        thread, core = await EngineThread.launch(lambda: EngineCore(config))
        return cls(
            thread, core, tokenizer, max_waiting_requests=max_waiting_requests, observer=observer
        )

    # --- requests --------------------------------------------------------------------

    def submit(self, request: Request, prompt_text: str | None = None) -> RequestStream:
        """Queue ``request`` (made by ``self.front.inputs``) and return its
        stream. Raises EngineDeadError or what ``Admission.admit`` raises."""
        if self._delivery.dead is not None:
            raise EngineDeadError(f"the engine failed: {self._delivery.dead!r}")
        rid = request.request_id
        self._admission.admit(rid, rid in self._streams, self.front.status.num_waiting)
        stream = self._streams.open(rid)
        self.front.add_request(request, prompt_text, OutputKind.DELTA)
        self._thread.add_request(request)
        return stream

    def abort(self, request_ids: list[str], error: Exception | None = None) -> list[str]:
        """Aborts the live requests among ``request_ids`` and returns their
        ids; each stream ends with a last output, finish reason ABORT (what
        its caller asked for), or raises ``error`` when the abort is the
        server's own doing, which the caller must not take for a normal end.
        Other ids are ignored (see ``release_held_kv`` for finished ones)."""
        live = [rid for rid in request_ids if rid in self._streams]
        if live:
            self._thread.abort_requests(live)
            for rid in live:
                self._streams.end(self.front.abort(rid, FinishReason.ABORT), error)
        return live

    def release_held_kv(self, request_ids: list[str]) -> None:
        """Frees the KV blocks finished requests hold for a remote decode
        that will not come (the router says so when the decode pod refused
        the request). Unknown and unfinished ids are ignored."""
        if request_ids:
            self._thread.release_held_kv(request_ids)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running (``Admission.num_waiting``)."""
        return self._admission.num_waiting(self.front.status.num_waiting)

    @property
    def num_live(self) -> int:
        return len(self._streams)

    @property
    def num_held_kv(self) -> int:
        """Finished requests whose KV blocks the connector still holds (as
        of the last step): a prefill pod's blocks a decode pod is to READ."""
        return self.front.status.kv_held_requests

    # --- LoRA adapters ---------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Reads and checks the PEFT adapter at ``path`` (off the loop) and
        serves it as ``name`` once this returns. Raises InvalidRequestError
        naming the field (``lora_name``, ``lora_path``: the file and key)."""
        loras = self.front.loras
        loras.check_new_name(name)
        request, adapter = await asyncio.to_thread(loras.read, name, path)
        loras.add(request)  # checks the name again: a concurrent load may have won
        try:
            await asyncio.wrap_future(self._thread.add_lora(request, adapter))
        except BaseException:
            loras.remove(name)
            raise
        return request

    def unload_lora(self, name: str) -> LoRARequest:
        """Refuses new requests for ``name`` at once; the engine drops the
        weights when the requests running under it have finished."""
        request = self.front.loras.remove(name)
        self._thread.remove_lora(request.lora_int_id)
        return request

    def list_loras(self) -> list[LoRARequest]:
        return self.front.loras.loaded()

    # --- status, health, events ------------------------------------------------------

    def status(self) -> EngineStatus:
        return dataclasses.replace(
            self.front.snapshot(),
            num_waiting=self.num_waiting,
            uptime_seconds=time.monotonic() - self._started,
            draining=self._admission.draining,
            metrics_errors=self._observer.errors,
        )

    @property
    def healthy(self) -> bool:
        return self._delivery.dead is None and self._thread.is_alive()

    def connector_health(self) -> str | None:
        """Why the KV connector is not working (a dead or wedged transfer
        thread), or None. Safe from any thread: it reads flags only."""
        return self._core.connector_health()

    def side_channel_payload(self) -> bytes | None:
        """The KV connector's handshake for its peers, or None. Safe from
        any thread: the connector computed it when the engine started."""
        connector = self._core.worker_connector
        return connector.side_channel_payload() if connector is not None else None

    def release_hold(self, claim: bytes) -> Claim | None:
        """A peer's claim on KV this pod holds for it (the KV connector's
        ``release_hold``), or None without a connector that holds. Safe
        from any thread: the connector's holds take a lock."""
        connector = self._core.worker_connector
        return connector.release_hold(claim) if connector is not None else None

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Called on the event loop if the engine thread fails (e.g. to turn
        health NOT_SERVING)."""
        self._delivery.failure_listeners.append(listener)

    def subscribe_kv_events(self, max_pending: int = 1024) -> KvEventSubscription:
        return self._kv_events.subscribe(max_pending)

    @property
    def engine_id(self) -> str:
        """This engine's id (what its KV connector names itself by)."""
        return self._core.engine_id

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached block no request holds, before the next
        step; False (nothing forgotten) while a running request holds any."""
        return await asyncio.wrap_future(self._thread.reset_prefix_cache())

    # --- drain and shutdown ----------------------------------------------------------

    def begin_drain(self) -> None:
        self._admission.draining = True

    @property
    def draining(self) -> bool:
        return self._admission.draining

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until no request is live; False if ``timeout`` passed first."""
        return await _wait(self._streams.idle, timeout)

    async def wait_kv_released(self, timeout: float) -> bool:
        """Waits until the connector holds no finished request's KV (each
        hold ends with the peer's read, its refusal, or the lease lapsing);
        False if ``timeout`` passed first or the engine died."""
        released = self._delivery.kv_released
        if self._delivery.dead is not None or released.is_set():
            return released.is_set()
        return await _wait(released, timeout)

    async def shutdown(self) -> None:
        """Aborts what is left (each stream raises EngineDrainingError: its
        client asked for nothing, and an end with finish reason ABORT would
        read as one it did) and stops the engine thread."""
        self.begin_drain()
        stopped = EngineDrainingError(
            "the server is draining: the request was aborted before it finished; retry it"
        )
        self.abort(self._streams.ids(), stopped)
        self._thread.stop()
        await asyncio.to_thread(self._thread.join, 30)
        self._thread.handoff.close()
        self._kv_events.close()


async def _wait(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether ``event`` was set within ``timeout``."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True
