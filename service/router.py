"""`tandem router`: one tandem.v1.Generation endpoint over prefill and decode pools.

Per Generate call, with a prefill pool:

1. The prompt becomes token ids (Tokenize on a pod, unless given as ids).
2. The prefill leg: the same request with max_tokens 1 and
   ``kv_transfer_params {"do_remote_decode": true}`` to the least loaded
   prefill pod (another one if it is unavailable). Its token is streamed to
   the client at once, so time to first token is the prefill's.
3. The decode leg: prompt + that token as token ids, max_tokens - 1, and the
   prefill's ``kv_transfer_params`` (where the KV is), to the decode pod
   holding the longest prefix of the prompt (SubscribeKvEvents), then the
   least loaded. Its tokens stream back; usage counts both legs.

Sending the first token as part of the decode prompt (instead of letting
decode sample it again) keeps a sampled first token and what follows it
consistent. Without a prefill pool (``--decode`` only: a colocated pool)
the router forwards whole requests, prefix-aware.

A pool address with a DNS name (a Kubernetes headless Service) stands for
every pod it resolves to, re-resolved every ``resolve_seconds`` (service/pods.py).

A client that cancels or disconnects cancels both legs (each pod aborts its
request and frees its blocks). A pod error ends the call with that pod's
status.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.convert import dict_to_struct
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.pods import Pod, PodPool, prompt_block_hashes

logger = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Generation"


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 50050
    poll_seconds: float = 0.5
    resolve_seconds: float = 5.0  # how often pool addresses with DNS names are resolved

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("decode: the router needs at least one decode (or colocated) pod")
        for name in ("poll_seconds", "resolve_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected seconds > 0")


class _LegFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class RouterServicer(pb_grpc.GenerationServicer):
    def __init__(self, prefill: PodPool | None, decode: PodPool) -> None:
        self.prefill = prefill
        self.decode = decode

    # ---- Generate -----------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        try:
            ids = await self._token_ids(request)
            if self.prefill is None:
                async for resp in self._forward(self.decode, request, ids):
                    yield resp
                return
            async for resp in self._disaggregated(request, ids):
                yield resp
        except _LegFailed as e:
            await context.abort(e.code, e.details)

    async def _disaggregated(
        self, request: pb.GenerateRequest, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        assert self.prefill is not None
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 0
        prefill_req = _with_ids(request, ids)
        prefill_req.sampling.max_tokens = 1
        prefill_req.sampling.min_tokens = min(1, request.sampling.min_tokens)
        prefill_req.kv_transfer_params.CopyFrom(dict_to_struct({"do_remote_decode": True}))
        final: pb.GenerateResponse | None = None
        first: list[int] = []
        async for resp in self._forward(self.prefill, prefill_req, ids):
            first.extend(resp.token_ids)
            final = resp if resp.finish_reason else final
            out = pb.GenerateResponse()
            out.CopyFrom(resp)
            out.ClearField("kv_transfer_params")
            if resp.finish_reason and not _ends_request(resp, max_tokens):
                # The request goes on at the decode pod: no end yet.
                for name in ("finish_reason", "usage", "stop_string", "stop_token_id"):
                    out.ClearField(name)
            yield out
        if final is None or _ends_request(final, max_tokens):
            return
        decode_req = _with_ids(request, ids + first)
        if max_tokens:
            decode_req.sampling.max_tokens = max_tokens - len(first)
        decode_req.sampling.min_tokens = max(0, request.sampling.min_tokens - len(first))
        decode_req.kv_transfer_params.CopyFrom(final.kv_transfer_params)
        async for resp in self._forward(self.decode, decode_req, ids + first):
            if resp.finish_reason:
                resp.usage.prompt_tokens = len(ids)
                resp.usage.completion_tokens += len(first)
            yield resp

    async def _forward(
        self, pool: PodPool, request: pb.GenerateRequest, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one leg from the best pod; before its first answer, an
        unavailable pod is skipped for the next best."""
        tried: list[Pod] = []
        while True:
            pod = pool.pick(self._hashes(pool, ids), exclude=tried)
            if pod is None:
                raise _LegFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no {pool.name} pod available (tried {[p.address for p in tried]})",
                )
            tried.append(pod)
            answered = False
            pod.in_flight += 1
            call = pod.stub.Generate(request)
            try:
                async for resp in call:
                    answered = True
                    yield resp
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and not answered:
                    logger.warning("%s pod %s unavailable: trying another", pool.name, pod.address)
                    pod.healthy = False
                    continue
                raise _LegFailed(e.code(), f"{pool.name} pod {pod.address}: {e.details()}") from e
            finally:
                pod.in_flight -= 1
                call.cancel()  # a no-op once done; aborts the leg if we were cancelled

    def _hashes(self, pool: PodPool, ids: list[int]) -> list[bytes]:
        if not pool.follow_kv_events:
            return []
        block_size = next((p.block_size for p in pool.pods if p.block_size), 0)
        return prompt_block_hashes(ids, block_size) if block_size else []

    async def _token_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind is None:
            raise _LegFailed(
                grpc.StatusCode.INVALID_ARGUMENT, "input: give text, token_ids or chat"
            )
        tokenize = pb.TokenizeRequest()
        if kind == "text":
            tokenize.text = request.text
        else:
            tokenize.chat.CopyFrom(request.chat)
        resp = await self._unary("Tokenize", tokenize)
        assert isinstance(resp, pb.TokenizeResponse)
        return list(resp.token_ids)

    # ---- the other RPCs ---------------------------------------------------------

    async def _unary(self, method: str, message: object) -> object:
        pod = self.decode.pick()
        if pod is None:
            raise _LegFailed(grpc.StatusCode.UNAVAILABLE, "no decode pod available")
        try:
            return await getattr(pod.stub, method)(message, timeout=30.0)
        except grpc.aio.AioRpcError as e:
            raise _LegFailed(e.code(), f"decode pod {pod.address}: {e.details()}") from e

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        aborted: set[str] = set()
        for pool in self._pools():
            for pod in pool.pods:
                try:
                    resp = await pod.stub.Abort(request, timeout=5.0)
                    aborted.update(resp.aborted_request_ids)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # UsageError: pod retired
                    continue
        return pb.AbortResponse(aborted_request_ids=sorted(aborted))

    async def _forwarded(
        self, method: str, message: object, context: grpc.aio.ServicerContext
    ) -> object:
        """A unary RPC answered by a decode pod; its failure ends this call."""
        try:
            return await self._unary(method, message)
        except _LegFailed as e:
            await context.abort(e.code, e.details)
            raise  # context.abort raises; this keeps the type checker informed

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        resp = await self._forwarded("Tokenize", request, context)
        assert isinstance(resp, pb.TokenizeResponse)
        return resp

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        info = await self._forwarded("GetModelInfo", request, context)
        assert isinstance(info, pb.ModelInfo)
        info.role = "router"
        return info

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStatus:
        """Sums over the pods that answer (a router's load is its pods')."""
        total = pb.ServerStatus()
        for pool in self._pools():
            for pod in pool.pods:
                try:
                    status = await pod.stub.GetServerStatus(request, timeout=5.0)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # UsageError: pod retired
                    continue
                total.num_running += status.num_running
                total.num_waiting += status.num_waiting
                total.prefix_cache_queries += status.prefix_cache_queries
                total.prefix_cache_hits += status.prefix_cache_hits
                total.num_preemptions += status.num_preemptions
                total.kv_connector_queries += status.kv_connector_queries
                total.kv_connector_hits += status.kv_connector_hits
        if total.prefix_cache_queries:
            total.prefix_cache_hit_rate = total.prefix_cache_hits / total.prefix_cache_queries
        return total

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "the router holds no KV cache: subscribe to a pod's SubscribeKvEvents",
        )
        yield pb.KvEventBatch()  # pragma: no cover  (makes this a generator)

    def _pools(self) -> list[PodPool]:
        return [p for p in (self.prefill, self.decode) if p is not None]


