"""The OpenAI side of `make demo`: smg (`tandem gateway`) in front of pods,
and the `openai` client streaming chat answers through it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from service.bench import free_port


@dataclass
class Answer:
    question: str
    tokens: int
    ttft_ms: float
    tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int


class Gateway:
    """`tandem gateway` (smg) on a free port, killed on exit."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.flags = [*flags, "--port", str(self.port), "--prometheus-port", str(free_port())]
        self.log = Path(tempfile.gettempdir()) / f"tandem-demo-smg-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0
        )

    def __enter__(self) -> Gateway:
        print(f"$ tandem gateway {' '.join(self.flags)}   (log: {self.log})", flush=True)
        cmd = [sys.executable, "-m", "service.cli", "gateway", *self.flags]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        self._wait_ready()
        print(f"smg ready after {time.monotonic() - start:.1f} s: OpenAI API at {self.url}\n")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited ({self.proc.returncode}); see {self.log}")
            try:
                model = self.client.models.list().data[0].id
                self.client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
                return
            except (openai.OpenAIError, IndexError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def stream_chat(self, system: str, question: str, max_tokens: int = 64) -> Answer:
        """Prints the answer as it streams, then one line of figures."""
        model = self.client.models.list().data[0].id
        print(f">>> {question}", flush=True)
        start = time.monotonic()
        first: float | None = None
        stream = self.client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        end = time.monotonic()
        first = first or end
        tokens = usage.completion_tokens if usage else 0
        details = usage.prompt_tokens_details if usage else None
        answer = Answer(
            question=question,
            tokens=tokens,
            ttft_ms=(first - start) * 1000,
            tokens_per_s=(tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
        )
        print(
            f"\n[{answer.tokens} tokens; time to first token {answer.ttft_ms:.0f} ms; "
            f"{answer.tokens_per_s:.1f} tokens/s after it; prompt {answer.prompt_tokens} "
            f"tokens, {answer.cached_tokens} from the prefix cache]\n",
            flush=True,
        )
        return answer


def print_summary(answers: list[Answer]) -> None:
    print("summary")
    print(f"  {'question':<44} {'tokens':>6} {'TTFT ms':>8} {'tok/s':>7} {'cached/prompt':>14}")
    for a in answers:
        cached = f"{a.cached_tokens}/{a.prompt_tokens}"
        print(
            f"  {a.question:<44} {a.tokens:>6} {a.ttft_ms:>8.0f} "
            f"{a.tokens_per_s:>7.1f} {cached:>14}"
        )
