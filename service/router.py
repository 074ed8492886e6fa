"""`tandem router`: one tandem.v1.Generation endpoint over prefill and decode pools.

Per Generate call, with a prefill pool:

1. The prompt becomes token ids (Tokenize on a pod, unless given as ids).
2. The prefill leg: the same request with max_tokens 1 and
   ``kv_transfer_params {"do_remote_decode": true}`` (unless that one token
   is the whole answer) to the least loaded prefill pod (another one if it
   is unavailable). Its token is streamed to the client at once, so time to
   first token is the prefill's.
3. The decode leg: prompt + that token as token ids, max_tokens - 1,
   ``num_output_tokens_in_prompt`` 1, and the prefill's
   ``kv_transfer_params`` (where the KV is), to the decode pod holding the
   longest prefix of the prompt (SubscribeKvEvents), then the least loaded.
   Its tokens stream back; usage counts both legs.

Sending the first token as part of the decode prompt (instead of letting
decode sample it again) keeps a sampled first token and what follows it
consistent. Without a prefill pool (``--decode`` only: a colocated pool)
the router forwards whole requests, prefix-aware.

The client sees one request, as a colocated server would send it: the same
token ids, text, finish reason, stop string and usage. Text straddling the
handover is why the decode leg says which of its prompt tokens are output:
the prefill pod's text holds back what may still become a stop string or is
an incomplete UTF-8 character (a prefill leg that hands over does not flush
it), and the decode pod, replaying the first token, stops on a stop string
that began in it and sends exactly the text the prefill pod held back
(protos/tandem/v1/generation.proto, ``num_output_tokens_in_prompt``).
min_tokens > 1 keeps the prefill leg from ending at its token (EOS or a
stop token id there does not end a colocated request either). One known
difference remains: with min_tokens > 1, a stop string wholly inside the
first token's text still ends the request there (a colocated server only
checks stop strings once min_tokens tokens exist).

At the decode pods' max_model_len (GetModelInfo), the request's max_tokens
is cut to what fits, as a colocated server stops with LENGTH there: a
prompt one token short of the limit is answered by the prefill leg alone.

KV held for nobody: when no decode leg will read the prefill pod's blocks
(the first token ended the request, or every decode pod asked refused the
leg before its engine took it, as a pod's REFUSED_KEY trailing metadata
says: invalid, queue full, draining), the router aborts the request on that
prefill pod, which releases the blocks at once instead of when the lease
lapses. A decode pod that took the request tells the prefill pod itself
(the connector's own done/reject); one whose connection broke may still be
reading, so its blocks wait for the lease.

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
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.sampling_params import SamplingParams
from service.convert import dict_to_struct
from service.errors import refused_metadata, was_refused
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.pods import Pod, PodPool, prompt_block_hashes

logger = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Generation"

# What a pod uses when a request leaves max_tokens unset; for the request
# as a whole, not for each leg.
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens


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
    def __init__(self, code: grpc.StatusCode, details: str, *, maybe_ran: bool = False) -> None:
        """`maybe_ran`: whether a pod's engine may have taken the request
        (unless set, every pod asked refused it up front and said so)."""
        super().__init__(details)
        self.code = code
        self.details = details
        self.maybe_ran = maybe_ran


class RouterServicer(pb_grpc.GenerationServicer):
    def __init__(self, prefill: PodPool | None, decode: PodPool) -> None:
        self.prefill = prefill
        self.decode = decode
        self._releases: set[asyncio.Task[None]] = set()  # referenced until done

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
            # Refused as a whole only if nothing ran anywhere (so nothing was
            # streamed either: a pod that answered ran).
            await context.abort(e.code, e.details, refused_metadata(not e.maybe_ran))

    async def _disaggregated(
        self, request: pb.GenerateRequest, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        assert self.prefill is not None
        max_tokens = _max_tokens(request)
        limit = self.decode.max_model_len()
        if limit > len(ids):
            # A colocated request stops with LENGTH at max_model_len; the
            # decode leg's prompt (prompt + first token) must leave it room
            # to, so one token short of the limit the prefill leg is the
            # whole request. (A prompt the decode pods cannot hold at all
            # is theirs to refuse, as a colocated pod would.)
            max_tokens = min(max_tokens, limit - len(ids))
        prefill_pods: list[Pod] = []
        final: pb.GenerateResponse | None = None
        first: list[int] = []
        prefill_req = _prefill_request(request, ids, max_tokens)
        async for resp in self._forward(self.prefill, prefill_req, ids, prefill_pods):
            first.extend(resp.token_ids)
            final = resp if resp.finish_reason else final
            yield _first_leg_response(resp, max_tokens)
        if final is None:
            return
        if _ends_request(final, max_tokens):
            if final.HasField("kv_transfer_params"):
                self._release(prefill_pods[-1], prefill_req.request_id)
            return
        decode_req = _decode_request(request, ids, first, max_tokens, final.kv_transfer_params)
        try:
            async for resp in self._forward(self.decode, decode_req, ids + first):
                if resp.finish_reason:
                    resp.usage.prompt_tokens = len(ids)
                    resp.usage.completion_tokens += len(first)
                yield resp
        except _LegFailed as e:
            if not e.maybe_ran:
                self._release(prefill_pods[-1], prefill_req.request_id)
            e.maybe_ran = True  # the prefill leg did
            raise

    def _release(self, pod: Pod, request_id: str) -> None:
        """Tells a prefill pod that no decode pod will read the blocks it
        keeps for `request_id`: Abort of a finished prefill-role request
        releases them (else they wait for the lease). In the background: the
        client's answer does not wait for it."""
        task = asyncio.create_task(self._abort_on(pod, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _abort_on(self, pod: Pod, request_id: str) -> None:
        try:
            await pod.stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=5.0)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:  # UsageError: pod retired
            logger.warning(
                "could not release %s's KV on prefill pod %s (its lease will): %s",
                request_id,
                pod.address,
                e,
            )

    async def _forward(
        self,
        pool: PodPool,
        request: pb.GenerateRequest,
        ids: list[int],
        answered_by: list[Pod] | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one leg from the best pod; before its first answer, an
        unavailable pod is skipped for the next best. The pod that answers
        is appended to `answered_by`."""
        tried: list[Pod] = []
        maybe_ran = False  # whether a pod tried so far may have taken the request
        while True:
            pod = pool.pick(self._hashes(pool, ids), exclude=tried)
            if pod is None:
                raise _LegFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no {pool.name} pod available (tried {[p.address for p in tried]})",
                    maybe_ran=maybe_ran,
                )
            tried.append(pod)
            answered = False
            pod.in_flight += 1
            call = pod.stub.Generate(request)
            try:
                async for resp in call:
                    if not answered and answered_by is not None:
                        answered_by.append(pod)
                    answered = True
                    yield resp
                return
            except grpc.aio.AioRpcError as e:
                # Without the pod's word (a connection broken mid-call, say)
                # it may have taken the request.
                maybe_ran = maybe_ran or answered or not was_refused(e)
                if e.code() == grpc.StatusCode.UNAVAILABLE and not answered:
                    logger.warning("%s pod %s unavailable: trying another", pool.name, pod.address)
                    pod.healthy = False
                    continue
                raise _LegFailed(
                    e.code(), f"{pool.name} pod {pod.address}: {e.details()}", maybe_ran=maybe_ran
                ) from e
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


def _max_tokens(request: pb.GenerateRequest) -> int:
    """The whole request's max_tokens (the legs split it), checked with
    min_tokens as a pod checks them: the legs' own limits would hide a bad
    value (the prefill leg asks for one token) or misstate it."""
    sampling = request.sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise _LegFailed(
            grpc.StatusCode.INVALID_ARGUMENT, f"sampling.max_tokens: must be >= 1, got {max_tokens}"
        )
    if sampling.min_tokens > max_tokens:
        raise _LegFailed(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"sampling.min_tokens: must be between 0 and max_tokens ({max_tokens}), "
            f"got {sampling.min_tokens}",
        )
    return max_tokens


def _prefill_request(
    request: pb.GenerateRequest, ids: list[int], max_tokens: int
) -> pb.GenerateRequest:
    """The first leg: one token, and its KV kept for a decode pod unless
    that token is the whole answer (nothing would fetch it)."""
    out = _with_ids(request, ids)
    out.sampling.max_tokens = 1
    out.sampling.min_tokens = min(1, request.sampling.min_tokens)
    if request.sampling.min_tokens > 1:
        # A colocated request checks EOS and stop ids only once min_tokens
        # tokens exist: the first token must not end this leg's request.
        out.sampling.ignore_eos = True
        out.sampling.ClearField("stop_token_ids")
    if max_tokens > 1:
        out.kv_transfer_params.CopyFrom(dict_to_struct({"do_remote_decode": True}))
    return out


def _first_leg_response(resp: pb.GenerateResponse, max_tokens: int) -> pb.GenerateResponse:
    """A prefill answer as the client sees it: its end is the request's end
    only if no decode leg follows."""
    out = pb.GenerateResponse()
    out.CopyFrom(resp)
    out.ClearField("kv_transfer_params")
    if resp.finish_reason and not _ends_request(resp, max_tokens):
        for name in ("finish_reason", "usage", "stop_string", "stop_token_id"):
            out.ClearField(name)
    return out


def _decode_request(
    request: pb.GenerateRequest,
    ids: list[int],
    first: list[int],
    max_tokens: int,
    kv_transfer_params: struct_pb2.Struct,
) -> pb.GenerateRequest:
    """The second leg: the prompt and the first leg's output as its prompt,
    told which of those tokens are output (so text and stop strings run on
    from the first leg's), with what is left of the token limits."""
    out = _with_ids(request, ids + first)
    out.num_output_tokens_in_prompt = request.num_output_tokens_in_prompt + len(first)
    out.sampling.max_tokens = max_tokens - len(first)
    # min_tokens past max_tokens (cut to max_model_len) ends at max_tokens.
    out.sampling.min_tokens = min(
        max(0, request.sampling.min_tokens - len(first)), out.sampling.max_tokens
    )
    out.kv_transfer_params.CopyFrom(kv_transfer_params)
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
