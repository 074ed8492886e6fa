"""Asynchronous scheduling against the synchronous engine (issue 23).

The offline workload of ``offline_throughput.py`` (prompts of 32-512 random
tokens, 128 output tokens, EOS ignored, greedy) at concurrency 1, 16 and 64
(the first 1, 16 or 64 prompts at once). Each mode runs in its own process
(one engine per process: a second engine's OpenMP team beside the first
would disturb both), alternating sync, async, sync, async.

Per run it reports output tokens/s, the per-token latency (median time
between the ends of consecutive decode steps) and the gap between
consecutive forwards: the time the worker sits idle from the end of one
``execute_model`` to the start of the next (engine work outside the
forward that the pipeline does not hide), as a share of the step.

    .venv/bin/python benchmarks/async_scheduling_bench.py --rounds 2
    .venv/bin/python benchmarks/async_scheduling_bench.py --quick

``--serving`` runs the same comparison through the service instead: per
round and mode a ``tandem serve`` (with or without ``--async-scheduling``)
and ``tandem bench --server`` against it at rate inf with 1, 16 and 64
requests; it reports the service's output tokens/s, the ITL p50 and the
server's step p50.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


@dataclass
class RunResult:
    concurrency: int
    tokens_per_s: float
    itl_ms: float  # median time between the ends of consecutive steps
    step_ms: float  # median execute_model time
    gap_ms: float  # median idle time of the worker between steps


def _child(mode: str, concurrencies: list[int], max_tokens: int, threads: int) -> None:
    import torch
    from offline_throughput import make_prompts

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(max_model_len=1024, async_scheduling=mode == "async")
    worker = llm.core.worker
    spans: list[tuple[float, float]] = []
    execute = worker.execute_model

    def timed(so):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = execute(so)
        spans.append((start, time.perf_counter()))
        return out

    worker.execute_model = timed  # type: ignore[method-assign]
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    results = []
    for c in concurrencies:
        llm.core.scheduler.reset_prefix_cache()
        spans.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts[:c], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        # Steady decode: skip the prefill steps at the start.
        decode = spans[len(spans) // 4 :]
        ends = [e for _, e in decode]
        results.append(
            RunResult(
                concurrency=c,
                tokens_per_s=tokens / elapsed,
                itl_ms=1e3 * statistics.median(b - a for a, b in itertools.pairwise(ends)),
                step_ms=1e3 * statistics.median(e - s for s, e in decode),
                gap_ms=1e3
                * statistics.median(
                    max(0.0, s2 - e1) for (_, e1), (s2, _) in itertools.pairwise(decode)
                ),
            )
        )
    print("RESULT " + json.dumps([asdict(r) for r in results]), flush=True)
    llm.core.shutdown()


def _serve_and_bench(mode: str, args: argparse.Namespace) -> list[RunResult]:
    """One ``tandem serve`` for ``mode``; ``tandem bench`` against it per
    concurrency."""
    import socket
    import tempfile

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tandem = str(Path(sys.executable).parent / "tandem")
    flags = ["--async-scheduling"] if mode == "async" else []
    server = subprocess.Popen(
        [tandem, "serve", "--port", str(port), "--max-model-len", "1024", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with grpc.insecure_channel(target) as channel:
                try:
                    status = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=2
                    )
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the {mode} server did not start")
            time.sleep(0.5)
        results = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "bench.json"
                cmd = [tandem, "bench", "--server", target, "--rates", "inf", "--no-offline"]
                cmd += ["--num-requests", str(c), "--max-tokens", str(args.max_tokens)]
                subprocess.run([*cmd, "--out", str(out)], check=True, capture_output=True)
                rate = json.loads(out.read_text())["rates"][0]
            results.append(
                RunResult(
                    concurrency=c,
                    tokens_per_s=rate["throughput_tok_s"],
                    itl_ms=rate["itl_p50_ms"],
                    step_ms=rate["server_step_p50_ms"],
                    gap_ms=float("nan"),  # the service does not report it
                )
            )
        return results
    finally:
        server.terminate()
        server.wait(timeout=60)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f})"


def _run(mode: str, args: argparse.Namespace) -> list[RunResult]:
    cmd = [sys.executable, __file__, "--child", mode, "--concurrency", args.concurrency]
    cmd += ["--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return [RunResult(**r) for r in json.loads(line[len("RESULT ") :])]


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 round, concurrency 1,4, 16 tokens")
    parser.add_argument("--serving", action="store_true", help="through tandem serve/bench")
    parser.add_argument("--child", choices=["sync", "async"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.concurrency, args.max_tokens = 1, "1,4", 16
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.child:
        _child(args.child, concurrencies, args.max_tokens, args.threads)
        return
    runs: dict[str, list[list[RunResult]]] = {"sync": [], "async": []}
    for r in range(args.rounds):
        for mode in runs:
            before = _load()
            res = _serve_and_bench(mode, args) if args.serving else _run(mode, args)
            runs[mode].append(res)
            for x in res:
                print(
                    f"  round {r + 1} {mode:<5} c={x.concurrency:<3} {x.tokens_per_s:7.1f} tok/s  "
                    f"ITL {x.itl_ms:6.1f} ms  step {x.step_ms:6.1f} ms  gap {x.gap_ms:5.2f} ms  "
                    f"[{before} -> {_load()}]",
                    flush=True,
                )
    print("\nmedians (min-max) over rounds:")
    for i, c in enumerate(concurrencies):
        for mode in runs:
            rs = [run[i] for run in runs[mode]]
            gaps = [100 * x.gap_ms / x.step_ms for x in rs]
            print(
                f"c={c:<3} {mode:<5} tok/s {_summary([x.tokens_per_s for x in rs])}  "
                f"ITL ms {_summary([x.itl_ms for x in rs])}  gap/step % {_summary(gaps)}"
            )
        ratio = [
            a[i].tokens_per_s / s[i].tokens_per_s
            for s, a in zip(runs["sync"], runs["async"], strict=True)
        ]
        print(f"c={c:<3} async/sync throughput per round: {[f'{x:.3f}' for x in ratio]}")


if __name__ == "__main__":
    main()
