"""A Node.js client (tests/integration/node) against a real server: clients in
another language work from protos/ alone, and get what the Python client gets.

`make test` (its `node` target) installs node, npm and the client's packages.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from typing import Any

from service.client import TandemClient
from tests.integration.servers import ROOT, ServerProcess

NODE_DIR = ROOT / "tests" / "integration" / "node"
CLIENT = NODE_DIR / "generate_client.js"
PROMPT = "The capital of France is"
MAX_TOKENS = 16
SETUP_HINT = "run `make test` (or `make node`) to install node, npm and the client's packages"


def run_node_client(target: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    node = shutil.which("node")
    assert node is not None, f"node is not on PATH: {SETUP_HINT}"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        f"the Node client's packages are not installed in {NODE_DIR}: {SETUP_HINT}"
    )
    proc = subprocess.run(
        [node, str(CLIENT), target, prompt, str(max_tokens)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"node client exited with {proc.returncode}\nstderr:\n{proc.stderr}\nstdout:\n{proc.stdout}"
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line, got:\n{proc.stdout}"
    result: dict[str, Any] = json.loads(lines[0])
    return result


async def python_generate(target: str, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    text = ""
    token_ids: list[int] = []
    async with TandemClient(target) as client:
        async for chunk in client.generate(text=prompt, max_tokens=max_tokens, temperature=0.0):
            text += chunk.text
            token_ids.extend(chunk.token_ids)
    return text, token_ids


def test_node_client_generates_what_python_does(server: ServerProcess) -> None:
    result = run_node_client(server.target, PROMPT, MAX_TOKENS)

    assert result["model_name"] == "SmolLM2-135M-Instruct"
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert len(result["token_ids"]) == MAX_TOKENS
    assert all(isinstance(t, int) for t in result["token_ids"])
    assert result["text"]
    assert result["chunks"] >= 1
    assert result["usage"]["completion_tokens"] == MAX_TOKENS
    assert result["usage"]["prompt_tokens"] > 0

    text, token_ids = asyncio.run(python_generate(server.target, PROMPT, MAX_TOKENS))
    assert result["token_ids"] == token_ids
    assert result["text"] == text
