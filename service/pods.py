"""The router's view of its pods: load, health and which prefixes each holds.

Each pod is polled with GetServerStatus (load: running + waiting requests,
KV usage) and, for decode and colocated pods, followed through
SubscribeKvEvents: the set of block hashes it holds, as llm-d's and
Dynamo's routers keep it. `PodPool.pick` prefers the pod holding the
longest prefix of a prompt's block hashes, then the least loaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from engine.kv_cache.hashing import hash_block_tokens
from service.client import open_channel
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass
class Pod:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerationStub
    healthy: bool = False
    load: float = 0.0  # running + waiting, plus what this router sent since the last poll
    block_size: int = 0
    blocks: set[bytes] = field(default_factory=set)
    in_flight: int = 0

    def prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        for i, block_hash in enumerate(hashes):
            if block_hash not in self.blocks:
                return i
        return len(hashes)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of the prompt's full blocks, as every engine computes it."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class PodPool:
    """Pods of one kind (prefill, or decode/colocated). Start with `start()`,
    stop with `close()`."""

    def __init__(
        self, name: str, addresses: Sequence[str], *, follow_kv_events: bool, poll_seconds: float
    ) -> None:
        self.name = name
        self.pods = []
        for address in addresses:
            channel = open_channel(address)
            stub = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
            self.pods.append(Pod(address, channel, stub))
        self.follow_kv_events = follow_kv_events
        self.poll_seconds = poll_seconds
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for pod in self.pods:
            self._tasks.append(asyncio.create_task(self._poll(pod)))
            if self.follow_kv_events:
                self._tasks.append(asyncio.create_task(self._follow(pod)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pod in self.pods:
            await pod.channel.close()

    @property
    def any_healthy(self) -> bool:
        return any(p.healthy for p in self.pods)

    def pick(self, hashes: Sequence[bytes] = (), exclude: Sequence[Pod] = ()) -> Pod | None:
        """The pod holding the longest prefix of `hashes`, then the least
        loaded; None if no healthy pod is left."""
        candidates = [p for p in self.pods if p.healthy and p not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda p: (p.prefix_blocks(hashes), -(p.load + p.in_flight)))

    async def _poll(self, pod: Pod) -> None:
        while True:
            try:
                status = await pod.stub.GetServerStatus(
                    pb.GetServerStatusRequest(), timeout=max(1.0, 2 * self.poll_seconds)
                )
                if not pod.block_size:
                    info = await pod.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5.0)
                    pod.block_size = info.block_size
                if not pod.healthy:
                    logger.info("%s pod %s is up", self.name, pod.address)
                pod.healthy = not status.draining
                pod.load = status.num_running + status.num_waiting
            except grpc.aio.AioRpcError as e:
                if pod.healthy:
                    logger.warning("%s pod %s is down: %s", self.name, pod.address, e.code())
                pod.healthy = False
                pod.blocks.clear()
            await asyncio.sleep(self.poll_seconds)

    async def _follow(self, pod: Pod) -> None:
        """Mirror the pod's cached block hashes; resubscribe after a break
        (starting from empty: AllBlocksCleared semantics)."""
        while True:
            try:
                call = pod.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
                async for batch in call:
                    for event in batch.events:
                        _apply_event(pod.blocks, event)
            except grpc.aio.AioRpcError:
                pass
            pod.blocks.clear()
            await asyncio.sleep(self.poll_seconds)


def _apply_event(blocks: set[bytes], event: pb.KvEvent) -> None:
    kind = event.WhichOneof("event")
    if kind == "stored":
        blocks.update(event.stored.block_hashes)
    elif kind == "removed":
        blocks.difference_update(event.removed.block_hashes)
    elif kind == "cleared":
        blocks.clear()