def _with_ids(request: pb.GenerateRequest, ids: list[int]) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("input")
    out.token_ids.ids.extend(ids)
    out.ClearField("kv_transfer_params")
    return out


def _ends_request(resp: pb.GenerateResponse, max_tokens: int) -> bool:
    """Whether the prefill leg's end is the request's end: it stopped (EOS,
    a stop string or id) or the client asked for one token."""
    return resp.finish_reason != pb.FINISH_REASON_LENGTH or max_tokens == 1


class TandemRouter:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefill = (
            PodPool(
                "prefill",
                config.prefill,
                follow_kv_events=False,
                poll_seconds=config.poll_seconds,
                resolve_seconds=config.resolve_seconds,
            )
            if config.prefill
            else None
        )
        self.decode = PodPool(
            "decode",
            config.decode,
            follow_kv_events=True,
            poll_seconds=config.poll_seconds,
            resolve_seconds=config.resolve_seconds,
        )
        self.servicer = RouterServicer(self.prefill, self.decode)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port}")
        for pool in self.servicer._pools():
            pool.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        self._health_task = asyncio.create_task(self._track_health())
        logger.info("router on %s:%d", self.config.host, self.port)
        return self.port

    async def _track_health(self) -> None:
        """SERVING while every pool has a healthy pod."""
        serving: bool | None = None
        while True:
            now = all(pool.any_healthy for pool in self.servicer._pools())
            if now != serving:
                serving = now
                await self._set_health(
                    health_pb2.HealthCheckResponse.SERVING
                    if now
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
            await asyncio.sleep(self.config.poll_seconds)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._server is not None:
            await self._server.stop(grace)
        for pool in self.servicer._pools():
            await pool.close()


async def serve_router(config: RouterConfig) -> None:
    """Runs the router until SIGTERM/SIGINT."""
    router = TandemRouter(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await router.stop()
