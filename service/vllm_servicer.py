"""``vllm.grpc.engine.VllmEngine``: the field's engine protocol, served on
the same port as ``tandem.v1`` so the Shepherd Model Gateway (smg) can put
an OpenAI endpoint, its routing policies and P/D orchestration in front of
Tandem pods.

The contract, as smg and vLLM's own servicer use it:
  * Generate takes token ids (smg tokenizes) and answers token ids. Streamed,
    each engine output becomes a chunk of the new tokens; a choice's end
    sends its last chunk and then a GenerateComplete with finish reason,
    matched stop and counts. Not streamed, one GenerateComplete per choice
    with the whole output. ``n`` > 1 runs n engine requests (``id-0`` ...)
    that share the prompt's KV blocks through the prefix cache.
  * Abort is idempotent: smg sends it for every dropped stream, finished or
    not. Live requests are aborted; a finished prefill leg's held KV blocks
    are released (no decode leg will read them).
  * P/D: on a ``--role prefill`` pod a request without kv_transfer_params
    gets ``do_remote_decode`` (smg's prefill leg carries none); its
    GenerateComplete carries the connector's params as JSON, which smg
    relays unchanged to the decode pod's Generate under the same id.

The servicer is registered before the model loads: RPCs answer UNAVAILABLE
(HealthCheck answers not healthy) until ``attach``.

With ``lora_name`` set, the servicer is one LoRA adapter's (its own port,
service/adapter_ports.py): every request runs under that adapter, the model
it reports is the adapter's name, and while the adapter is not loaded its
requests answer NOT_FOUND (smg: HTTP 404, as for an unknown model).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine import AsyncEngine, RequestOutput
from service import choices
from service import vllm_convert as convert
from service.engine_holder import EngineHolder
from service.errors import AdapterNotLoadedError, abort_with, refused_by_engine
from service.tokenizer_bundle import TokenizerBundle
from service.vllm_convert import ChoiceOutput

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class VllmEngineServicer(EngineHolder, vpb_grpc.VllmEngineServicer):  # type: ignore[misc]
    def __init__(
        self,
        input_pool: ThreadPoolExecutor,
        *,
        role: str = "both",
        kv_connector: str = "",
        served_model_name: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.role = role
        self.kv_connector = kv_connector
        self.served_model_name = lora_name or served_model_name
        self.lora_name = lora_name
        self._input_pool = input_pool
        super().__init__()
        self._tokenizer: TokenizerBundle | None = None
        self._choices = choices.ChoiceRegistry()

    def attach(self, engine: AsyncEngine) -> None:
        super().attach(engine)
        # --chat-template: the archive carries it (the directory's own otherwise).
        override = engine.config.model.chat_template is not None
        template = engine.front.inputs.chat.text if override else None
        self._tokenizer = TokenizerBundle(engine.info.model_path, template)

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._input_pool, lambda: fn(*args, **kwargs))

    # --- Generate --------------------------------------------------------------------

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.GenerateResponse]:
        try:
            engine = self.engine
            parsed = await self._off_loop(
                convert.generate_input,
                request,
                engine.front.inputs,
                role=self.role,
                lora_name=self.lora_name,
            )
            call = parsed.call
            # Checked on the loop, where an unload runs: no unload falls
            # between this check and the submit.
            self._check_adapter(engine)
            streams = choices.submit(engine, call)
        except Exception as exc:
            await abort_with(context, exc, refused=True)
            return
        num_logprobs = call.params.logprobs
        finished: dict[int, list[RequestOutput]] = {}
        with self._choices.running(call, streams):
            try:
                async for index, outputs in choices.outputs(streams):
                    if parsed.stream:
                        choice = ChoiceOutput.merge(index, outputs)
                        yield convert.chunk(choice, num_logprobs)
                        if choice.last.finished:
                            yield convert.complete(choice, num_logprobs)
                        continue
                    so_far = finished.setdefault(index, [])
                    so_far.extend(outputs)
                    if outputs[-1].finished:
                        yield convert.complete(ChoiceOutput.merge(index, so_far), num_logprobs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await abort_with(context, exc, refused=refused_by_engine(exc, call.n))

    def _check_adapter(self, engine: AsyncEngine) -> None:
        """The engine's own refusal of an unknown adapter is INVALID_ARGUMENT
        (HTTP 400 at smg); on an adapter's port the adapter is the model, and
        a model that is not served is vLLM's 404."""
        name = self.lora_name
        if name is None or any(r.lora_name == name for r in engine.list_loras()):
            return
        raise AdapterNotLoadedError(
            f"model {name!r}: the LoRA adapter is not loaded on this pod "
            f"(tandem lora load {name} PATH loads it)"
        )

    # --- control ---------------------------------------------------------------------

    async def Abort(
        self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vpb.AbortResponse:
        engine = await self._engine_for(context)
        ids = self._choices.expand(list(request.request_ids))
        aborted = set(engine.abort(ids))
        engine.release_held_kv([rid for rid in ids if rid not in aborted])
        return vpb.AbortResponse()

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vpb.HealthCheckResponse:
        problem = self._health_problem()
        return vpb.HealthCheckResponse(healthy=problem is None, message=problem or "healthy")

    def _health_problem(self) -> str | None:
        engine = self._engine
        if engine is None:
            return "the model is still loading"
        if not engine.healthy:
            return "the engine failed"
        if engine.draining:
            return "draining"
        connector = engine.connector_health()
        return None if connector is None else f"KV connector unhealthy: {connector}"

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.FlushCacheResponse:
        """Forgets the prefix cache. With ``timeout_s``, first waits up to
        that long for the running requests to end (their blocks cannot be
        forgotten while in use)."""
        engine = await self._engine_for(context)
        if request.timeout_s > 0 and not await engine.wait_idle(request.timeout_s):
            return common_pb2.FlushCacheResponse(
                success=False, message=f"requests still running after {request.timeout_s:g} s"
            )
        if await engine.reset_prefix_cache():
            return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")
        return common_pb2.FlushCacheResponse(
            success=False, message="requests are running; retry with timeout_s > 0"
        )

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message="profiling is not supported")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message="profiling is not supported")

    async def Embed(self, request: vpb.EmbedRequest, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: this is a generation model")

    # --- facts -----------------------------------------------------------------------

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetModelInfoResponse:
        engine = await self._engine_for(context)
        info = engine.info
        inputs = engine.front.inputs
        tokenizer = inputs.tokenizer
        # A gateway on this host reads the tokenizer from this path: the
        # model's directory, or the archive's files where they differ.
        tokenizer_path = info.model_path
        bundle = self._tokenizer
        if bundle is not None and bundle.chat_template is not None:
            # None (nowhere writable): the model's; a gateway on another
            # host fetches the archive anyway.
            tokenizer_path = await bundle.directory() or info.model_path
        facts = convert.ModelFacts(
            served_model_name=self.served_model_name or info.model_name,
            model_path=str(info.model_path),
            tokenizer_path=str(tokenizer_path),
            architecture=info.architecture,
            model_type=convert.model_type(info.model_path),
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=[] if info.eos_token_id is None else [info.eos_token_id],
            bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return convert.model_info(facts)

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetServerInfoResponse:
        engine = await self._engine_for(context)
        config = engine.config
        facts = convert.ServerFacts(
            role=self.role,
            kv_connector=self.kv_connector,
            engine_id=engine.engine_id,
            block_size=config.cache.block_size,
            dtype=config.model.dtype,
            max_num_seqs=config.scheduler.max_num_seqs,
            kv_cache_dtype=convert.vllm_kv_cache_dtype(
                engine.info.kv_cache_dtype, config.model.dtype
            ),
        )
        return convert.server_info(facts, engine.status())

    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetLoadsResponse:
        engine = await self._engine_for(context)
        return convert.loads(
            engine.status(),
            num_blocks=engine.info.num_blocks,
            block_size=engine.config.cache.block_size,
            max_num_seqs=engine.config.scheduler.max_num_seqs,
            timestamp=datetime.now(UTC).isoformat(),
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        await self._engine_for(context)
        assert self._tokenizer is not None
        try:
            archive = await self._tokenizer.archive()
        except OSError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        for data, digest in archive.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """Live events from the subscription on (``start_sequence_number``
        is not replayed: a subscriber starts from an empty view, and the
        ZMQ publisher's replay socket serves catch-up). Blocks stored under
        another model than this servicer's are left out."""
        subscription = (await self._engine_for(context)).subscribe_kv_events()
        # The headers now, not with the first batch (which may be minutes
        # away on an idle pod): smg takes a stream that has not answered
        # within 2 s for an unreachable worker.
        await context.send_initial_metadata(())
        next_id = 1
        try:
            while (batch := await subscription.next()) is not None:
                batch = convert.events_of_model(batch, self.lora_name)
                yield convert.kv_event_batch(batch, next_id)
                next_id += len(batch.events)
        finally:
            subscription.close()
