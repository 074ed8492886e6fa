"""The router's view of its pods: load, health and which prefixes each holds.

Each pod is polled with GetServerStatus (load: running + waiting requests,
KV usage) and, for decode and colocated pods, followed through
SubscribeKvEvents: the set of block hashes it holds, as llm-d's and
Dynamo's routers keep it. `PodPool.pick` prefers the pod holding the
longest prefix of a prompt's block hashes, then the least loaded. The
status also lists the LoRA adapters each pod has loaded: a request naming
one is only sent to a pod that has it.

A pool address whose host is a DNS name (a Kubernetes headless Service)
stands for every address it resolves to: one pod each, re-resolved every few
seconds. An IP literal (or any other gRPC target) is one pod, used as given.

Pods that require an API key or TLS are reached as `PodAccess` says. Each
pod's state (up, draining, down) is logged once per change, with the reason
when it is down (unreachable, or refusing the router's key).
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

import grpc

from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.tls import ClientTLS, open_channel

logger = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PodAccess:
    """How the router reaches its pods: the API key they require (sent as
    `authorization: Bearer KEY` on every call) and TLS towards them."""

    api_key: str | None = None
    tls: ClientTLS = field(default_factory=ClientTLS)

    @property
    def metadata(self) -> Metadata:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


class PodState(enum.Enum):
    UNKNOWN = "unknown"  # not polled yet
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"


Transition = Callable[[str, bool], None]
"""(pool name, whether the pod is now healthy): called when a pod turns
healthy or unhealthy."""


@dataclass(eq=False)  # a pod is itself, whatever its fields say
class Pod:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerationStub
    metadata: Metadata = ()  # sent with every call (the pods' API key)
    state: PodState = PodState.UNKNOWN
    load: float = 0.0  # running + waiting, plus what this router sent since the last poll
    block_size: int = 0
    max_model_len: int = 0  # 0 until the pod's GetModelInfo answered
    weight_format: str = ""  # its weights' format in memory, as its last status said
    blocks: set[bytes] = field(default_factory=set)
    # LoRA adapters loaded there, by name (its last status, or the router's
    # own Load/Unload through it since).
    loras: dict[str, pb.LoraAdapter] = field(default_factory=dict)
    # Bumped by each change the router makes to `loras` itself: a status
    # asked for before it (and answered after) is stale about adapters.
    loras_version: int = 0
    in_flight: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # its polling and events

    @property
    def healthy(self) -> bool:
        return self.state == PodState.UP

    def set_lora(self, name: str, adapter: pb.LoraAdapter | None) -> None:
        """Records a load (`adapter`) or unload (None) the router just made."""
        if adapter is None:
            self.loras.pop(name, None)
        else:
            self.loras[name] = adapter
        self.loras_version += 1

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        for i, block_hash in enumerate(hashes):
            if block_hash not in self.blocks:
                return i
        return len(hashes)


Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) -> the host's IP addresses; [] if it has none, OSError if
DNS could not answer."""

# A gRPC target's address with a DNS name: "name:port".
_NAME_PORT = re.compile(r"([A-Za-z0-9.-]+):([0-9]+)")
# How long a retired pod's open calls may go on. It may be draining: Kubernetes
# takes a terminating pod out of DNS first, and its drain ends them sooner.
RETIRE_GRACE_SECONDS = 3600.0


