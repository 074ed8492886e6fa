"""The chart's smg sidecar (gateway.kind=sidecar) against a real pod: the
smg command line the chart renders for a decode pod, run beside the
session's `tandem serve` as that pod's Tandem (its gRPC and metrics ports
are the rendered pod's), answers the OpenAI API on the pod's HTTP port."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from service.gateway import smg_binary
from tests.integration.gateway import MODEL
from tests.integration.servers import ServerProcess, free_port
from tests.unit.helm.chart import FULLNAME, container, find, render


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None  # not listening yet


def _sidecar(server: ServerProcess) -> dict[str, Any]:
    """The decode pod's smg container, rendered for a pod whose Tandem is
    `server` (colocated: the session's one server plays the whole pool)."""
    assert server.metrics_port is not None
    values = {
        "gateway": {
            "kind": "sidecar",
            "mode": "colocated",
            "port": free_port(),
            "healthCheckPort": free_port(),
            "sidecar": {"prometheusPort": free_port()},
        },
        "prefill": {"replicas": 0},
        "decode": {"engine": {"port": server.port}},
        "metrics": {"port": server.metrics_port},
    }
    c: dict[str, Any] = container(find(render(values), "Deployment", f"{FULLNAME}-decode"), "smg")
    return c


@pytest.fixture
def sidecar(server: ServerProcess, tmp_path: Path) -> Iterator[dict[str, int]]:
    """The rendered sidecar running until its readiness probe passes; its
    named ports. Killed on the way out (smg keeps nothing worth a drain)."""
    c = _sidecar(server)
    assert c["command"] == ["smg"]
    ports = {p["name"]: int(p["containerPort"]) for p in c["ports"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    log = tmp_path / "smg.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [smg_binary(), *[str(a) for a in c["args"]]],
            env={**env, "NO_COLOR": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        probe = c["readinessProbe"]["httpGet"]
        ready = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"
        deadline = time.monotonic() + 60
        while _status(ready) != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"smg not ready (exit {proc.poll()}): {log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield ports
    finally:
        proc.kill()
        proc.wait()


def test_a_pod_local_smg_answers_chat_completions(sidecar: dict[str, int]) -> None:
    base = f"http://127.0.0.1:{sidecar['http']}"
    assert _status(f"{base}/health") == 200
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    assert MODEL in [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
    # smg's own metrics on the sidecar's metrics port (not Tandem's).
    assert _status(f"http://127.0.0.1:{sidecar['smg-metrics']}/metrics") == 200
