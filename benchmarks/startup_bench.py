"""Start-up of `tandem router` and `tandem serve`: seconds until a process
listens (router) or serves (pod), and its resident memory then.

    python benchmarks/startup_bench.py --rounds 5
    python benchmarks/startup_bench.py --trees /path/to/before,. --rounds 5

Each round starts one router, then one pod, then two pods at once, from
each tree in turn (A, B, A, B, ...: ``--trees`` names checkouts with their
own ``.venv``, the first the baseline); medians with min/max, and the ratio
of each tree's medians to the first tree's. The router is pointed at a pod
address nobody listens on: it only has to start.

    python benchmarks/startup_bench.py --forked --rounds 3

adds pods forked from a process that imported the server already, as the
integration tests start theirs (tests/integration/pod_forks.py), beside the
same pods started as `python -m service.cli serve` (this tree only).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.pod_forks import ForkedPod

POD_ARGS = ["--kv-cache-memory", "256M", "--max-model-len", "2048"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def _rss_mb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


Process = subprocess.Popen[bytes] | ForkedPod


def _launch(tree: Path, args: list[str], forked: bool = False) -> tuple[Process, Path, int]:
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="startup-bench-", suffix=".log")[1])
    argv = [*args, "--port", str(port)]
    proc: Process
    if forked:
        proc = ForkedPod(argv, env=dict(os.environ), cwd=tree, log_path=log)
    else:
        with log.open("wb") as out:
            cmd = [str(tree / ".venv/bin/python"), "-m", "service.cli", *argv]
            proc = subprocess.Popen(cmd, cwd=tree, stdout=out, stderr=out)
    return proc, log, port


def _stop(proc: Process, log: Path) -> None:
    proc.kill()
    proc.wait()
    log.unlink(missing_ok=True)


def router_start(tree: Path) -> tuple[float, int]:
    """Seconds until the router logs that it listens; its RSS (MB)."""
    start = time.monotonic()
    proc, log, _ = _launch(tree, ["router", "--decode", f"127.0.0.1:{_free_port()}"])
    try:
        while "router on " not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() - start > 120:
                raise RuntimeError(f"router did not start:\n{log.read_text()}")
            time.sleep(0.02)
        return time.monotonic() - start, _rss_mb(proc.pid)
    finally:
        _stop(proc, log)


def pods_start(tree: Path, count: int, forked: bool = False) -> tuple[float, int]:
    """Seconds until `count` pods started together all serve; the first's RSS."""
    start = time.monotonic()
    launched = [_launch(tree, ["serve", *POD_ARGS], forked) for _ in range(count)]
    try:
        for proc, log, port in launched:
            while not _serving(port):
                if proc.poll() is not None or time.monotonic() - start > 300:
                    raise RuntimeError(f"pod did not start:\n{log.read_text()}")
                time.sleep(0.05)
        return time.monotonic() - start, _rss_mb(launched[0][0].pid)
    finally:
        for proc, log, _ in launched:
            _stop(proc, log)


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=".", help="comma-separated checkouts; first = baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forked", action="store_true", help="also pods forked warm (one tree)")
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    cases: dict[str, Callable[[Path], tuple[float, int]]] = {
        "router listens (s)": router_start,
        "1 pod serves (s)": lambda t: pods_start(t, 1),
        "2 pods serve (s)": lambda t: pods_start(t, 2),
    }
    if args.forked:
        if len(trees) != 1:
            parser.error("--forked times this tree's pods: give no --trees")
        cases["1 pod serves, forked (s)"] = lambda t: pods_start(t, 1, forked=True)
        cases["2 pods serve, forked (s)"] = lambda t: pods_start(t, 2, forked=True)
    seconds: dict[tuple[str, Path], list[float]] = defaultdict(list)
    rss: dict[tuple[str, Path], list[float]] = defaultdict(list)
    print(f"load average at start: {os.getloadavg()}")
    for r in range(args.rounds):
        for name, case in cases.items():
            for tree in trees:
                took, mb = case(tree)
                seconds[name, tree].append(took)
                rss[name, tree].append(mb)
                print(f"  round {r + 1}: {tree.name or tree}: {name} {took:.2f}, RSS {mb} MB")
    print(f"load average at end: {os.getloadavg()}")
    for name in cases:
        base = statistics.median(seconds[name, trees[0]])
        for tree in trees:
            s = seconds[name, tree]
            median_mb = statistics.median(rss[name, tree])
            ratio = statistics.median(s) / base
            print(f"{name:20s} {tree!s:24s} {_summary(s)} RSS {median_mb:.0f} MB ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
