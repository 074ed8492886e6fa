"""The tandem.v1.Generation servicer: a thin layer over AsyncEngine.

Each RPC converts its message (service.convert), calls the engine, and
converts back; every failure goes through service.errors. A Generate call
owns its request: whether it ends normally, the client cancels, disconnects
or passes its deadline, the `finally` closes the stream, which aborts the
request in the engine (its blocks are freed before the next step). An Abort
ends the live requests it names and releases the KV blocks finished ones
hold for a remote decode (a prefill leg's, which the router gives up on).
LoRA adapters are loaded and unloaded through service.adapters (shared
with --lora-modules) and listed through the engine, which owns their
registry; ``on_loras_changed`` hears the count after each change (the
metrics gauge).

Tokenizing and rendering chat templates take CPU time in proportion to the
input (a second per megabyte): they run on a small thread pool, never on
the event loop, which must keep streaming tokens and answering health
checks meanwhile. (The tokenizer releases the GIL while it works.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from engine import AsyncEngine
from service import choices, convert
from service.adapters import LoRAAdapters
from service.engine_holder import EngineHolder
from service.errors import abort_with, refused_by_engine
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Threads that turn inputs into token ids. A few, not one per request: a
# burst of large prompts then queues here instead of taking every core
# from the engine thread.
INPUT_THREADS = 4


def new_input_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="tandem-input")


class GenerationServicer(EngineHolder, pb_grpc.GenerationServicer):
    """Registered before the model loads (so health answers meanwhile); RPCs
    get UNAVAILABLE until `attach` hands it the engine."""

    def __init__(
        self,
        *,
        role: str = "both",
        kv_connector: str = "",
        input_pool: ThreadPoolExecutor | None = None,
        served_model_name: str | None = None,
        on_loras_changed: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.role = role
        self.kv_connector = kv_connector
        self.served_model_name = served_model_name
        # Loads and unloads, shared with --lora-modules (service.adapters).
        self.loras = LoRAAdapters(on_loras_changed)
        self._choices = choices.ChoiceRegistry()
        self._input_pool = input_pool or new_input_pool()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            engine = self.engine
            call = await self._off_loop(self._prepare, request, engine)
            streams = choices.submit(engine, call)
        except Exception as exc:
            await abort_with(context, exc, refused=True)
            return
        call_id = call.request_id if call.n > 1 else None
        with self._choices.running(call, streams):
            try:
                async for index, outputs in choices.outputs(streams):
                    # A slow reader gets what piled up meanwhile as one message.
                    yield convert.generate_response(outputs, call_id=call_id, index=index)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await abort_with(context, exc, refused=refused_by_engine(exc, call.n))

    def _prepare(self, msg: pb.GenerateRequest, engine: AsyncEngine) -> choices.Call:
        """A GenerateRequest checked and tokenized (on an input thread)."""
        return convert.generate_input(
            msg,
            engine.front.inputs,
            served_model_name=self.served_model_name or engine.info.model_name,
            role=self.role,
        )

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the input threads."""
        return await asyncio.get_running_loop().run_in_executor(self._input_pool, fn, *args)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Aborts the live requests named; the others may be finished
        prefill legs whose KV blocks are held for a decode that will not
        come (the router says so when the decode pod refused the request):
        those blocks are released. Answers the ids that were live."""
        engine = await self._engine_for(context)
        ids = self._choices.expand(list(request.request_ids))
        aborted = engine.abort(ids)
        engine.release_held_kv([rid for rid in ids if rid not in aborted])
        return pb.AbortResponse(aborted_request_ids=aborted)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        engine = await self._engine_for(context)
        try:
            ids = await self._off_loop(convert.tokenize_input, request, engine.front.inputs)
        except Exception as exc:
            await abort_with(context, exc)
            raise
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        engine = await self._engine_for(context)
        config = engine.config
        info: pb.ModelInfo = convert.model_info(
            engine.info,
            block_size=config.cache.block_size,
            role=self.role,
            connector=self.kv_connector,
            dtype=config.model.dtype,
            lora=config.lora,
            adapters=engine.list_loras(),
        )
        if self.served_model_name:
            info.model_name = self.served_model_name
        return info

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStatus:
        engine = await self._engine_for(context)
        return convert.server_status(
            engine.status(), engine.list_loras(), weight_format=engine.info.weight_format
        )

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapter:
        engine = await self._engine_for(context)
        loaded = await self.loras.load_or_abort(
            context, engine, request.lora_name, request.lora_path
        )
        return convert.lora_adapter(loaded)

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        engine = await self._engine_for(context)
        unloaded = await self.loras.unload_or_abort(context, engine, request.lora_name)
        return pb.UnloadLoraAdapterResponse(adapter=convert.lora_adapter(unloaded))

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoraAdaptersResponse:
        engine = await self._engine_for(context)
        return pb.ListLoraAdaptersResponse(
            adapters=[convert.lora_adapter(a) for a in engine.list_loras()]
        )

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        subscription = (await self._engine_for(context)).subscribe_kv_events()
        try:
            while (batch := await subscription.next()) is not None:
                yield convert.kv_event_batch(batch)
        finally:
            subscription.close()
