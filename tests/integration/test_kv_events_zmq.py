"""KV events over ZMQ in vLLM's format, from a real `tandem serve`.

The consumers here are written the way a consumer of vLLM's publisher is
(pyzmq + msgpack, nothing of Tandem's): a SUB socket for the live stream and
the replay ROUTER for what it missed. The pod's cache is small, so the
workload also evicts. What they rebuild must be exactly what the gRPC
SubscribeKvEvents stream of the same pod rebuilds, and what smg's protocol
stream (VllmEngine.SubscribeKvEvents, int64 hashes) rebuilds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import zmq
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.kv_cache.hashing import hash_chain
from service.client import TandemClient
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess, free_port

pytestmark = pytest.mark.timeout(300)

TOPIC = "kv@tandem-test@smollm2"
END = (-1).to_bytes(8, "big", signed=True)
BLOCK_SIZE = 16
# ~33 blocks of 16 tokens for SmolLM2-135M in float32: the workload below
# needs more than that over its life, so older blocks are evicted.
SMALL_CACHE = ["--kv-cache-memory", "24M", "--max-model-len", "256", "--max-num-seqs", "4"]

Event = list[Any]  # a decoded vLLM event: [tag, fields...]


def fold(block_hash: bytes) -> int:
    """vLLM's published value of a sha256 block hash (its default)."""
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


def decode(payload: bytes) -> list[Event]:
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
    return list(events)


class Watcher:
    """A live SUB consumer on its own thread: every batch by sequence."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.batches: dict[int, bytes] = {}
        self.bad_frames: list[list[bytes]] = []  # checked by the tests, not this thread
        self._sub = ctx.socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.subscribe(TOPIC.encode())
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(50):
                frames = self._sub.recv_multipart()
                with self._lock:
                    if len(frames) != 3 or frames[0] != TOPIC.encode() or len(frames[1]) != 8:
                        self.bad_frames.append(frames)
                    else:
                        self.batches[int.from_bytes(frames[1], "big")] = frames[2]

    def snapshot(self) -> dict[int, bytes]:
        with self._lock:
            assert not self.bad_frames, f"not [topic, 8-byte sequence, payload]: {self.bad_frames}"
            return dict(self.batches)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)


@dataclass
class Pod:
    server: ServerProcess
    ctx: zmq.Context[zmq.Socket[bytes]]
    pub: str
    replay: str
    watcher: Watcher
    next_prompt: int = field(default=0)

    def replay_from(self, start: int) -> dict[int, bytes]:
        """The replay protocol: [b"", start] in; [b"", seq, payload] per batch
        and [b"", -1, b""] at the end out."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: dict[int, bytes] = {}
        try:
            while True:
                assert dealer.poll(10_000), "no end-of-replay marker"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END:
                    assert payload == b""
                    return out
                out[int.from_bytes(seq, "big")] = payload
        finally:
            dealer.close(linger=0)

    def history(self, live: dict[int, bytes]) -> list[bytes]:
        """Every batch from sequence 0: live ones, the missed ones replayed.
        Replayed and live copies of one batch must be the same bytes."""
        replayed = self.replay_from(0)
        for seq in live.keys() & replayed.keys():
            assert live[seq] == replayed[seq], f"batch {seq}: replay differs from live"
        merged = {**replayed, **live}
        assert sorted(merged) == list(range(len(merged))), "a gap in the sequence numbers"
        return [merged[seq] for seq in range(len(merged))]

    def wait_quiet(self, quiet: float = 1.5) -> None:
        """Until no batch has arrived for `quiet` seconds."""
        seen, since = len(self.watcher.batches), time.monotonic()
        while time.monotonic() - since < quiet:
            time.sleep(0.1)
            if len(self.watcher.batches) != seen:
                seen, since = len(self.watcher.batches), time.monotonic()

    def prompts(self, n: int, length: int, prefix: list[int]) -> list[list[int]]:
        """`n` prompts starting with `prefix`, each with its own tail."""
        out = []
        for _ in range(n):
            base = 1000 + 97 * self.next_prompt
            self.next_prompt += 1
            out.append(prefix + [base + i for i in range(length - len(prefix))])
        return out


