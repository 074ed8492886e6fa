"""``n`` > 1: one call's choices, each its own engine request.

The choices of a call share its prompt, so the first to be scheduled
computes the prompt's KV and the others find its full blocks in the prefix
cache (they are admitted in the same step, before any block is full, so a
prompt's last partial block is computed once per choice). Choice ``i`` is
the engine request ``<id>-<i>`` (a single choice keeps the call's id, which
a P/D pair's two legs share) and, with a seed, is seeded ``seed + i``, as
vLLM seeds its child requests: n seeded choices differ from each other and
the same call gives the same n again.

Both servicers (tandem.v1 and VllmEngine) run calls through here;
``ChoiceRegistry`` maps a call's id to its choices' ids for Abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine import InvalidRequestError
from engine.request_options import RequestOptions

if TYPE_CHECKING:
    from engine import AsyncEngine, ProcessedPrompt, RequestOutput, RequestStream, SamplingParams

# Most choices one call may ask for: each is a request in the engine.
MAX_N = 16


def check_n(n: int, field_name: str, *, disaggregated: bool) -> None:
    """Raises InvalidRequestError naming ``field_name`` for an ``n`` out of
    range, or above 1 where the KV is handed between pods (one hand-over
    per request id)."""
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(field_name, f"must be in [1, {MAX_N}], got {n}")
    if n > 1 and disaggregated:
        raise InvalidRequestError(
            field_name, "n > 1 is not supported with prefill/decode disaggregation"
        )


def choice_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    return params if params.seed is None else replace(params, seed=params.seed + index)


@dataclass(frozen=True)
class Call:
    """What one Generate call asks the engine for."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    n: int = 1
    # Every choice's: priority, lora_name, kv_transfer_params, cache_salt...
    options: RequestOptions = field(default_factory=RequestOptions)


def submit(engine: AsyncEngine, call: Call) -> list[RequestStream]:
    """One engine request per choice; if one is refused, those already
    queued are aborted and the refusal raised (nothing of the call runs)."""
    inputs = engine.front.inputs
    streams: list[RequestStream] = []
    try:
        for index, rid in enumerate(choice_ids(call.request_id, call.n)):
            params = call.params if call.n == 1 else choice_params(call.params, index)
            request = inputs.make_request(rid, call.prompt, params, call.options)
            streams.append(engine.submit(request, call.prompt.text))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
    """``(choice index, outputs ready)`` as the choices produce them: a slow
    reader gets what piled up meanwhile in one item. One choice is read
    directly; several through a queue their readers fill."""
    if len(streams) == 1:
        stream = streams[0]
        async for output in stream:
            yield 0, [output, *stream.drain_ready()]
        return
    ready: asyncio.Queue[tuple[int, list[RequestOutput] | BaseException | None]] = asyncio.Queue()

    async def read(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                ready.put_nowait((index, [output, *stream.drain_ready()]))
        except Exception as exc:
            ready.put_nowait((index, exc))
        ready.put_nowait((index, None))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    try:
        open_count = len(readers)
        while open_count:
            index, item = await ready.get()
            if item is None:
                open_count -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()


@dataclass
class ChoiceRegistry:
    """Call id -> its choices' engine ids, while an n > 1 call runs."""

    _ids: dict[str, list[str]] = field(default_factory=dict)

    @contextmanager
    def running(self, call: Call, streams: list[RequestStream]) -> Iterator[None]:
        """While a call's streams are read: Abort finds its choices by the
        call's id. On leaving, however the call ends, every stream is
        closed (which aborts what still runs) and the call forgotten."""
        if call.n > 1:
            self._ids[call.request_id] = choice_ids(call.request_id, call.n)
        try:
            yield
        finally:
            for stream in streams:
                stream.close()
            self._ids.pop(call.request_id, None)

    def expand(self, request_ids: list[str]) -> list[str]:
        """The engine ids to abort for ``request_ids``."""
        return [rid for call in request_ids for rid in self._ids.get(call, [call])]
