"""`make demo`: serve the default model and talk to it as users of the field do.

Starts `tandem serve` on a free loopback port and the smg gateway in front
of it (`tandem gateway`), and streams a few chat answers with the `openai`
client through smg's OpenAI endpoint (text appears as it is generated),
then a summary (time to first token, tokens/s, prefix-cache hits: the
prompts share a system prompt). One more answer through Tandem's own gRPC
API (`tandem generate`), `tandem status`, and the pod stops with SIGTERM (a
drain).

Then the same on a disaggregated stack: a prefill pod and a decode pod
sharing KV through the shared-memory connector, and smg in P/D mode in
front. The decode pod's prompt comes from the connector (its status says
how many tokens it loaded instead of computing).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from service.bench import free_port
from service.client import wait_serving
from service.demo_openai import Gateway, print_summary

# Long enough to fill a few KV blocks: every question after the first
# reuses them from the prefix cache.
SYSTEM = (
    "You are a concise, friendly assistant running on Tandem, a small LLM "
    "serving system with a paged KV cache and prefix caching. Answer in one "
    "or two plain sentences, without lists, and never repeat the question."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me one tip for writing readable code.",
]
STATS = re.compile(
    r"\[(\d+) tokens; time to first token (\d+) ms; ([\d.]+) tokens/s after it; "
    r"prompt (\d+) tokens, (\d+) from the prefix cache\]"
)


def _tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "service.cli", "--log-level", "warning", *args]


def main() -> int:
    code = _colocated()
    if code == 0:
        code = _disaggregated()
    return code


def _start(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = Path(tempfile.gettempdir()) / f"tandem-demo-{name}.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(_tandem(*args), stdout=log_file, stderr=subprocess.STDOUT)
    return proc, log


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def _stop(procs: list[subprocess.Popen[bytes]]) -> int:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    return max(abs(proc.wait(timeout=120)) for proc in procs)


def _disaggregated() -> int:
    ports = [str(free_port()) for _ in range(2)]
    prefill, decode = (f"127.0.0.1:{p}" for p in ports)
    pool = f"demo-{ports[0]}"

    def kv(role: str) -> str:
        extra = {"pool_name": pool, "capacity_bytes": 256 << 20}
        return json.dumps(
            {"kv_connector": "shm", "kv_role": role, "kv_connector_extra_config": extra}
        )

    small = ("--kv-cache-memory", "512M", "--max-model-len", "4096")
    print("\n=== prefill/decode disaggregation: two pods and smg on this machine ===")
    print(
        f"$ tandem serve --role prefill --port {ports[0]} "
        f"--kv-transfer-config '{kv('kv_producer')}'"
    )
    print(
        f"$ tandem serve --role decode --port {ports[1]} "
        f"--kv-transfer-config '{kv('kv_consumer')}'",
        flush=True,
    )
    procs = []
    try:
        for name, args in (
            ("prefill", ("serve", "--role", "prefill", "--port", ports[0], *small,
                         "--kv-transfer-config", kv("kv_producer"))),
            ("decode", ("serve", "--role", "decode", "--port", ports[1], *small,
                        "--kv-transfer-config", kv("kv_consumer"))),
        ):  # fmt: skip
            procs.append(_start(name, *args)[0])
        for target, proc in zip((prefill, decode), procs, strict=True):
            asyncio.run(wait_serving(target, alive=partial(_alive, proc)))
        print("both SERVING\n", flush=True)
        with Gateway("--prefill", prefill, "--decode", decode) as gateway:
            answer = gateway.stream_chat(SYSTEM, "Explain in one sentence what a KV cache is.")
        print(
            f"handover: smg ran the prompt's {answer.prompt_tokens} tokens on the prefill pod, "
            "which left their KV in shared memory; the decode pod loaded it instead of "
            f"recomputing and generated the {answer.tokens} tokens."
        )
        print(f"\n$ tandem status --server {decode}", flush=True)
        subprocess.run(_tandem("status", "--server", decode), check=True)
    finally:
        code = _stop(procs)
        print(f"\npods stopped (exit code {code})")
    return 0 if code == 0 else 1


def _colocated() -> int:
    server = f"127.0.0.1:{free_port()}"
    log = Path(tempfile.gettempdir()) / "tandem-demo-server.log"
    print(f"$ tandem serve --port {server.rsplit(':', 1)[1]}   (log: {log})", flush=True)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            _tandem("serve", "--port", server.rsplit(":", 1)[1]),
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        start = time.monotonic()
        asyncio.run(wait_serving(server, alive=lambda: proc.poll() is None))
        print(f"health: SERVING after {time.monotonic() - start:.1f} s\n", flush=True)
        with Gateway("--worker", server) as gateway:
            print("the openai client, streaming through smg:\n", flush=True)
            answers = [gateway.stream_chat(SYSTEM, q) for q in QUESTIONS]
            print_summary(answers)
        print("\nthe same pod through Tandem's own gRPC API (tandem.v1):", flush=True)
        _ask(server, "What is a paged KV cache?")
        print(f"$ tandem status --server {server}", flush=True)
        subprocess.run(_tandem("status", "--server", server), check=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        print(f"\nserver drained and exited with code {code}")
    return 0 if code == 0 else 1


def _ask(server: str, question: str) -> tuple[str, re.Match[str] | None]:
    print(f'$ tandem generate --chat --system "..." "{question}"', flush=True)
    result = subprocess.run(
        _tandem(
            "generate", "--server", server, "--chat", "--system", SYSTEM, "--stats",
            "--max-tokens", "64", question,
        ),
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )  # fmt: skip
    print(result.stderr.strip() + "\n", flush=True)
    return question, STATS.search(result.stderr)


if __name__ == "__main__":
    sys.exit(main())
