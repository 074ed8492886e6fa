"""A real `redis-server` on a loopback port, for tests that need a store.

    with RedisServer() as server:
        ... KVTransferConfig("redis", "kv_both", {"url": server.url}) ...
        server.kill()     # SIGKILL: as a crashed or unreachable Redis
        server.start()    # again, same port, empty (nothing is persisted)

No persistence (``--save "" --appendonly no``), so a restarted server is
empty and nothing is written to disk but a log file.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from tests.integration.servers import free_port

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    def __init__(self, port: int | None = None, *, ready_timeout: float = 10.0) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.ready_timeout = ready_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        assert REDIS_SERVER is not None
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 (the child keeps it)
        cmd = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
        ]
        with log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=self.dir)
        deadline = time.monotonic() + self.ready_timeout
        with self.client() as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.proc.returncode}:\n{self.log()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server not ready on port {self.port}:\n{self.log()}")
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server and wait for it to be gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
