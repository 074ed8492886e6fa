"""Save and load throughput of the KV connectors' stores against raw limits.

For 1 to 1024 blocks of the default model's layout (30 layers x K/V x 16
tokens x 3 heads x 64 dims, float32: 720 KiB a block), in one process:

* shm: the connector's path (copy from the paged cache straight into pool
  slots, checksummed in the same pass, and sealed; and back: check, verify
  and copy into the cache) against a plain memcpy of the same bytes in the
  same cache state: out of a fixed buffer into the next rows of a ring as
  large as the pool (a save writes fresh slots: memory not in cache), and
  from those rows back into a fixed buffer (a load reads the slots just
  saved);
* Redis: the connector's path (as its transfer thread runs it: copy out
  with checksums into reused frame buffers, seal, pipelined SET; MGET into
  reused frames, check, verify and copy into the cache) over a
  redis-server it starts on a free loopback port, against redis-py
  pipelined SET / MGET of the same frames. Both write new keys each time
  and every key is deleted after each repetition, outside the timings, so
  both find Redis in the same state;
* NIXL: READ throughput between two processes (a producer process holds
  the blocks, this one reads them as NixlConnector does: one READ naming
  every layer's K and V of the blocks) against a raw NIXL READ of the same
  number of bytes from one contiguous registered buffer, in the same run.

A last table compares the loads of the three connectors.

Rounds interleave the raw and the connector runs (A, B, A, B) and report
medians with min/max, since the machine is shared. Small block counts
repeat each run within a round (64 blocks' worth), so their medians are
not of a handful of 100-microsecond samples.

    .venv/bin/python benchmarks/kv_transfer_bench.py [--rounds 5] [--max-blocks 1024]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from connectors.block_codec import BlockCodec
from connectors.kv_blocks import FrameBuffers, KVBlockIO
from connectors.redis_connector import RedisBlockStore
from connectors.shm_connector import ShmBlockStore
from connectors.store import (
    RETAINED_FRAME_BYTES,
    BlockStore,
    LoadJob,
    direct_store,
    load_into_cache,
    save_blocks,
    stage_save,
)
from engine.kv_transfer.base import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# Each round repeats a run until it has moved this many blocks (at least once).
_BLOCKS_PER_ROUND = 64


def _reps(n: int) -> int:
    return max(1, _BLOCKS_PER_ROUND // n)


class Case:
    """One store, one block count: the connector path and its raw limit."""

    def __init__(self, store: BlockStore, codec: BlockCodec, io: KVBlockIO, n: int) -> None:
        self.store, self.codec, self.io = store, codec, io
        self.block_ids = list(range(1, n + 1))
        self.hashes: list[bytes] = []
        self.nbytes = n * codec.frame_bytes
        # As StoreConnector keeps one: frame arrays reused across batches.
        self.buffers = FrameBuffers(codec.frame_bytes, RETAINED_FRAME_BYTES)

    def new_keys(self) -> None:
        """Before each save (untimed): a store skips blocks it already holds."""
        self.hashes = [uuid.uuid4().bytes * 2 for _ in self.block_ids]

    def connector_save(self) -> None:
        """As the connector saves: straight into shared memory, or copy out
        with checksums, seal and store (what its transfer thread does)."""
        direct = direct_store(self.store, self.io)
        if direct is not None:
            direct.save_direct(self.io, self.hashes, self.block_ids)
            return
        job = stage_save(self.io, self.hashes, self.block_ids, self.buffers)
        if not save_blocks(self.store, self.codec, job, self.buffers):
            raise RuntimeError("save failed")

    def connector_load(self) -> None:
        job = LoadJob("bench", self.hashes, self.block_ids)
        result = load_into_cache(self.store, self.codec, self.io, job, self.buffers)
        if result.failed_block_ids:
            raise RuntimeError(f"{len(result.failed_block_ids)} blocks failed to load")


class MemcpyRing:
    """numpy memcpy of n frames in the cache state the pool's copies see:
    ``out`` from a fixed buffer (as a save reads the cache's blocks) into the
    next n rows of a ring as large as the pool (as a save writes fresh
    slots), ``back`` from those rows into a fixed buffer (as a load reads
    the slots just saved into the cache)."""

    def __init__(self, n: int, frame_bytes: int, ring_rows: int) -> None:
        self.n = n
        rng = np.random.default_rng(0)
        self.src = rng.integers(0, 255, (n, frame_bytes), dtype=np.uint8)
        self.dst = np.ones_like(self.src)  # written: its pages are mapped
        self.ring = np.ones((ring_rows, frame_bytes), np.uint8)
        self.at = 0

    def out(self) -> None:
        if self.at + self.n > len(self.ring):
            self.at = 0
        np.copyto(self.ring[self.at : self.at + self.n], self.src)

    def back(self) -> None:
        np.copyto(self.dst, self.ring[self.at : self.at + self.n])
        self.at += self.n


def _median_text(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def _ratio(raw: list[float], conn: list[float]) -> float:
    return statistics.median(raw) / statistics.median(conn)


def bench_shm(io: KVBlockIO, codec: BlockCodec, counts: list[int], rounds: int) -> dict[int, float]:
    print(
        "\nshm (GB/s, median (min-max)): memcpy out | connector save | memcpy back | "
        "connector load | ratios"
    )
    slots = max(counts) + 1
    store = ShmBlockStore(codec, f"bench-{uuid.uuid4().hex[:8]}", slots * codec.frame_bytes)
    results: dict[int, float] = {}
    try:
        for n in counts:
            case = Case(store, codec, io, n)
            ring = MemcpyRing(n, codec.frame_bytes, slots)
            raw_out, save, raw_back, load = [], [], [], []
            for _ in range(rounds * _reps(n)):
                case.new_keys()
                raw_out.append(case.nbytes / _timed(ring.out) / 1e9)
                save.append(case.nbytes / _timed(case.connector_save) / 1e9)
                raw_back.append(case.nbytes / _timed(ring.back) / 1e9)
                load.append(case.nbytes / _timed(case.connector_load) / 1e9)
            del ring
            results[n] = statistics.median(load)
            print(
                f"  {n:5d} blocks: {_median_text(raw_out)} | {_median_text(save)} | "
                f"{_median_text(raw_back)} | {_median_text(load)} | "
                f"memcpy/save {_ratio(raw_out, save):.2f}x, "
                f"memcpy/load {_ratio(raw_back, load):.2f}x"
            )
    finally:
        store.close()
    return results


def _start_redis(server: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return proc, url


def bench_redis(
    io: KVBlockIO, codec: BlockCodec, counts: list[int], rounds: int
) -> dict[int, float]:
    results: dict[int, float] = {}
    server = shutil.which("redis-server")
    if server is None:
        print("\nredis: redis-server not found (make redis installs it); skipped")
        return results
    proc, url = _start_redis(server)
    try:
        client = redis.Redis.from_url(url, socket_timeout=30.0)
        store = RedisBlockStore(codec, url, key_prefix="bench:", socket_timeout=30.0)
        print(
            "\nredis (GB/s, median (min-max)): raw SET | connector save | raw MGET | "
            "connector load | ratios"
        )
        for n in counts:
            case = Case(store, codec, io, n)
            # Only timed as raw SETs: any key binding will do.
            frames = [codec.encode(p, bytes(32)) for p in io.gather(case.block_ids)]
            keys: list[str] = []

            def raw_set(keys: list[str] = keys, frames: list[bytes] = frames) -> None:
                pipe = client.pipeline(transaction=False)
                for key, frame in zip(keys, frames, strict=True):
                    pipe.set(key, frame)
                pipe.execute()

            raw_s, save, raw_g, load = [], [], [], []
            for _ in range(rounds * _reps(n)):
                case.new_keys()
                keys[:] = [f"raw:{uuid.uuid4().hex}" for _ in range(n)]
                raw_s.append(case.nbytes / _timed(raw_set) / 1e9)
                save.append(case.nbytes / _timed(case.connector_save) / 1e9)
                raw_g.append(case.nbytes / _timed(partial(client.mget, keys)) / 1e9)
                load.append(case.nbytes / _timed(case.connector_load) / 1e9)
                client.flushdb()
            results[n] = statistics.median(load)
            print(
                f"  {n:5d} blocks: {_median_text(raw_s)} | {_median_text(save)} | "
                f"{_median_text(raw_g)} | {_median_text(load)} | "
                f"raw/save {_ratio(raw_s, save):.2f}x, raw/load {_ratio(raw_g, load):.2f}x"
            )
        store.close()
        client.close()
    finally:
        proc.terminate()
        proc.wait()
    return results


def _nixl_producer(conn: Any, num_blocks: int) -> None:
    """The other process: registers a paged cache and a flat buffer of the
    same size, publishes both, and polls (as an engine does each step)."""
    from connectors.nixl_endpoint import NixlEndpoint
    from connectors.nixl_handshake import PeerInfo

    caches = [
        torch.randn(2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        for _ in range(LAYOUT.num_layers)
    ]
    endpoint = NixlEndpoint("bench-producer", caches)
    # Written, like the caches: untouched pages would all read one zero page.
    flat = torch.randint(
        0, 255, (sum(c.numel() * c.element_size() for c in caches),), dtype=torch.uint8
    )
    endpoint.agent.register_memory([flat])
    info = PeerInfo(
        endpoint.name,
        endpoint.metadata(),
        num_blocks,
        endpoint.half_bytes,
        endpoint.layer_addrs,
        {},
    )
    conn.send((info.to_bytes(), flat.data_ptr()))
    while not conn.poll(0.001):
        endpoint.take_notifs()
    endpoint.close()


def _nixl_wait(endpoint: Any, handle: Any) -> None:
    state = endpoint.state(handle)
    while state == "PROC":
        state = endpoint.state(handle)
    endpoint.release(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL READ ended {state}")


def bench_nixl(io: KVBlockIO, counts: list[int], rounds: int) -> dict[int, float]:
    """NIXL READ GB/s per block count (connector path), printed with the raw READ."""
    try:
        from connectors.nixl_endpoint import NixlEndpoint
        from connectors.nixl_handshake import PeerInfo
    except ImportError:
        print("\nnixl: not installed (pip install nixl-cu12); skipped")
        return {}
    num_blocks = io.num_blocks
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_nixl_producer, args=(child, num_blocks))
    proc.start()
    payload, remote_flat = parent.recv()
    endpoint = NixlEndpoint(
        "bench-consumer", [layer.view(2, num_blocks, -1) for layer in io.layers]
    )
    peer = endpoint.add_peer(PeerInfo.from_bytes(payload))
    local_flat = torch.ones(num_blocks * io.payload_bytes, dtype=torch.uint8)
    endpoint.agent.register_memory([local_flat])
    results: dict[int, float] = {}
    print("\nnixl, two processes (GB/s, median (min-max)): raw READ | connector READ | ratio")
    try:
        for n in counts:
            nbytes = n * io.payload_bytes
            ids = list(range(1, n + 1))
            local = endpoint.agent.get_xfer_descs([(local_flat.data_ptr(), nbytes, 0)], "DRAM")
            remote = endpoint.agent.get_xfer_descs([(remote_flat, nbytes, 0)], "DRAM")

            def raw(local: Any = local, remote: Any = remote) -> None:
                handle = endpoint.agent.initialize_xfer("READ", local, remote, peer.info.agent_name)
                endpoint.agent.transfer(handle)
                _nixl_wait(endpoint, handle)

            def connector(ids: list[int] = ids) -> None:
                _nixl_wait(endpoint, endpoint.read(peer, ids, ids, b"bench"))

            connector()  # connects UCX endpoints outside the timings
            raw_r, conn_r = [], []
            for _ in range(rounds):
                raw_r.append(nbytes / _timed(raw) / 1e9)
                conn_r.append(nbytes / _timed(connector) / 1e9)
            results[n] = statistics.median(conn_r)
            print(
                f"  {n:5d} blocks: {_median_text(raw_r)} | {_median_text(conn_r)} | "
                f"raw/connector {statistics.median(raw_r) / results[n]:.2f}x"
            )
    finally:
        parent.send("stop")
        proc.join(30)
        endpoint.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-blocks", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--connectors", default="shm,redis,nixl", help="which to measure (default: all three)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = [n for n in (1, 4, 16, 64, 256, 1024) if n <= args.max_blocks]
    num_blocks = max(counts) + 1
    caches = [
        torch.randn(2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        for _ in range(LAYOUT.num_layers)
    ]
    io = KVBlockIO(caches)
    codec = BlockCodec("SmolLM2-135M-Instruct", LAYOUT)
    print(
        f"block: {codec.frame_bytes / 1024:.0f} KiB framed; blocks {counts}; "
        f"{args.rounds} interleaved rounds; torch threads {args.threads}"
    )
    benches: dict[str, Callable[[], dict[int, float]]] = {
        "shm": partial(bench_shm, io, codec, counts, args.rounds),
        "redis": partial(bench_redis, io, codec, counts, args.rounds),
        "nixl": partial(bench_nixl, io, counts, args.rounds),
    }
    loads = {name: benches[name]() for name in args.connectors.split(",")}
    print("\nloads side by side (GB/s, medians): " + " | ".join(loads))
    for n in counts:
        row = " | ".join(f"{loads[k][n]:6.2f}" if n in loads[k] else "     -" for k in loads)
        print(f"  {n:5d} blocks: {row}")


if __name__ == "__main__":
    main()
