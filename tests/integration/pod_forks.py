"""Pods forked from one warm process per test worker, so a pod's start skips
the imports every `tandem serve` pays.

A pod started with `python -m service.cli serve` spends most of its start
importing: torch, transformers' lazy module table, and the chain that
transformers' Llama config pulls in (torch.distributed.tensor among it),
~8 of its ~11 CPU-seconds on the 2-core machine. The integration run starts
~80 pods, so those imports were most of its time. Here a multiprocessing
"forkserver" imports them once (PRELOAD) and forks each pod from that state;
the child then runs `service.cli.main` with the pod's arguments, exactly the
code a `tandem serve` runs after its imports, in its own process: its own
pid, signals, exit code, log file, environment and working directory. It
serves in 2.5 s against 8.2 s for a fresh interpreter (medians of
`benchmarks/startup_bench.py --forked --rounds 3`, benchmarks/README.md).

What differs from a fresh interpreter: variables read when an interpreter or
a library starts (PYTHONPATH, OpenMP's settings) come from the test worker
at the forkserver's start, not from the pod's `env`. ServerProcess therefore
starts a pod with its own `env` as a fresh interpreter, as it does for every
pod when TANDEM_TEST_PODS=exec.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
from multiprocessing.context import ForkServerContext
from pathlib import Path

# Imported once by the forkserver: the server, the CLI, the config chain its
# tokenizer and config loads reach (~2.5 s alone), and the CPU kernels' loader.
PRELOAD = (
    "service.cli",
    "service.server",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.configuration_llama",
    "kernels.cpu_kernels",
)

_context: ForkServerContext | None = None


def forks_enabled() -> bool:
    return os.environ.get("TANDEM_TEST_PODS", "fork") != "exec"


def _forkserver() -> ForkServerContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        _context = context
    return _context


def _run(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """The pod's process: its log on stdout and stderr, its environment and
    directory, then the CLI as `python -m service.cli` runs it. Exit
    handlers run here (multiprocessing ends a child with os._exit)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from service import cli

    try:
        code = cli.main(argv)
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class ForkedPod:
    """A forked pod with the part of `subprocess.Popen`'s interface the
    tests use: pid, poll, wait, send_signal, kill (exit codes as Popen's:
    negative for a signal)."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: Path, log_path: Path):
        # daemon: a test worker that exits with a pod still up (a test
        # stopped by a timeout) SIGTERMs it, a drain, instead of waiting on it.
        self._process = _forkserver().Process(
            target=_run, args=(argv, env, str(cwd), str(log_path)), daemon=True
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        self.args = argv

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            # The forkserver, the pod's parent, reaps it before its exit
            # status reaches us: a pod gone in between is not an error, as
            # Popen.send_signal ignores one too.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