@pytest.fixture(scope="module")
def pod() -> Iterator[Pod]:
    pub_port, replay_port = free_port(), free_port()
    args = [
        *SMALL_CACHE,
        *("--kv-events-endpoint", f"tcp://*:{pub_port}"),
        *("--kv-events-replay-endpoint", f"tcp://*:{replay_port}"),
        *("--kv-events-topic", TOPIC),
    ]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with ServerProcess(args) as server:
        pub = f"tcp://127.0.0.1:{pub_port}"
        watcher = Watcher(ctx, pub)
        yield Pod(server, ctx, pub, f"tcp://127.0.0.1:{replay_port}", watcher)
        watcher.close()
    ctx.destroy(linger=0)


async def generate(client: TandemClient, prompt: list[int]) -> None:
    async for _ in client.generate(token_ids=prompt, max_tokens=8, temperature=0.0):
        pass


async def run_workload(client: TandemClient, pod: Pod) -> list[int]:
    """Three families of prompts sharing 48-token prefixes, four at a time,
    then the first family again (prefix hits); returns the last prompt."""
    families = [[2000 + 50 * f + i for i in range(48)] for f in range(3)]
    rounds = [pod.prompts(4, 90, prefix) for prefix in families]
    rounds.append(pod.prompts(4, 90, families[0]))
    for prompts in rounds:
        await asyncio.gather(*(generate(client, p) for p in prompts))
    return rounds[-1][-1]


def grpc_events(batch: pb.KvEventBatch) -> list[Event]:
    """A gRPC batch in the decoded vLLM form, hashes folded."""
    out: list[Event] = []
    for e in batch.events:
        if e.HasField("stored"):
            s = e.stored
            parent = fold(s.parent_block_hash) if s.parent_block_hash else None
            hashes = [fold(h) for h in s.block_hashes]
            out.append(
                ["BlockStored", hashes, parent, list(s.token_ids), s.block_size, None, "GPU"]
            )
        elif e.HasField("removed"):
            out.append(["BlockRemoved", [fold(h) for h in e.removed.block_hashes], "GPU"])
        else:
            out.append(["AllBlocksCleared"])
    return out


def vllm_engine_events(batch: common_pb2.KvEventBatch) -> list[Event]:
    """A VllmEngine (smg protocol) batch in the decoded vLLM form: its
    signed int64 hashes read back as the unsigned ints vLLM publishes."""
    out: list[Event] = []
    for e in batch.events:
        kind = e.WhichOneof("data")
        if kind == "stored":
            s = e.stored
            parent = s.parent_block_hash % (1 << 64) if s.HasField("parent_block_hash") else None
            hashes = [b.block_hash % (1 << 64) for b in s.blocks]
            tokens = [t for b in s.blocks for t in b.token_ids]
            size = s.blocks[0].block_size if s.blocks else BLOCK_SIZE
            out.append(["BlockStored", hashes, parent, tokens, size, None, s.medium])
        elif kind == "removed":
            hashes = [h % (1 << 64) for h in e.removed.block_hashes]
            out.append(["BlockRemoved", hashes, e.removed.medium])
        else:
            out.append(["AllBlocksCleared"])
    return out


def rebuild(batches: list[list[Event]]) -> Counter[int]:
    """The pod's cached blocks: hash -> how many blocks hold it (two requests
    computing one prefix at once each cache a copy)."""
    cached: Counter[int] = Counter()
    for events in batches:
        for event in events:
            if event[0] == "BlockStored":
                cached.update(event[1])
            elif event[0] == "BlockRemoved":
                cached.subtract(event[1])
            else:
                cached.clear()
    return +cached  # drops the hashes no block holds any more


async def subscribe_grpc(client: TandemClient, pod: Pod) -> tuple[list[pb.KvEventBatch], Any]:
    """The gRPC stream, reading into a list; returned once it is seen to
    deliver (a probe request's blocks arrived through it)."""
    call = client.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
    received: list[pb.KvEventBatch] = []

    async def read() -> None:
        async for batch in call:
            received.append(batch)

    task = asyncio.get_running_loop().create_task(read())
    await asyncio.sleep(0.5)
    while not received:
        [probe] = pod.prompts(1, 2 * BLOCK_SIZE, [])
        await generate(client, probe)
        await asyncio.sleep(0.5)
    return received, (call, task)


