"""Disaggregated against colocated serving, and a warm Redis prefix against cold.

Part 1, inter-token latency under long prefills: a few streams decode
steadily while long prompts arrive. Colocated, each long prefill shares the
engine's steps with the streams; disaggregated (router + prefill pod + decode
pod over Redis), the decode pod only loads the prompts' KV. Reports p50/p99
of the streams' inter-token gaps and the long prompts' time to first token,
the two set-ups run one after the other (A, B, A, B).

Part 2, time to first token of a long prompt whose prefix another pod
already saved to Redis (warm) against a fresh prefix of the same length
(cold), on a pod with `--kv-offload redis`, interleaved.

Every process runs on this machine: on a 2-core host the pods share the
cores, so part 1 shows what disaggregation removes from the decode steps
(prefill work) minus what the shared CPU adds back.

    .venv/bin/python benchmarks/pd_bench.py [--rounds 2] [--streams 4] [--long 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.bench import free_port  # noqa: E402
from service.client import TandemClient, make_request, wait_serving  # noqa: E402

SMALL = ["--kv-cache-memory", "512M", "--max-model-len", "4096"]


@contextmanager
def _process(*args: str, threads: int | None = None) -> Iterator[str]:
    """A `tandem` subcommand on a free port; yields its address once SERVING.
    `threads` caps its torch/OpenMP threads (pods sharing a small host)."""
    port = str(free_port())
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = tempfile.NamedTemporaryFile(prefix="pd-bench-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "service.cli", "--log-level", "warning", args[0], "--port", port]
    proc = subprocess.Popen([*cmd, *args[1:]], cwd=ROOT, stdout=log, stderr=log, env=env)
    target = f"127.0.0.1:{port}"
    try:
        asyncio.run(wait_serving(target, alive=lambda: proc.poll() is None))
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def _redis() -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server not found (make redis installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


def _kv(connector: str, role: str, url: str) -> list[str]:
    config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": {"url": url}}
    return ["--kv-transfer-config", json.dumps(config)]


def _long_prompt(tag: str, words: int) -> str:
    return f"Document {tag}. " + " ".join(f"item{i % 97}-{tag}" for i in range(words))


async def _stream(target: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(time to first token, inter-token gaps) of one greedy stream, in seconds."""
    async with TandemClient(target) as client:
        start = time.perf_counter()
        arrivals: list[float] = []
        request = make_request(text=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for chunk in client.stub.Generate(request, timeout=600):
            now = time.perf_counter()
            arrivals.extend([now] * len(chunk.token_ids))
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return arrivals[0] - start, gaps


async def _mixed_load(target: str, streams: int, long_prompts: int, words: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:6]
    steady = [
        asyncio.create_task(_stream(target, f"Story {tag}-{i}: once upon a time", 160))
        for i in range(streams)
    ]
    await asyncio.sleep(2.0)  # the streams are decoding
    longs = []
    for i in range(long_prompts):
        longs.append(asyncio.create_task(_stream(target, _long_prompt(f"{tag}{i}", words), 4)))
        await asyncio.sleep(1.5)
    steady_results = await asyncio.gather(*steady)
    long_results = await asyncio.gather(*longs)
    gaps = sorted(g for _, gs in steady_results for g in gs)
    ttfts = sorted(t for t, _ in long_results)
    return {
        "itl_p50_ms": 1e3 * gaps[len(gaps) // 2],
        "itl_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "long_ttft_p50_ms": 1e3 * statistics.median(ttfts),
    }


def part1(args: argparse.Namespace, url: str) -> None:
    print(
        f"\npart 1: {args.streams} streams decoding 160 tokens while {args.long} prompts of "
        f"~{args.words} words arrive (1.5 s apart)"
    )
    results: dict[str, list[dict[str, float]]] = {"colocated": [], "disaggregated": []}
    with (
        _process("serve", *SMALL) as colocated,
        _process(
            "serve",
            "--role",
            "prefill",
            *SMALL,
            *_kv("redis", "kv_producer", url),
            threads=args.pod_threads,
        ) as pre,
        _process(
            "serve",
            "--role",
            "decode",
            *SMALL,
            *_kv("redis", "kv_consumer", url),
            threads=args.pod_threads,
        ) as dec,
        _process("router", "--prefill", pre, "--decode", dec) as router,
    ):
        for r in range(args.rounds):
            for name, target in (("colocated", colocated), ("disaggregated", router)):
                res = asyncio.run(_mixed_load(target, args.streams, args.long, args.words))
                results[name].append(res)
                print(
                    f"  round {r + 1} {name:<14} ITL p50 {res['itl_p50_ms']:6.1f} ms  "
                    f"p99 {res['itl_p99_ms']:7.1f} ms  long-prompt TTFT p50 "
                    f"{res['long_ttft_p50_ms']:7.0f} ms",
                    flush=True,
                )
    for name, rows in results.items():
        p99 = [row["itl_p99_ms"] for row in rows]
        print(
            f"  {name:<14} ITL p99 median {statistics.median(p99):7.1f} ms "
            f"(min {min(p99):.1f}, max {max(p99):.1f})"
        )


def part2(args: argparse.Namespace, url: str) -> None:
    print(f"\npart 2: time to first token, ~{args.words}-word prompt, warm Redis prefix vs cold")
    warm: list[float] = []
    cold: list[float] = []
    offload = ["--kv-offload", "redis", "--kv-offload-redis-url", url]
    with _process("serve", *SMALL, *offload) as a, _process("serve", *SMALL, *offload) as b:
        for r in range(args.rounds + 1):
            shared = _long_prompt(f"w{uuid.uuid4().hex[:6]}", args.words)
            asyncio.run(_stream(a, shared + " Question one?", 1))  # A saves the prefix
            time.sleep(0.5)  # A's transfer thread finishes the saves
            fresh = _long_prompt(f"c{uuid.uuid4().hex[:6]}", args.words)
            t_cold, _ = asyncio.run(_stream(b, fresh + " Question two?", 1))
            t_warm, _ = asyncio.run(_stream(b, shared + " Question two?", 1))
            if r == 0:
                continue  # the first round warms up the pods
            cold.append(t_cold)
            warm.append(t_warm)
            print(
                f"  round {r}: cold {1e3 * t_cold:7.0f} ms   warm {1e3 * t_warm:7.0f} ms",
                flush=True,
            )
    ratio = statistics.median(warm) / statistics.median(cold)
    print(
        f"  cold median {1e3 * statistics.median(cold):.0f} ms, warm median "
        f"{1e3 * statistics.median(warm):.0f} ms: warm/cold {ratio:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument(
        "--pod-threads",
        type=int,
        default=1,
        help="torch threads of each P/D pod (default 1: the two pods split 2 cores; "
        "the colocated server keeps all)",
    )
    parser.add_argument("--skip-part2", action="store_true")
    args = parser.parse_args()
    with _redis() as url:
        part1(args, url)
        if not args.skip_part2:
            part2(args, url)


if __name__ == "__main__":
    with suppress(KeyboardInterrupt):
        main()