async def resolve_host(host: str, port: int) -> list[str]:
    """The default `Resolver`: getaddrinfo in the event loop's executor (it blocks)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []  # NXDOMAIN: a headless Service with no ready pod
        raise
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def dns_name(address: str) -> tuple[str, int] | None:
    """(host, port) when `address` is "name:port" with a DNS name; None for an
    IP literal or any other gRPC target."""
    match = _NAME_PORT.fullmatch(address)
    if match is None:
        return None
    try:
        ipaddress.ip_address(match[1])
        return None
    except ValueError:
        return match[1], int(match[2])


def _pod_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class PodPool:
    """Pods of one kind (prefill, or decode/colocated). Start with `start()`,
    stop with `close()`."""

    def __init__(
        self,
        name: str,
        addresses: Sequence[str],
        *,
        follow_kv_events: bool,
        poll_seconds: float,
        resolve_seconds: float = 5.0,
        resolver: Resolver = resolve_host,
        access: PodAccess | None = None,
        on_transition: Transition | None = None,
    ) -> None:
        self.name = name
        self.follow_kv_events = follow_kv_events
        self.poll_seconds = poll_seconds
        self.resolve_seconds = resolve_seconds
        self._resolver = resolver
        self.access = access or PodAccess()
        self._on_transition = on_transition
        # Per address given, its pods by their own address; in the order given,
        # which `pick` keeps among equals.
        self._by_address: dict[str, dict[str, Pod]] = {}
        self._names: dict[str, tuple[str, int]] = {}
        for address in addresses:
            name_port = dns_name(address)
            if name_port is None:
                self._by_address[address] = {address: self._new_pod(address)}
            else:
                self._by_address[address] = {}
                self._names[address] = name_port
        self.pods: list[Pod] = []
        self._list_pods()
        self._unresolved: set[str] = set()  # names already logged as resolving to nothing
        self._retiring: list[Pod] = []
        self._resolving: asyncio.Task[None] | None = None
        self._started = False

    def start(self) -> None:
        self._started = True
        for pod in self.pods:
            self._start_pod(pod)
        if self._names:
            self._resolving = asyncio.create_task(self._track_dns())

    async def close(self) -> None:
        pods = [*self.pods, *self._retiring]
        tasks = [task for pod in pods for task in pod.tasks]
        if self._resolving is not None:
            tasks.append(self._resolving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pod in pods:
            await pod.channel.close()

    async def resolve(self) -> None:
        """Resolve each DNS name once: a pod for each new address, and the
        pods of addresses gone retired."""
        for address, (host, port) in self._names.items():
            try:
                ips = await self._resolver(host, port)
            except (OSError, UnicodeError) as e:
                # DNS did not answer (or the name is no DNS name: UnicodeError): keep the
                # pods we know, if any; their polling tells their health.
                self._log_unresolved(address, f"cannot be resolved ({e})")
                continue
            if not ips:
                self._log_unresolved(address, "resolves to no address")
            elif address in self._unresolved:
                self._unresolved.discard(address)
                logger.info("%s address %s resolves again", self.name, address)
            self._update(address, [_pod_address(ip, port) for ip in ips])
        self._list_pods()

    def _log_unresolved(self, address: str, why: str) -> None:
        if address not in self._unresolved:
            self._unresolved.add(address)
            logger.warning("%s address %s %s: no pod from it for now", self.name, address, why)

    def _update(self, address: str, wanted: list[str]) -> None:
        pods = self._by_address[address]
        for pod_address in wanted:
            if pod_address not in pods:
                logger.info("%s pod %s added (%s)", self.name, pod_address, address)
                pods[pod_address] = pod = self._new_pod(pod_address)
                if self._started:
                    self._start_pod(pod)
        for pod_address in [a for a in pods if a not in wanted]:
            logger.info("%s pod %s retired (gone from %s)", self.name, pod_address, address)
            self._retire(pods.pop(pod_address))

    def _list_pods(self) -> None:
        # A new list, not an update: a caller going through the old one (awaiting
        # each pod) is not disturbed.
        self.pods = [pod for pods in self._by_address.values() for pod in pods.values()]

    def _new_pod(self, address: str) -> Pod:
        channel = open_channel(address, self.access.tls)
        stub = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
        return Pod(address, channel, stub, self.access.metadata)

    def set_state(self, pod: Pod, state: PodState, why: str = "") -> None:
        """Records what is known of `pod`, logging each change once (the
        address is logged here, never sent to clients)."""
        if state == pod.state:
            return
        was_healthy = pod.healthy
        pod.state = state
        if state == PodState.UP:
            logger.info("%s pod %s is up", self.name, pod.address)
        elif state == PodState.DRAINING:
            logger.warning("%s pod %s is draining: no new requests to it", self.name, pod.address)
        elif state == PodState.DOWN:
            logger.warning("%s pod %s is down: %s", self.name, pod.address, why or "unreachable")
        if pod.healthy != was_healthy and self._on_transition is not None:
            self._on_transition(self.name, pod.healthy)

    def _start_pod(self, pod: Pod) -> None:
        pod.tasks.append(asyncio.create_task(self._poll(pod)))
        if self.follow_kv_events:
            pod.tasks.append(asyncio.create_task(self._follow(pod)))

    def _retire(self, pod: Pod) -> None:
        """Stop following the pod; its channel closes once the calls on it
        (requests picked before) have ended."""
        pod.state = PodState.DOWN  # gone from DNS: not a death to report
        for task in pod.tasks:
            task.cancel()
        self._retiring.append(pod)
        pod.tasks.append(asyncio.create_task(self._close_retired(pod, list(pod.tasks))))

    async def _close_retired(self, pod: Pod, tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await pod.channel.close(grace=RETIRE_GRACE_SECONDS)
        self._retiring.remove(pod)

    async def _track_dns(self) -> None:
        while True:
            await self.resolve()
            await asyncio.sleep(self.resolve_seconds)

    @property
    def any_healthy(self) -> bool:
        return any(p.healthy for p in self.pods)

    @property
    def num_healthy(self) -> int:
        return sum(p.healthy for p in self.pods)

    def lora_adapters(self) -> dict[str, pb.LoraAdapter]:
        """The adapters loaded on this pool's healthy pods, by name (the
        first pod's, where pods differ)."""
        found: dict[str, pb.LoraAdapter] = {}
        for pod in self.pods:
            if pod.healthy:
                for name, adapter in pod.loras.items():
                    found.setdefault(name, adapter)
        return found

    def lora_keys(self, name: str) -> frozenset[str]:
        """The cache keys (which adapter files) the adapter `name` has on
        this pool's healthy pods: more than one where pods loaded different
        files under the name."""
        return frozenset(
            adapter.cache_key
            for pod in self.pods
            if pod.healthy and (adapter := pod.loras.get(name)) is not None
        )

    def weight_formats(self) -> set[str]:
        """The weight formats of this pool's healthy pods (those that said one)."""
        return {p.weight_format for p in self.pods if p.healthy and p.weight_format}

    def max_model_len(self) -> int:
        """The smallest max_model_len among the pods that have said theirs
        (a request that fits it fits any of them); 0 if none has yet."""
        known = [p.max_model_len for p in self.pods if p.max_model_len]
        return min(known, default=0)

    def pick(
        self,
        hashes: Sequence[bytes] = (),
        exclude: Sequence[Pod] = (),
        lora: str | None = None,
        lora_keys: Collection[str] | None = None,
    ) -> Pod | None:
        """The pod holding the longest prefix of `hashes`, then the least
        loaded, among those with the LoRA adapter `lora` loaded (if given),
        from files whose cache key is in `lora_keys` (if given: KV computed
        under one adapter's files is only good under the same files); None
        if no healthy pod is left."""
        candidates = [
            p
            for p in self.pods
            if p.healthy and p not in exclude and _has_adapter(p, lora, lora_keys)
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda p: (p.prefix_blocks(hashes), -(p.load + p.in_flight)))

    async def _poll(self, pod: Pod) -> None:
        while True:
            try:
                loras_version = pod.loras_version
                status = await pod.stub.GetServerStatus(
                    pb.GetServerStatusRequest(),
                    timeout=max(1.0, 2 * self.poll_seconds),
                    metadata=pod.metadata,
                )
                if not pod.block_size:
                    info = await pod.stub.GetModelInfo(
                        pb.GetModelInfoRequest(), timeout=5.0, metadata=pod.metadata
                    )
                    pod.block_size = info.block_size
                    pod.max_model_len = info.max_model_len
                pod.load = status.num_running + status.num_waiting
                pod.weight_format = status.weight_format
                if pod.loras_version == loras_version:
                    pod.loras = {a.lora_name: a for a in status.lora_adapters}
                self.set_state(pod, PodState.DRAINING if status.draining else PodState.UP)
            except grpc.aio.AioRpcError as e:
                self.set_state(pod, PodState.DOWN, f"{e.code().name}: {e.details()}")
                pod.blocks.clear()
            await asyncio.sleep(self.poll_seconds)

    async def _follow(self, pod: Pod) -> None:
        """Mirror the pod's cached block hashes; resubscribe after a break
        (starting from empty: AllBlocksCleared semantics)."""
        while True:
            try:
                call = pod.stub.SubscribeKvEvents(
                    pb.SubscribeKvEventsRequest(), metadata=pod.metadata
                )
                async for batch in call:
                    for event in batch.events:
                        _apply_event(pod.blocks, event)
            except grpc.aio.AioRpcError:
                pass
            pod.blocks.clear()
            await asyncio.sleep(self.poll_seconds)


def _has_adapter(pod: Pod, lora: str | None, keys: Collection[str] | None) -> bool:
    """Whether `pod` serves the adapter `lora` (None: the base model, which
    every pod does) from files with one of the cache keys `keys` (None: any)."""
    if lora is None:
        return True
    adapter = pod.loras.get(lora)
    return adapter is not None and (keys is None or adapter.cache_key in keys)


def _apply_event(blocks: set[bytes], event: pb.KvEvent) -> None:
    kind = event.WhichOneof("event")
    if kind == "stored":
        blocks.update(event.stored.block_hashes)
    elif kind == "removed":
        blocks.difference_update(event.removed.block_hashes)
    elif kind == "cleared":
        blocks.clear()
