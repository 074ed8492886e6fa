"""Real `tandem serve` processes on loopback ports, for integration tests.

    with ServerProcess(["--max-num-seqs", "4"]) as server:
        ... grpc.aio.insecure_channel(server.target) ...

Each server is its own process running the default model; it is SIGTERMed
(a drain) on exit and must exit with code 0. A `serve` runs the exact path
(`--exact`) unless built with `exact=False`: the tests compare answers
across servers, P/D legs, preemption and the offline engine, and only the
exact path gives the same tokens however requests are chunked, batched or
handed over (the default model's fast default, int8 activations and a
bfloat16 KV cache, may part at a near tie: engine/numerics.py). A stack of pods (prefill,
decode, router) starts at once with `serving(prefill, decode, router)`; a
module's single-purpose servers start together with `launched(...)`.
Each is forked from a process that has imported the server already
(pod_forks.py: a start in a third of the time), or with TANDEM_TEST_PODS=exec
is a fresh `python -m service.cli` as a user starts it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.pod_forks import ForkedPod, forks_enabled

ROOT = Path(__file__).resolve().parents[2]


_HANDED_OUT: set[int] = set()

# A serve pod's KV cache unless its test sizes it: ~11k float32 tokens of the
# default model, more than any test here holds at once.
DEFAULT_KV_CACHE = "512M"


def log_dir() -> Path:
    """This test process's directory for its servers' logs, removed when
    it exits (a failing test shows the log's tail in its message)."""
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = Path(tempfile.mkdtemp(prefix="tandem-test-logs-"))
        atexit.register(shutil.rmtree, _LOG_DIR, ignore_errors=True)
    return _LOG_DIR


_LOG_DIR: Path | None = None


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral
    range: a port the kernel hands out (bind to 0) can be taken by some
    process's outgoing connection before the server binds it (a fresh clone
    saw "Address already in use"), while ports below the range are only
    ever taken on purpose."""
    low, high = _worker_range(10_000, _ephemeral_low())
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:  # chosen for a server that has not bound it yet
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # a crowded range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_range(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [low, high): workers are separate
    processes, each with its own _HANDED_OUT, so two of them must never pick
    from the same ports."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw")) if worker.startswith("gw") else 0
    share = (high - low) // max(count, 1)
    return low + index * share, low + (index + 1) * share


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, 10_001)


class ServerProcess:
    def __init__(
        self,
        args: list[str] | None = None,
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 300.0,
        check_health: bool = True,
        metrics: bool = False,
        command: str = "serve",
        exact: bool = True,
    ) -> None:
        """`command`: the tandem subcommand ("serve", or "router");
        `exact`: a `serve` gets --exact (see above)."""
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.args = (["--exact"] if exact and command == "serve" else []) + list(args or [])
        if command == "serve" and "--kv-cache-memory" not in self.args:
            # Not the 2 GiB default: two test workers run pods side by side
            # in 24 GiB, and zeroing 2 GiB costs each start half a second.
            self.args += ["--kv-cache-memory", DEFAULT_KV_CACHE]
        self.metrics_port: int | None = None
        if metrics:
            self.metrics_port = free_port()
            self.args += ["--metrics-port", str(self.metrics_port)]
        self.env = {**os.environ, **(env or {})}
        # An environment of its own may change how an interpreter starts
        # (PYTHONPATH): such a pod is not forked (pod_forks.py).
        self.own_env = env is not None
        self.ready_timeout = ready_timeout
        self.check_health = check_health
        self.command = command
        self.log_path: Path | None = None
        self.proc: subprocess.Popen[bytes] | ForkedPod | None = None
        self.killed = False  # by kill(): no drain, so no exit code to check

    def __enter__(self) -> ServerProcess:
        if self.proc is None:  # else start() ran already: only wait
            self.start()
        if self.check_health:
            self.wait_started()
        return self

    def start(self) -> None:
        """Launches the process without waiting for it (see `serving`)."""
        argv = [self.command, "--port", str(self.port), *self.args]
        with tempfile.NamedTemporaryFile(
            prefix="tandem-serve-", suffix=".log", dir=log_dir(), delete=False
        ) as log:
            self.log_path = Path(log.name)  # the child writes it; we only read
            if self.own_env or not forks_enabled():
                cmd = [sys.executable, "-m", "service.cli", *argv]
                self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=log)
            else:
                self.proc = ForkedPod(argv, env=self.env, cwd=ROOT, log_path=self.log_path)

    def wait_started(self) -> None:
        """wait_serving, killing the process if it never serves: __exit__
        will not run, and a server left starting would outlive the test run
        (a pytest timeout lands here on a busy machine)."""
        try:
            self.wait_serving()
        except BaseException:
            self.kill()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        code = self.terminate()
        if exc_type is None and code != 0 and not self.killed:
            raise AssertionError(f"server exited with {code}; log:\n{self.log()}")

    def wait_serving(self, channel_credentials: grpc.ChannelCredentials | None = None) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server died at start-up; log:\n{self.log()}")
            if self.health(channel_credentials) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.25)
        raise TimeoutError(f"server not SERVING after {self.ready_timeout} s; log:\n{self.log()}")

    def health(self, channel_credentials: grpc.ChannelCredentials | None = None) -> int | None:
        if channel_credentials is None:
            channel = grpc.insecure_channel(self.target)
        else:
            channel = grpc.secure_channel(self.target, channel_credentials)
        with channel:
            try:
                resp = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.RpcError:
                return None
            return int(resp.status)

    def signal_drain(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM (drain) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL (no drain) if it still runs, and reap it. A test may kill
        a server it entered with `with` (or `serving`): leaving it then
        checks no exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.killed = True

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:] if self.log_path else ""


@contextlib.contextmanager
def serving(*servers: ServerProcess) -> Iterator[None]:
    """Like nested `with` statements over `servers`, but their start-ups
    overlap: each is mostly one core's imports and model loading, so on 2
    cores two pods serve in 8-13 s against 6-8.6 s for one
    (benchmarks/startup_bench.py). Drained in reverse order on leaving, each
    exit code checked."""
    with contextlib.ExitStack() as stack:
        for server in servers:
            server.start()
            stack.push(server)  # its __exit__ drains it and checks the code
        for server in servers:
            if server.check_health:
                server.wait_started()
        yield


@contextlib.contextmanager
def launched(*servers: ServerProcess) -> Iterator[None]:
    """Launches `servers` now for tests that each enter one later (`with
    server:` then only waits for it), so their start-ups overlap with each
    other and with the tests before. Any still running on leaving (its test
    deselected or failed early) is killed."""
    for server in servers:
        server.start()
    try:
        yield
    finally:
        for server in servers:
            server.kill()
