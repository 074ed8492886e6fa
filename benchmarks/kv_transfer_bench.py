"""Save and load throughput of the KV connectors' stores against raw limits.

For 1 to 1024 blocks of the default model's layout (30 layers x K/V x 16
tokens x 3 heads x 64 dims, float32: 720 KiB a block), in one process:

* shm: the connector's path (gather from the paged cache, frame with a
  checksum, copy into the shared-memory pool; and back: copy out, verify,
  scatter into the cache) against a plain memcpy of the same bytes;
* Redis: the same path over a redis-server it starts on a free loopback
  port, against redis-py pipelined SET / MGET of the same frames;
* NIXL: READ throughput between two processes (a producer process holds
  the blocks, this one reads them as NixlConnector does: one READ naming
  every layer's K and V of the blocks) against a raw NIXL READ of the same
  number of bytes from one contiguous registered buffer, in the same run.

A last table compares the loads of the three connectors.

Rounds interleave the raw and the connector runs (A, B, A, B) and report
medians with min/max, since the machine is shared.

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

from connectors.base import KVLayout
from connectors.block_codec import HEADER_BYTES, BlockCodec
from connectors.kv_blocks import KVBlockIO
from connectors.redis_connector import RedisBlockStore
from connectors.shm_connector import ShmBlockStore
from connectors.store import (
    BlockStore,
    LoadJob,
    SaveJob,
    direct_store,
    load_into_cache,
    save_blocks,
)

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Case:
    """One store, one block count: the connector path and its raw limit."""

    def __init__(self, store: BlockStore, codec: BlockCodec, io: KVBlockIO, n: int) -> None:
        self.store, self.codec, self.io = store, codec, io
        self.block_ids = list(range(1, n + 1))
        self.hashes = [uuid.uuid4().bytes * 2 for _ in range(n)]
        self.nbytes = n * codec.frame_bytes

    def connector_save(self) -> None:
        """As the connector saves: straight into shared memory, or gather,
        seal and store (what its transfer thread does for Redis). New keys
        each time: a store skips blocks it already holds."""
        self.hashes = [uuid.uuid4().bytes * 2 for _ in self.block_ids]
        direct = direct_store(self.store, self.io)
        if direct is not None:
            direct.save_direct(self.io, self.hashes, self.block_ids)
            return
        frames = self.io.gather_frames(self.block_ids, HEADER_BYTES)
        if not save_blocks(self.store, self.codec, SaveJob(self.hashes, frames)):
            raise RuntimeError("save failed")

    def connector_load(self) -> None:
        job = LoadJob("bench", self.hashes, self.block_ids)
        result = load_into_cache(self.store, self.codec, self.io, job)
        if result.failed_block_ids:
            raise RuntimeError(f"{len(result.failed_block_ids)} blocks failed to load")


def _median_text(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def bench_shm(io: KVBlockIO, codec: BlockCodec, counts: list[int], rounds: int) -> dict[int, float]:
    print("\nshm (GB/s, median (min-max)): memcpy | connector save | connector load | ratios")
    store = ShmBlockStore(
        codec, f"bench-{uuid.uuid4().hex[:8]}", (max(counts) + 1) * codec.frame_bytes
    )
    results: dict[int, float] = {}
    try:
        for n in counts:
            case = Case(store, codec, io, n)
            src = np.random.default_rng(0).integers(0, 255, case.nbytes, dtype=np.uint8)
            dst = np.empty_like(src)
            raw, save, load = [], [], []
            for _ in range(rounds):
                raw.append(case.nbytes / _timed(partial(np.copyto, dst, src)) / 1e9)
                save.append(case.nbytes / _timed(case.connector_save) / 1e9)
                load.append(case.nbytes / _timed(case.connector_load) / 1e9)
            m_raw = statistics.median(raw)
            results[n] = statistics.median(load)
            print(
                f"  {n:5d} blocks: {_median_text(raw)} | {_median_text(save)} | "
                f"{_median_text(load)} | memcpy/save {m_raw / statistics.median(save):.2f}x, "
                f"memcpy/load {m_raw / statistics.median(load):.2f}x"
            )
    finally:
        store.close()
    return results


def bench_redis(
    io: KVBlockIO, codec: BlockCodec, counts: list[int], rounds: int
) -> dict[int, float]:
    results: dict[int, float] = {}
    server = shutil.which("redis-server")
    if server is None:
        print("\nredis: redis-server not found (make redis installs it); skipped")
        return results
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        store = RedisBlockStore(codec, url, key_prefix="bench:", socket_timeout=30.0)
        print(
            "\nredis (GB/s, median (min-max)): raw SET | connector save | raw MGET | "
            "connector load | ratios"
        )
        for n in counts:
            case = Case(store, codec, io, n)
            frames = [codec.encode(p) for p in io.gather(case.block_ids)]
            keys = [f"raw:{i}" for i in range(n)]

            def raw_set(keys: list[str] = keys, frames: list[bytes] = frames) -> None:
                pipe = client.pipeline(transaction=False)
                for key, frame in zip(keys, frames, strict=True):
                    pipe.set(key, frame)
                pipe.execute()

            raw_s, save, raw_g, load = [], [], [], []
            for _ in range(rounds):
                raw_s.append(case.nbytes / _timed(raw_set) / 1e9)
                save.append(case.nbytes / _timed(case.connector_save) / 1e9)
                raw_g.append(case.nbytes / _timed(partial(client.mget, keys)) / 1e9)
                load.append(case.nbytes / _timed(case.connector_load) / 1e9)
            client.flushdb()
            results[n] = statistics.median(load)
            print(
                f"  {n:5d} blocks: {_median_text(raw_s)} | {_median_text(save)} | "
                f"{_median_text(raw_g)} | {_median_text(load)} | "
                f"raw/save {statistics.median(raw_s) / statistics.median(save):.2f}x, "
                f"raw/load {statistics.median(raw_g) / statistics.median(load):.2f}x"
            )
        store.close()
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
