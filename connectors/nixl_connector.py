"""NixlConnector: prefill and decode pods move KV blocks with one-sided READs.

How one request goes (P/D through the router):

1. Prefill pod (kv_producer): the request (``do_remote_decode``, max_tokens
   1) finishes; ``request_finished`` keeps its blocks (delay_free) and
   returns kv_transfer_params naming this engine's NIXL agent, its side
   channel (the pod's gRPC address), the request's id and its prompt
   blocks, and the nonce of its hold on them. The worker holds them under
   a lease (see ``nixl_worker`` and ``nixl_holds``).
2. Decode pod (kv_consumer): when the request arrives the worker starts the
   handshake with the producer (``GetHandshake`` over gRPC, cached per peer
   incarnation) and heartbeats for it. The scheduler parks it in
   WAITING_FOR_REMOTE_KVS with blocks allocated for the prompt blocks it
   lacks; the worker posts one READ of every layer's K and V of those
   blocks; when NIXL reports it done, the worker claims the hold through the
   producer's side channel (``ReleaseHold``), which frees the producer's
   copy and confirms the blocks were held throughout the READ; only then is
   the request in ``finished_recving``.
3. Anything failing on the way is reported through
   ``get_block_ids_with_load_errors`` and recomputed on the decode pod.
4. A request reads at most once. Once its READ was posted (or it had
   nothing to read) the producer may free those blocks, so a request
   preempted on the decode pod later recomputes its prompt locally (its
   loaded blocks stay in the prefix cache, so usually only the evicted
   ones); it never reads the old hold again.

Extra config (``kv_connector_extra_config``; ``NixlOptions`` below):
``side_channel_host`` and ``side_channel_port`` (where peers reach this
pod's gRPC server; ``tandem serve`` fills them in from --host/--port),
``handshake_timeout`` (seconds, default 10). The lease and transfer
timeout are ``--kv-lease-seconds`` and ``--kv-transfer-timeout``.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from connectors.nixl_handshake import PeerInfo, compat_facts, compat_hash, fetch_peer_info
from connectors.nixl_holds import NONCE_HEX, ClaimSender
from connectors.nixl_worker import NixlWorker, RecvSpec, RemoteSource
from engine.kv_transfer.base import (
    Claim,
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.kv_transfer.options import SideChannelOptions, option
from engine.kv_transfer.params import KVTransferParams
from engine.request import RequestStatus

if TYPE_CHECKING:
    from engine.kv_cache.manager import KVCacheBlocks
    from engine.outputs import KVConnectorOutput
    from engine.request import Request
    from engine.sched.output import SchedulerOutput
    from engine.stats import KVConnectorStats

logger = logging.getLogger(__name__)

# An idle producer polls NIXL this often (a READ of its blocks progresses
# only while it does): an idle pod measured 1.3% of a core (3.3% at 5 ms).
IDLE_POLL_SECONDS = 0.02


@dataclass(frozen=True)
class NixlOptions(SideChannelOptions):
    handshake_timeout: float = option(
        10.0, "seconds for a peer's handshake and for a hold's release call"
    )


@dataclass(frozen=True)
class HoldSpec:
    """Producer: keep a finished request's blocks for the consumer that
    presents ``nonce``."""

    req_id: str
    nonce: str
    block_ids: tuple[int, ...]


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    holds: list[HoldSpec] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # producer: nobody will read these
    expects: list[tuple[str, RemoteSource]] = field(default_factory=list)  # consumer
    recvs: list[RecvSpec] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # consumer: no READ will come


class NixlConnector(KVConnectorBase):
    needs_side_channel = True  # a consumer fetches the producer's handshake there
    options_class: ClassVar[type[NixlOptions]] = NixlOptions

    def __init__(self, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(role, context)
        config = context.config
        options = NixlOptions.of(config)
        self.block_size = context.layout.block_size
        self.is_producer = config.is_producer
        self.is_consumer = config.is_consumer
        self.agent_name = f"tandem-{context.engine_id}"
        host = options.side_channel_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal, as gRPC targets write it
        self.address = f"{host}:{options.side_channel_port}"
        self.compat = compat_facts(context.model_name, context.layout)
        self.compat_hash = compat_hash(self.compat)
        self.handshake_timeout = options.handshake_timeout
        # scheduler half
        self._meta = NixlConnectorMetadata()
        self._sources: dict[str, RemoteSource | None] = {}
        self._local_tokens: dict[str, int] = {}
        self._inflight: dict[str, RecvSpec] = {}
        # Requests that had their one chance to read: once a READ was posted
        # (or nothing was left to read) the producer may free and reuse its
        # blocks, so a preempted request recomputes; it never reads again.
        self._consumed: set[str] = set()
        # worker half
        self.worker: NixlWorker | None = None
        self._payload: bytes | None = None
        self._claims = ClaimSender(self.handshake_timeout)

    # ==== scheduler half ===================================================

    def request_added(self, request: Request) -> None:
        source = self._source(request)
        if source is not None:
            self._meta.expects.append((request.request_id, source))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        source = self._source(request)
        if source is None or request.request_id in self._consumed:
            return 0, False
        self._local_tokens[request.request_id] = num_computed_tokens
        # Every prompt token the producer computed, partial last block too;
        # the request's last token is always computed here.
        last = min(source.num_tokens, len(source.block_ids) * self.block_size)
        count = max(0, min(last, request.num_tokens - 1) - num_computed_tokens)
        return count, count > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        source = self._source(request)
        local = self._local_tokens.pop(req_id, 0)
        if source is None or req_id in self._consumed:
            return
        self._consumed.add(req_id)
        if num_external_tokens == 0:
            self._meta.ended.append(req_id)  # all local: the producer may free
            return
        first = local // self.block_size
        end = -(-(local + num_external_tokens) // self.block_size)
        spec = RecvSpec(
            req_id,
            source,
            local_ids=blocks.get_block_ids()[0][first:end],  # one KV cache group
            remote_ids=list(source.block_ids[first:end]),
        )
        self._meta.recvs.append(spec)
        self._inflight[req_id] = spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving or ():
            self._inflight.pop(req_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        req_id = request.request_id
        self._local_tokens.pop(req_id, None)
        self._consumed.discard(req_id)
        if self._sources.pop(req_id, None) is not None:
            self._meta.ended.append(req_id)
        # A READ under way writes into these blocks: they wait for it.
        delay_free = self._inflight.pop(req_id, None) is not None
        params = request.kv_transfer_params
        if self.is_producer and params is not None and params.do_remote_decode:
            return self._offer(request, block_ids)
        return delay_free, None

    def _offer(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Producer: keep a finished request's prompt blocks (the last one
        partial) for the consumer; kv_transfer_params say where they are."""
        if request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            return False, None  # aborted or failed: nobody will read
        computed = request.num_computed_tokens
        held = min(-(-computed // self.block_size), len(block_ids))
        nonce = secrets.token_hex(NONCE_HEX // 2)
        params = KVTransferParams(
            do_remote_prefill=True,
            kv_connector="nixl",
            remote_engine_id=self.context.engine_id if self.context else "",
            remote_agent=self.agent_name,
            remote_address=self.address,
            remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids[:held]),
            remote_num_tokens=min(computed, held * self.block_size),
            remote_compat=self.compat_hash,
            remote_hold=nonce,
            num_blocks=held,
        )
        if held == 0:
            return False, params
        self._meta.holds.append(HoldSpec(request.request_id, nonce, tuple(block_ids[:held])))
        return True, params

    def request_released(self, request: Request) -> None:
        if self.is_producer:
            self._meta.released.append(request.request_id)

    def _source(self, request: Request) -> RemoteSource | None:
        """Where a consumer request's KV is; None if it reads nothing (not
        a remote prefill, or malformed params). Compatibility is checked at
        the handshake, which names what differs."""
        req_id = request.request_id
        if req_id in self._sources:
            return self._sources[req_id]
        params = request.kv_transfer_params
        source = None
        if self.is_consumer and params and params.do_remote_prefill and params.remote_agent:
            try:
                source = RemoteSource.from_params(params)
            except ValueError as e:
                logger.error("request %s: %s; recomputing its prompt", req_id, e)
        self._sources[req_id] = source
        return source

    # ==== worker half ======================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from connectors.nixl_endpoint import NixlEndpoint

        assert self.context is not None
        endpoint = NixlEndpoint(self.agent_name, list(kv_caches.values()))
        config = self.context.config
        self.worker = NixlWorker(
            endpoint,
            self.compat,
            lease=config.kv_lease_seconds,
            timeout=config.kv_transfer_timeout,
            fetch=self._fetch,
            claim=self._claims.send,
        )
        self._payload = PeerInfo(
            agent_name=self.agent_name,
            agent_metadata=endpoint.metadata(),
            num_blocks=endpoint.num_blocks,
            half_bytes=endpoint.half_bytes,
            layer_addrs=endpoint.layer_addrs,
            compat=self.compat,
            mem_type=endpoint.mem_type,
            device_id=endpoint.device_id,
        ).to_bytes()

    def _fetch(self, address: str) -> PeerInfo:
        return fetch_peer_info(address, self.handshake_timeout)

    def side_channel_payload(self) -> bytes | None:
        return self._payload

    @property
    def idle_poll_seconds(self) -> float | None:  # type: ignore[override]
        # A consumer may still be READing blocks of a hold that ended (it
        # then recomputes), and its READ completes only while we poll.
        return IDLE_POLL_SECONDS if self.worker is not None and self.is_producer else None

    def poll_idle(self) -> None:
        if self.worker is not None:
            self.worker.poll_idle()

    def release_hold(self, claim: bytes) -> Claim | None:
        if self.worker is None or not self.is_producer:
            return None
        return self.worker.claim(claim)

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._metadata
        if self.worker is None or not isinstance(meta, NixlConnectorMetadata):
            return
        now = time.monotonic()
        for hold in meta.holds:
            self.worker.hold(hold.req_id, hold.nonce, hold.block_ids, now)
        for req_id in meta.released:
            self.worker.release(req_id)
        for req_id, source in meta.expects:
            self.worker.expect(req_id, source)
        for spec in meta.recvs:
            self.worker.receive(spec, now)
        for req_id in meta.ended:
            self.worker.end(req_id)

    def wait_for_save(self) -> None:
        pass  # the consumer reads; the producer only keeps its blocks

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        sending, recving = self.worker.poll(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid() if self.worker is not None else set()

    def take_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self._claims.close()
