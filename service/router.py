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
   Its tokens stream back; usage counts both legs. Prompt logprobs, when
   asked for, come from the prefill leg (in its first response); the
   decode leg is not asked for them. Usage is what a colocated server
   reports: the prompt, both legs' tokens, and as cached tokens the prefill
   pod's prefix-cache hit (its leg's), not the decode pod's count, which is
   the whole prompt it was handed.

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

Request ids: each leg goes to its pod under an id of its own (the client's
id and a random suffix), and every response carries the client's id again.
An id is the only handle a pod has on a request (Abort, the release of its
held KV), so a client that sends another's request_id names none of that
request's legs. A request_id already in flight at the router is refused
(INVALID_ARGUMENT), as a colocated pod refuses a live one. The router's
Abort takes the client's ids and aborts those requests' live legs on their
pods; a leg that then ends with finish reason ABORT ends the request so.

A pod that ends a leg with finish reason ABORT unasked (its drain ran out of
grace, say) has not answered it: before anything of that leg reached the
client the router tries another pod (and then the prefill fallback), after
it the call ends UNAVAILABLE. A pod's abort never reaches a client as a
normal end.

KV held for nobody: when no decode leg will read the prefill pod's blocks
(the first token ended the request, or every decode pod asked refused the
leg before its engine took it, as a pod's REFUSED_KEY trailing metadata
says: invalid, queue full, draining), the router releases the KV held on
that prefill pod (``_release_held_kv``), at once instead of when the lease
lapses. On the wire a release is the Abort RPC: the pod releases the held
KV of a finished request, and aborts one still running (its blocks go with
it). A decode pod that took the request tells the prefill pod itself
(the connector's own done/reject); one whose connection broke may still be
reading, so its blocks wait for the lease.

A pool address with a DNS name (a Kubernetes headless Service) stands for
every pod it resolves to, re-resolved every ``resolve_seconds`` (service/pods.py).

A client that cancels or disconnects cancels both legs (each pod aborts its
request and frees its blocks): at any moment after the prefill leg was
sent and before a decode pod took its KV, the router also releases the KV
the prefill pod may already hold for a decode leg that will now never come.

No prefill pod available (none healthy, or each refused UNAVAILABLE): the
request goes whole to a decode pod (colocated, no kv_transfer_params),
counted and logged as a prefill fallback, unless ``--no-prefill-fallback``.

LoRA adapters: a request naming one (``lora_name``) goes only to pods
that have it loaded, as their polled status says (in P/D both legs: a
prefill pod and a decode pod that have it); when no healthy pod that would
serve it has it, the router answers INVALID_ARGUMENT naming the adapter and
those loaded, as a pod would. The two legs must run the same adapter
files, not only the same name (KV computed under one adapter is wrong
under another): the prefill leg goes to a pod whose copy's ``cache_key`` a
decode pod shares, and the decode leg to a pod with the prefill pod's
``cache_key``; pools with no ``cache_key`` in common for the name get
FAILED_PRECONDITION naming the adapter. Its block hashes, for the
prefix-aware pick, are computed with the adapter's ``cache_key``, as the
pods' engines hash its blocks. LoadLoraAdapter goes to every healthy pod of both pools (if one
fails, those that loaded it unload it again, and the call fails as that pod
did); UnloadLoraAdapter to every healthy pod (an adapter unknown to some is
fine if one had it); ListLoraAdapters, status and model info give the union
of the pods'. A pod that comes up later has only its own ``--lora-modules``:
the router sends it no request for other adapters until they are loaded
there too.

Status and model info give the pods' weight format (``weight_format``): their
distinct formats, comma-separated where pods differ.

A pod error ends the call with that pod's status and details, never with
a pod's address (those go to the log). The front door is guarded as
`tandem serve`'s is (API key, TLS or mTLS), and the router reaches pods
that require a key or TLS as `PodAccess` says. Metrics: service/router_metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from google.protobuf import descriptor, struct_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import ConfigError
from engine.kv_cache.hashing import hash_chain
from engine.kv_transfer.params import KVTransferParams
from engine.sampling_params import SamplingParams
from service.convert import dict_to_struct
from service.errors import refused_metadata, was_refused
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.grpc_server import ListenError, host_port, listen, new_server
from service.pods import Pod, PodAccess, PodPool, PodState
from service.router_metrics import RouterMetrics
from service.stop_signals import stop_signals
from service.tls import ServerTLS

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
    api_key: str | None = None  # clients must send it (health stays open)
    tls: ServerTLS = field(default_factory=ServerTLS)  # the router's own front door
    pods: PodAccess = field(default_factory=PodAccess)  # how the router reaches its pods
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # With no prefill pod available, send requests whole to a decode pod.
    prefill_fallback: bool = True

    def __post_init__(self) -> None:
        if not self.decode:
            raise ConfigError("decode: the router needs at least one decode (or colocated) pod")
        for name in ("poll_seconds", "resolve_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is invalid: expected seconds > 0"
                )