def test_zmq_rebuilds_exactly_the_cache_grpc_rebuilds(pod: Pod) -> None:
    async def go() -> tuple[list[pb.KvEventBatch], list[common_pb2.KvEventBatch], list[int], int]:
        async with TandemClient(pod.server.target) as client:
            num_blocks = (await client.model_info()).num_kv_blocks
            smg_call = vpb_grpc.VllmEngineStub(client.channel).SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest()
            )
            smg_batches: list[common_pb2.KvEventBatch] = []

            async def read_smg() -> None:
                async for batch in smg_call:
                    smg_batches.append(batch)

            smg_task = asyncio.get_running_loop().create_task(read_smg())
            received, (call, task) = await subscribe_grpc(client, pod)
            last_prompt = await run_workload(client, pod)
            await asyncio.to_thread(pod.wait_quiet)
            call.cancel()
            smg_call.cancel()
            await asyncio.gather(task, smg_task, return_exceptions=True)
            return received, smg_batches, last_prompt, num_blocks

    grpc_batches, smg_batches, last_prompt, num_blocks = asyncio.run(go())
    zmq_batches = [decode(p) for p in pod.history(pod.watcher.snapshot())]
    grpc_decoded = [grpc_events(b) for b in grpc_batches]
    # The gRPC stream starts where its subscription did: at the same batch
    # of the ZMQ stream, which from there on carries the same events.
    start = zmq_batches.index(grpc_decoded[0])
    assert zmq_batches[start:] == grpc_decoded
    zmq_cache = rebuild(zmq_batches[start:])
    assert zmq_cache == rebuild(grpc_decoded)
    assert set(zmq_cache) == set(rebuild(grpc_decoded))
    # smg's protocol stream, subscribed first, carries the same batches.
    smg_decoded = [vllm_engine_events(b) for b in smg_batches]
    smg_start = zmq_batches.index(smg_decoded[0])
    assert smg_start <= start and zmq_batches[smg_start:] == smg_decoded
    assert rebuild(smg_decoded[start - smg_start :]) == zmq_cache
    assert any(e[0] == "BlockRemoved" for events in zmq_batches for e in events)  # evictions
    # From sequence 0 every removal is of a block stored before: nothing missed.
    full: Counter[int] = Counter()
    for events in zmq_batches:
        for e in events:
            if e[0] == "BlockStored":
                assert len(e[3]) == len(e[1]) * BLOCK_SIZE and e[4] == BLOCK_SIZE
                assert e[2] is None or full[e[2]] > 0, "a parent that is not cached"
                full.update(e[1])
            elif e[0] == "BlockRemoved":
                full.subtract(e[1])
                assert all(full[h] >= 0 for h in e[1]), "a removal of a block never stored"
    # What is cached fits the pod (its null block aside), the last prompt's
    # blocks among it, under the hashes Tandem computes.
    assert 0 < sum((+full).values()) <= num_blocks - 1
    expected = {fold(h) for h in hash_chain(last_prompt, BLOCK_SIZE)}
    assert expected <= set(+full)


def test_a_late_subscriber_recovers_the_missed_batches_by_replay(pod: Pod) -> None:
    [missed_prompt] = pod.prompts(1, 3 * BLOCK_SIZE, [])

    async def go() -> dict[int, bytes]:
        async with TandemClient(pod.server.target) as client:
            await generate(client, missed_prompt)  # before the late subscriber exists
            late = Watcher(pod.ctx, pod.pub)
            while not late.snapshot():  # subscribed once a live batch arrives
                await generate(client, pod.prompts(1, 2 * BLOCK_SIZE, [])[0])
                await asyncio.sleep(0.3)
            await asyncio.to_thread(pod.wait_quiet)
            live = late.snapshot()
            late.close()
            return live

    live = asyncio.run(go())
    first_live = min(live)
    recovered = pod.history(live)  # replay fills 0 .. first_live - 1
    assert len(recovered) > first_live > 0
    # The replayed batches are the ones the pod published (the first
    # subscriber's copy), the missed prompt's blocks among them.
    assert recovered == pod.history(pod.watcher.snapshot())[: len(recovered)]
    missed = {fold(h) for h in hash_chain(missed_prompt, BLOCK_SIZE)}
    stored_before = {
        h for p in recovered[:first_live] for e in decode(p) if e[0] == "BlockStored" for h in e[1]
    }
    assert missed <= stored_before
    assert missed <= set(rebuild([decode(p) for p in recovered]))


def test_a_taken_kv_events_port_stops_serve_before_the_model_loads() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://*")
    server = ServerProcess(["--kv-events-endpoint", f"tcp://*:{port}"], check_health=False)
    server.start()
    try:
        assert server.proc is not None
        assert server.proc.wait(timeout=120) == 2
    finally:
        server.kill()
        ctx.destroy(linger=0)
    log = server.log()
    assert f"tandem serve: --kv-events-endpoint: cannot bind tcp://*:{port}" in log
    assert "loading the model" not in log
