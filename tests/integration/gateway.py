"""A real smg gateway (`tandem gateway`) in front of Tandem pods, for tests.

    with SmgGateway(workers=[server.target]) as gateway:
        client = gateway.openai()

It is a separate process on free loopback ports (HTTP and smg's own
metrics), ready once a chat completion goes through, and killed on exit
(smg keeps no state worth a drain).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import openai

from tests.integration.servers import ROOT, free_port, log_dir

MODEL = "SmolLM2-135M-Instruct"


class SmgGateway:
    def __init__(
        self,
        *,
        workers: list[str] | None = None,
        prefill: list[str] | None = None,
        decode: list[str] | None = None,
        extra: list[str] | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        args = ["--port", str(self.port), "--prometheus-port", str(free_port())]
        for flag, targets in (("--worker", workers), ("--prefill", prefill), ("--decode", decode)):
            for target in targets or []:
                args += [flag, target]
        self.args = args + (["--", *extra] if extra else [])
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> SmgGateway:
        with tempfile.NamedTemporaryFile(
            prefix="smg-", suffix=".log", dir=log_dir(), delete=False
        ) as log:
            self.log_path = Path(log.name)
            cmd = [sys.executable, "-m", "service.cli", "gateway", *self.args]
            env = {**os.environ, "NO_COLOR": "1"}
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def openai(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, **kwargs)  # type: ignore[arg-type]

    def _wait_ready(self) -> None:
        """Until a one-token chat completion answers: smg has registered the
        pods, fetched their tokenizer and found them healthy."""
        client = self.openai(timeout=10.0)
        deadline = time.monotonic() + self.ready_timeout
        error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}; log:\n{self.log()}")
            try:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
                return
            except openai.OpenAIError as exc:
                error = exc
                time.sleep(0.3)
        raise TimeoutError(f"smg not ready ({error!r}); log:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:] if self.log_path else ""


def greedy_completions(
    client: openai.OpenAI, prompts: list[str], max_tokens: int = 12
) -> list[openai.types.Completion]:
    """Each prompt completed greedily, EOS ignored, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def cancel_after(client: openai.OpenAI, prompt: str, chunks: int) -> None:
    """Streams a long completion and hangs up after `chunks` chunks (0: as
    soon as the response starts)."""
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with stream:
        for received, _ in enumerate(stream, 1):
            if received >= chunks:
                break