class _LegFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, *, maybe_ran: bool = False) -> None:
        """`maybe_ran`: whether a pod's engine may have taken the request
        (unless set, every pod asked refused it up front and said so).
        `details` go to the client: never a pod's address."""
        super().__init__(details)
        self.code = code
        self.details = details
        self.maybe_ran = maybe_ran


class _PodAborted(Exception):
    """A pod ended a leg with finish reason ABORT that the client did not ask for."""


@dataclass
class _Call:
    """A client's Generate while the router serves it. Its legs go to pods
    under ids of their own (``new_leg``), never under the client's id."""

    client_id: str
    # The client's Abort named it: a leg's ABORT is then its answer.
    aborted: bool = False
    live: dict[str, Pod] = field(default_factory=dict)  # leg id -> the pod running it
    served: dict[str, Pod] = field(default_factory=dict)  # leg id -> the pod that answered it

    def new_leg(self) -> str:
        return f"{self.client_id}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class _Adapter:
    """The LoRA adapter a leg runs under: its name, and the cache keys
    (adapter files) a pod's copy of it may have for this leg."""

    name: str
    keys: frozenset[str]

    def hash_key(self) -> str | None:
        """The cache key the prompt's block hashes are computed with (one of
        the allowed, the same every time)."""
        return min(self.keys, default=None)


# Codes a pod gives for the request itself (passed on; logged at debug).
_REQUEST_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.CANCELLED,
    }
)
# An IP address (v4, or v6 in brackets), with gRPC's "ipv4:"/"ipv6:" prefix
# and a port if present: what gRPC's own connection errors name.
_IP_ADDRESS = re.compile(
    r"(?:ipv[46]:)?(?:\[[0-9A-Fa-f:.%]+\]|\b\d{1,3}(?:\.\d{1,3}){3}\b)(?::\d+)?"
)


def _redact(details: str, addresses: Iterable[str]) -> str:
    """`details` without pod addresses (known ones, and any IP address)."""
    for address in sorted(addresses, key=len, reverse=True):
        details = details.replace(address, "<pod>")
    return _IP_ADDRESS.sub("<address>", details)


class RouterServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        prefill: PodPool | None,
        decode: PodPool,
        metrics: RouterMetrics | None = None,
        *,
        prefill_fallback: bool = True,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics or RouterMetrics()
        self.prefill_fallback = prefill_fallback
        self.started = time.monotonic()
        self._falling_back = False  # the last request fell back (for the log)
        self._releases: set[asyncio.Task[None]] = set()  # referenced until done
        self._calls: dict[str, _Call] = {}  # in flight, by the client's request_id

    # ---- Generate -----------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        self.metrics.requests.inc()
        self.metrics.running.inc()
        call: _Call | None = None
        try:
            call = self._begin(request.request_id)
            ids = await self._token_ids(request)
            adapter = self._check_lora(request.lora_name)
            async for resp in self._serve(call, request, ids, adapter):
                resp.request_id = call.client_id  # the pods saw the leg's id
                yield resp
        except _LegFailed as e:
            # Refused as a whole only if nothing ran anywhere (so nothing was
            # streamed either: a pod that answered ran).
            self.metrics.errors.labels(code=e.code.name).inc()
            await context.abort(e.code, e.details, refused_metadata(not e.maybe_ran))
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.cancelled.inc()
            raise
        finally:
            if call is not None:
                del self._calls[call.client_id]
            self.metrics.running.dec()

    def _begin(self, client_id: str) -> _Call:
        """The call in flight under `client_id`; INVALID_ARGUMENT if one is
        already (as a colocated pod refuses a live request's id)."""
        if client_id in self._calls:
            raise _LegFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: {client_id!r} is already in use by a live request",
            )
        call = self._calls[client_id] = _Call(client_id)
        return call

    async def _serve(
        self, call: _Call, request: pb.GenerateRequest, ids: list[int], adapter: _Adapter | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.prefill is not None:
            async for resp in self._disaggregated(call, request, ids, adapter):
                yield resp
            return
        whole = pb.GenerateRequest()
        whole.CopyFrom(request)
        whole.request_id = call.new_leg()
        async for resp in self._forward(
            self.decode, whole, ids, leg="colocated", call=call, adapter=adapter
        ):
            yield resp

    async def _disaggregated(
        self, call: _Call, request: pb.GenerateRequest, ids: list[int], adapter: _Adapter | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Both legs. From the moment the prefill leg is sent until a decode
        pod took its KV, leaving here (the client cancelled, a leg failed, or
        no decode leg is needed) releases the KV on the prefill pods that may
        hold it: at once instead of when the lease lapses."""
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
        prefill_req = _prefill_request(request, ids, max_tokens)
        prefill_req.request_id = call.new_leg()
        holders: list[Pod] = []  # prefill pods that may hold the leg's KV
        # Settled: nothing is held, or a decode pod has (or may have) it.
        settled = not prefill_req.HasField("kv_transfer_params")
        try:
            final: pb.GenerateResponse | None = None
            first: list[int] = []
            streamed = False
            try:
                async for resp in self._forward(
                    self.prefill,
                    prefill_req,
                    ids,
                    leg="prefill",
                    call=call,
                    adapter=adapter,
                    holders=holders,
                ):
                    first.extend(resp.token_ids)
                    final = resp if resp.finish_reason else final
                    streamed = True
                    yield _first_leg_response(resp, max_tokens)
            except _LegFailed as e:
                if streamed or not self._falls_back(e):
                    raise
                async for resp in self._fallback(call, request, ids, e):
                    yield resp
                return
            self._prefill_answered()
            if final is None or not final.HasField("kv_transfer_params"):
                settled = True  # the pod holds nothing
            if final is None or _ends_request(final, max_tokens):
                return
            decode_req = _decode_request(request, ids, first, max_tokens, final.kv_transfer_params)
            decode_req.request_id = call.new_leg()
            pod = call.served.get(prefill_req.request_id)
            try:
                async for resp in self._forward(
                    self.decode,
                    decode_req,
                    ids + first,
                    leg="decode",
                    call=call,
                    adapter=_same_files(adapter, pod),
                ):
                    if resp.finish_reason:
                        _whole_usage(resp, final, len(ids), len(first))
                    yield resp
                settled = True  # the decode pod read the KV (and told the prefill pod)
            except _LegFailed as e:
                # A decode pod that may have taken the leg may still be
                # reading: the prefill pod's lease ends that hold.
                settled = e.maybe_ran
                e.maybe_ran = True  # the prefill leg ran
                raise
        finally:
            if not settled:
                for pod in holders:
                    self._release_held_kv(pod, prefill_req.request_id)

    def _falls_back(self, error: _LegFailed) -> bool:
        return self.prefill_fallback and error.code == grpc.StatusCode.UNAVAILABLE

    async def _fallback(
        self, call: _Call, request: pb.GenerateRequest, ids: list[int], error: _LegFailed
    ) -> AsyncIterator[pb.GenerateResponse]:
        """No prefill pod answered: the whole request to a decode pod, as a
        colocated server would serve it (nothing was streamed yet)."""
        self.metrics.fallback()
        if not self._falling_back:
            self._falling_back = True
            logger.warning(
                "prefill fallback: %s; sending requests whole to decode pods until one answers",
                error.details,
            )
        logger.debug("request %s: prefill fallback", request.request_id)
        whole = _with_ids(request, ids)
        whole.request_id = call.new_leg()
        # Any decode pod's copy of the adapter will do: the whole request runs there.
        adapter = _Adapter(request.lora_name, self.decode.lora_keys(request.lora_name))
        async for resp in self._forward(
            self.decode,
            whole,
            ids,
            leg="colocated",
            call=call,
            adapter=adapter if request.lora_name else None,
        ):
            yield resp

    def _prefill_answered(self) -> None:
        if self._falling_back:
            self._falling_back = False
            logger.info(
                "a prefill pod answered again (%d prefill fallbacks so far)",
                self.metrics.num_prefill_fallbacks,
            )

    def _release_held_kv(self, pod: Pod, request_id: str) -> None:
        """Tells a prefill pod that no decode pod will read the blocks it
        may hold for `request_id` (else they wait for the lease). In the
        background: the client's answer does not wait for it."""
        self.metrics.releases.inc()
        task = asyncio.create_task(self._send_release(pod, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_release(self, pod: Pod, request_id: str) -> None:
        """The Abort RPC, which a pod takes for a release when `request_id`
        has finished there (the engine's release_held_kv) and for an abort
        while it runs: the prefill leg ended or was cancelled on the way,
        and either frees what it holds. No RPC of its own is needed."""
        try:
            await pod.stub.Abort(
                pb.AbortRequest(request_ids=[request_id]), timeout=5.0, metadata=pod.metadata
            )
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
        *,
        leg: str,
        call: _Call,
        adapter: _Adapter | None = None,
        holders: list[Pod] | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream one leg (`request`, under its leg id) from the best pod
        with `adapter`'s files; before its first answer, an unavailable pod
        (or one that aborts it unasked) is skipped for the next best. Each
        pod that may have taken the request (it did not refuse it) is in
        `holders`. A call the client aborted sends nothing more: it ends."""
        if call.aborted:
            yield _aborted(len(ids))
            return
        tried: list[Pod] = []
        maybe_ran = False  # whether a pod tried so far may have taken the request
        lora = adapter.name if adapter is not None else None
        keys = adapter.keys if adapter is not None else None
        lora_key = adapter.hash_key() if adapter is not None else None
        hashes = self._hashes(pool, ids, lora_key, request.cache_salt or None)
        leg_id = request.request_id
        while True:
            pod = pool.pick(hashes, exclude=tried, lora=lora, lora_keys=keys)
            if pod is None:
                if tried:
                    logger.warning(
                        "no %s pod available for %s (tried %s)",
                        pool.name,
                        leg_id,
                        ", ".join(p.address for p in tried),
                    )
                raise _LegFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no {pool.name} pod available",
                    maybe_ran=maybe_ran,
                )
            tried.append(pod)
            if holders is not None:
                holders.append(pod)
            answered = False
            pod.in_flight += 1
            call.live[leg_id] = pod
            self.metrics.legs.labels(leg=leg).inc()
            stream = pod.stub.Generate(request, metadata=pod.metadata)
            try:
                async for resp in stream:
                    if resp.finish_reason == pb.FINISH_REASON_ABORT and not call.aborted:
                        raise _PodAborted
                    if not answered:
                        answered = True
                        call.served[leg_id] = pod
                    yield resp
                return
            except _PodAborted:
                maybe_ran = True
                logger.warning(
                    "%s pod %s aborted %s unasked (draining?)%s",
                    pool.name,
                    pod.address,
                    leg_id,
                    "" if answered else ": trying another",
                )
                if not answered:
                    continue
                raise _LegFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{pool.name} pod aborted the request before it finished; retry it",
                    maybe_ran=True,
                ) from None
            except grpc.aio.AioRpcError as e:
                # Without the pod's word (a connection broken mid-call, say)
                # it may have taken the request.
                refused = not answered and was_refused(e)
                if refused and holders is not None:
                    holders.remove(pod)
                maybe_ran = maybe_ran or not refused
                if e.code() == grpc.StatusCode.UNAVAILABLE and not answered:
                    why = f"{e.code().name}: {e.details()}"
                    logger.warning(
                        "%s pod %s unavailable (%s): trying another", pool.name, pod.address, why
                    )
                    pool.set_state(pod, PodState.DOWN, why)
                    continue
                raise self._failed(pool, pod, e, maybe_ran) from e
            finally:
                pod.in_flight -= 1
                call.live.pop(leg_id, None)
                stream.cancel()  # a no-op once done; aborts the leg if we were cancelled

    def _failed(
        self, pool: PodPool, pod: Pod, error: grpc.aio.AioRpcError, maybe_ran: bool = False
    ) -> _LegFailed:
        """A pod's error as the client sees it: its code and details, with
        no pod address in them (the log has it)."""
        code, details = error.code(), error.details() or ""
        level = logging.DEBUG if code in _REQUEST_CODES else logging.WARNING
        logger.log(level, "%s pod %s: %s: %s", pool.name, pod.address, code.name, details)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            # The client got past the router's own check: the pod refused
            # the router, which is the router's problem, not the client's.
            return _LegFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"{pool.name} pod unavailable: it refused the router's credentials",
                maybe_ran=maybe_ran,
            )
        addresses = [p.address for p in self._all_pods()]
        return _LegFailed(
            code, f"{pool.name} pod: {_redact(details, addresses)}", maybe_ran=maybe_ran
        )

    def _hashes(
        self,
        pool: PodPool,
        ids: list[int],
        lora_key: str | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """The prompt's block hashes as the pool's engines compute them (the
        same function, keyed by a LoRA adapter's `lora_key` and the
        request's `cache_salt`), to match against their KV events."""
        if not pool.follow_kv_events:
            return []
        block_size = next((p.block_size for p in pool.pods if p.block_size), 0)
        if not block_size:
            return []
        return hash_chain(ids, block_size, cache_salt=cache_salt, lora_key=lora_key)

    def _check_lora(self, name: str) -> _Adapter | None:
        """The adapter `name` ("": the base model, None) as the request's
        legs may use it: the cache keys (files) every pool that would serve
        it has. INVALID_ARGUMENT when it is on no healthy pod of such a pool
        (each leg needs a pod with it), naming the adapters that are;
        FAILED_PRECONDITION when the pools have it from different files
        only. With no healthy pod at all it passes: the legs find no pod
        (UNAVAILABLE)."""
        if not name:
            return None
        pools = [p for p in (self.decode, self.prefill) if p is not None and p.any_healthy]
        loaded = [set(pool.lora_adapters()) for pool in pools]
        usable = set.intersection(*loaded) if loaded else {name}
        if name not in usable:
            raise _LegFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lora_name: unknown LoRA adapter {name!r}: loaded are {sorted(usable)}",
            )
        keys = {pool.name: pool.lora_keys(name) for pool in pools}
        common = frozenset.intersection(*keys.values()) if keys else frozenset()
        if keys and not common:
            each = ", ".join(f"{pool} {sorted(k)}" for pool, k in keys.items())
            raise _LegFailed(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lora_name: LoRA adapter {name!r} differs between the pools: no prefill "
                f"and decode pod have it from the same files (cache keys: {each}); "
                "load the same files under that name on both",
            )
        return _Adapter(name, common)

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
            return await getattr(pod.stub, method)(message, timeout=30.0, metadata=pod.metadata)
        except grpc.aio.AioRpcError as e:
            raise self._failed(self.decode, pod, e) from e

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Aborts the requests in flight here under the client ids named:
        each one's live legs, on their pods, by the legs' ids (so an id
        names nothing a pod holds for another request). Answers the ids
        that were in flight; the others are ignored, as a pod ignores them."""
        calls = [
            self._calls[rid] for rid in dict.fromkeys(request.request_ids) if rid in self._calls
        ]
        by_pod: dict[Pod, list[str]] = {}
        for call in calls:
            call.aborted = True  # a leg not yet sent is not sent
            for leg_id, pod in call.live.items():
                by_pod.setdefault(pod, []).append(leg_id)
        await asyncio.gather(*(self._abort_legs(pod, legs) for pod, legs in by_pod.items()))
        return pb.AbortResponse(aborted_request_ids=sorted(c.client_id for c in calls))

    async def _abort_legs(self, pod: Pod, leg_ids: list[str]) -> None:
        try:
            await pod.stub.Abort(
                pb.AbortRequest(request_ids=leg_ids), timeout=5.0, metadata=pod.metadata
            )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:  # UsageError: pod retired
            logger.warning("could not abort %s on pod %s: %s", leg_ids, pod.address, e)

    async def _forwarded(
        self, method: str, message: object, context: grpc.aio.ServicerContext
    ) -> object:
        """A unary RPC answered by a decode pod; its failure ends this call."""
        try:
            return await self._unary(method, message)
        except _LegFailed as e:
            self.metrics.errors.labels(code=e.code.name).inc()
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
        del info.lora_adapters[:]
        info.lora_adapters.extend(self._known_adapters())
        formats = {info.weight_format}.union(*(pool.weight_formats() for pool in self._pools()))
        info.weight_format = _join_weight_formats(formats)
        return info

    async def GetServerStatus(
        self, request: pb.GetServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStatus:
        """The router's own uptime and figures (fields 40-49), and the sum
        of its pods' counts (their weight formats: the distinct ones) over
        the pods that answer."""
        pods = self._all_pods()
        answers = await asyncio.gather(
            *(p.stub.GetServerStatus(request, timeout=5.0, metadata=p.metadata) for p in pods),
            return_exceptions=True,
        )
        total = pb.ServerStatus()
        adapters = []
        formats = set()
        for status in answers:
            if isinstance(status, pb.ServerStatus):
                _add_counts(total, status)
                adapters.append(status.lora_adapters)
                formats.add(status.weight_format)
            elif not isinstance(status, grpc.aio.AioRpcError | grpc.aio.UsageError):
                raise status  # UsageError: a pod retired meanwhile
        if total.prefix_cache_queries:
            total.prefix_cache_hit_rate = total.prefix_cache_hits / total.prefix_cache_queries
        total.uptime_seconds = time.monotonic() - self.started
        total.num_prefill_fallbacks = self.metrics.num_prefill_fallbacks
        total.num_pods = len(pods)
        total.num_pods_healthy = sum(p.healthy for p in pods)
        total.lora_adapters.extend(_union_adapters(adapters))
        total.weight_format = _join_weight_formats(formats)
        return total

    # ---- LoRA adapters: every pod's ---------------------------------------------

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapter:
        """On every healthy pod, or on none: if one fails, those that loaded
        it unload it again and the call fails as that pod did."""
        results = await self._on_healthy_pods("LoadLoraAdapter", request, 120.0, context)
        loaded = [(pod, r) for pod, r in results if isinstance(r, pb.LoraAdapter)]
        failed = [r for _, r in results if isinstance(r, _LegFailed)]
        if failed:
            undo = pb.UnloadLoraAdapterRequest(lora_name=request.lora_name)
            await asyncio.gather(
                *(self._call(pod, "UnloadLoraAdapter", undo, 30.0) for pod, _ in loaded),
                return_exceptions=True,
            )
            await self._abort(context, failed[0])
        for pod, adapter in loaded:
            pod.set_lora(request.lora_name, adapter)
        logger.info("LoRA adapter %r loaded on %d pods", request.lora_name, len(loaded))
        return loaded[0][1]

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        """From every healthy pod that has it; pods without it (or without
        LoRA) are fine as long as one had it."""
        name = request.lora_name
        known = self._known_adapters()  # before: the answer lists what was loaded
        results = await self._on_healthy_pods("UnloadLoraAdapter", request, 30.0, context)
        unloaded = [(pod, r) for pod, r in results if isinstance(r, pb.UnloadLoraAdapterResponse)]
        for pod, _ in unloaded:
            pod.set_lora(name, None)
        not_there = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        failed = [r for _, r in results if isinstance(r, _LegFailed)]
        if broken := [f for f in failed if f.code not in not_there]:
            await self._abort(context, broken[0])
        if not unloaded:
            if failed and all(f.code == grpc.StatusCode.FAILED_PRECONDITION for f in failed):
                await self._abort(context, failed[0])
            names = sorted(a.lora_name for a in known if a.lora_name != name)
            await self._abort(
                context,
                _LegFailed(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"lora_name: unknown LoRA adapter {name!r}: loaded are {names}",
                ),
            )
        logger.info("LoRA adapter %r unloaded from %d pods", name, len(unloaded))
        return unloaded[0][1]

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoraAdaptersResponse:
        """The union of the healthy pods' (asked now, not as last polled)."""
        results = await self._on_healthy_pods("ListLoraAdapters", request, 10.0, context)
        lists = [r.adapters for _, r in results if isinstance(r, pb.ListLoraAdaptersResponse)]
        return pb.ListLoraAdaptersResponse(adapters=_union_adapters(lists))

    async def _on_healthy_pods(
        self, method: str, message: object, timeout: float, context: grpc.aio.ServicerContext
    ) -> list[tuple[Pod, object]]:
        """`method` on every healthy pod at once: (pod, its answer or the
        _LegFailed its error is). The call ends UNAVAILABLE if no pod is healthy."""
        pods = [(pool, pod) for pool in self._pools() for pod in pool.pods if pod.healthy]
        if not pods:
            await self._abort(context, _LegFailed(grpc.StatusCode.UNAVAILABLE, "no pod available"))
        answers = await asyncio.gather(
            *(self._call(pod, method, message, timeout) for _, pod in pods),
            return_exceptions=True,
        )
        results: list[tuple[Pod, object]] = []
        for (pool, pod), answer in zip(pods, answers, strict=True):
            if isinstance(answer, grpc.aio.AioRpcError):
                answer = self._failed(pool, pod, answer)
            elif isinstance(answer, grpc.aio.UsageError):  # the pod retired meanwhile
                answer = _LegFailed(grpc.StatusCode.UNAVAILABLE, f"{pool.name} pod retired")
            elif isinstance(answer, BaseException):
                raise answer
            results.append((pod, answer))
        return results

    async def _call(self, pod: Pod, method: str, message: object, timeout: float) -> object:
        return await getattr(pod.stub, method)(message, timeout=timeout, metadata=pod.metadata)

    async def _abort(self, context: grpc.aio.ServicerContext, error: _LegFailed) -> NoReturn:
        self.metrics.errors.labels(code=error.code.name).inc()
        await context.abort(error.code, error.details)
        raise error  # context.abort raises; this keeps the type checker informed

    def _known_adapters(self) -> list[pb.LoraAdapter]:
        """The adapters on the healthy pods as last polled (or changed through the router)."""
        return _union_adapters([list(pool.lora_adapters().values()) for pool in self._pools()])

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

    def _all_pods(self) -> list[Pod]:
        return [pod for pool in self._pools() for pod in pool.pods]


_INTEGERS = frozenset(
    {
        descriptor.FieldDescriptor.TYPE_UINT32,
        descriptor.FieldDescriptor.TYPE_UINT64,
        descriptor.FieldDescriptor.TYPE_INT32,
        descriptor.FieldDescriptor.TYPE_INT64,
    }
)
# A router's own fields: never summed from pods.
_ROUTER_FIELDS = range(40, 50)


def _join_weight_formats(formats: Iterable[str]) -> str:
    """The pods' weight formats as one: the distinct ones, sorted, joined
    with "," ("" when no pod said one)."""
    return ",".join(sorted({f for f in formats if f}))


def _add_counts(total: pb.ServerStatus, status: pb.ServerStatus) -> None:
    """Adds a pod's counts into `total`, the router's own fields aside."""
    _add_message_counts(total, status, skip=_ROUTER_FIELDS)


def _add_message_counts(total: Message, status: Message, skip: range = range(0)) -> None:
    """Adds integer fields (counts of requests, tokens, events), integer-valued
    maps (counts by kind), repeated integers (counts by position, element by
    element: pods may differ in length) and the counts in the messages a pod
    set (left unset when none did). By type, not by name, so a count added
    to ServerStatus is summed without a change here."""
    for field_desc in status.DESCRIPTOR.fields:
        if field_desc.number in skip:
            continue
        name = field_desc.name
        value = getattr(status, name)
        entry = field_desc.message_type
        if entry is not None and entry.GetOptions().map_entry:
            if entry.fields_by_name["value"].type in _INTEGERS:
                counts = getattr(total, name)
                for key, count in value.items():
                    counts[key] += count
        elif isinstance(value, Message):
            if status.HasField(name):
                _add_message_counts(getattr(total, name), value)
        elif field_desc.type in _INTEGERS:
            if isinstance(value, int):
                setattr(total, name, getattr(total, name) + value)
            else:  # repeated
                counts = getattr(total, name)
                for i, count in enumerate(value):
                    if i < len(counts):
                        counts[i] += count
                    else:
                        counts.append(count)


def _union_adapters(lists: Iterable[Sequence[pb.LoraAdapter]]) -> list[pb.LoraAdapter]:
    """One entry per (name, cache_key), by name: pods that loaded the same
    files under a name agree; pods that differ show both."""
    seen: dict[tuple[str, str], pb.LoraAdapter] = {}
    for adapters in lists:
        for adapter in adapters:
            seen.setdefault((adapter.lora_name, adapter.cache_key), adapter)
    return [seen[key] for key in sorted(seen)]


def _with_ids(request: pb.GenerateRequest, ids: list[int]) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.ClearField("input")
    out.token_ids.ids.extend(ids)
    out.ClearField("kv_transfer_params")
    return out


def _aborted(num_prompt_tokens: int) -> pb.GenerateResponse:
    """The end of a call the client aborted before a leg was sent."""
    resp = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ABORT)
    resp.usage.prompt_tokens = num_prompt_tokens
    return resp


def _same_files(adapter: _Adapter | None, prefill_pod: Pod | None) -> _Adapter | None:
    """The adapter for the decode leg: the files the prefill pod computed
    the KV with (its copy's cache key), which the decode pod must run."""
    if adapter is None or prefill_pod is None:
        return adapter
    copy = prefill_pod.loras.get(adapter.name)
    if copy is None or copy.cache_key not in adapter.keys:
        return adapter  # unloaded since: any of the keys the pools share
    return _Adapter(adapter.name, frozenset({copy.cache_key}))


def _whole_usage(
    resp: pb.GenerateResponse, first_leg: pb.GenerateResponse, num_prompt: int, num_first: int
) -> None:
    """The decode leg's last response's usage made the request's, as a
    colocated server counts it: the prompt, both legs' tokens, and the
    prefill pod's prefix-cache hit (the decode pod counts the prompt it was
    handed as cached, which says nothing of the request's)."""
    resp.usage.prompt_tokens = num_prompt
    resp.usage.completion_tokens += num_first
    resp.usage.cached_tokens = first_leg.usage.cached_tokens


def _max_tokens(request: pb.GenerateRequest) -> int:
    """The whole request's max_tokens (the legs split it), checked with
    min_tokens as a pod checks them: the legs' own limits would hide a bad
    value (the prefill leg asks for one token) or misstate it."""
    sampling = request.sampling
    if sampling.n > 1:
        # The legs hand one request's KV over; n choices would be n hand-overs.
        raise _LegFailed(
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.n: n > 1 is not supported through tandem router; "
            "use the smg gateway (tandem gateway) or a colocated pod",
        )
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
        out.kv_transfer_params.CopyFrom(
            dict_to_struct(KVTransferParams(do_remote_decode=True).to_dict())
        )
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
    # The prefill leg sent them in its (the client's first) response; the
    # decode pod never computes the prompt, so it refuses to be asked.
    out.sampling.ClearField("prompt_logprobs")
    return out


def _ends_request(resp: pb.GenerateResponse, max_tokens: int) -> bool:
    """Whether the prefill leg's end is the request's end: it stopped (EOS,
    a stop string or id) or the client asked for one token."""
    return resp.finish_reason != pb.FINISH_REASON_LENGTH or max_tokens == 1


class TandemRouter:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.prefill = self._pool("prefill", config.prefill) if config.prefill else None
        self.decode = self._pool("decode", config.decode)
        self.servicer = RouterServicer(
            self.prefill, self.decode, self.metrics, prefill_fallback=config.prefill_fallback
        )
        self.metrics.watch_pools(
            lambda: [(p.name, len(p.pods), p.num_healthy) for p in self.servicer._pools()]
        )
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task[None] | None = None

    def _pool(self, name: str, addresses: tuple[str, ...]) -> PodPool:
        return PodPool(
            name,
            addresses,
            follow_kv_events=name == "decode",  # prefix-aware routing is the decode pool's
            poll_seconds=self.config.poll_seconds,
            resolve_seconds=self.config.resolve_seconds,
            access=self.config.pods,
            on_transition=self.metrics.pod_transition,
        )

    async def start(self) -> int:
        """Listens (and serves metrics); raises ListenError if the port (or
        the metrics port) is taken."""
        cfg = self.config
        # As `tandem serve`'s: bodies that do not parse are refused before
        # the API-key check; a port another server holds is refused.
        server = new_server(cfg.api_key)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
        self.port = listen(server, cfg.host, cfg.port, cfg.tls.credentials())
        if cfg.metrics_port is not None:
            try:
                self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            except OSError as e:
                raise ListenError(
                    f"--metrics-port: cannot listen on {cfg.metrics_host}:{cfg.metrics_port}: "
                    f"{e.strerror or e}"
                ) from None
            logger.info("metrics on http://%s:%d/metrics", cfg.metrics_host, cfg.metrics_port)
        for pool in self.servicer._pools():
            pool.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        self._health_task = asyncio.create_task(self._track_health())
        logger.info(
            "router on %s (%s%s)",
            host_port(cfg.host, self.port),
            "TLS" if cfg.tls.cert is not None else "plaintext",
            ", API key required" if cfg.api_key else "",
        )
        return self.port

    def _serving(self) -> bool:
        """Whether requests can be served: a healthy decode pod, and a
        healthy prefill pod too unless requests may fall back without one."""
        prefill = self.prefill
        if prefill is not None and not self.config.prefill_fallback and not prefill.any_healthy:
            return False
        return self.decode.any_healthy

    async def _track_health(self) -> None:
        serving: bool | None = None
        while True:
            now = self._serving()
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
    """Runs the router until SIGTERM/SIGINT. Raises ListenError (a
    ConfigError) if its port or metrics port is taken."""
    router = TandemRouter(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with stop_signals(loop, lambda _signum: stop.set()):
        await stop.wait()
        await router.stop()
