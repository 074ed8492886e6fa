"""A third-party connector, shipped as its own installed distribution (a
module plus a dist-info registering it in ``tandem.kv_connectors``), loads
by name inside a running ``tandem serve`` and sees the engine's hooks."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

from service.client import TandemClient, make_request
from tests.integration.servers import ServerProcess

MODULE = '''
import json
from typing import Any

from engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata


class TraceConnector(KVConnectorBase):
    """Loads nothing, saves nothing: writes what the engine told it."""

    def _log(self, **event: Any) -> None:
        path = self.context.config.kv_connector_extra_config["path"]
        with open(path, "a") as f:
            f.write(json.dumps({"role": self.role.value, **event}) + "\\n")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self._log(event="finished", request_id=request.request_id, blocks=len(block_ids))
        return False, None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._log(event="registered", layers=len(kv_caches))

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
'''


def _install(site: Path) -> None:
    (site / "acme_trace.py").write_text(MODULE)
    dist = site / "acme_trace-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-trace\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [tandem.kv_connectors]
            acme-trace = acme_trace:TraceConnector
            """
        )
    )


def test_entry_point_connector_runs_inside_a_server(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    trace = tmp_path / "trace.jsonl"
    config = {"kv_connector": "acme-trace", "kv_connector_extra_config": {"path": str(trace)}}
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    with ServerProcess(
        [
            "--kv-cache-memory",
            "256M",
            "--max-model-len",
            "2048",
            "--kv-transfer-config",
            json.dumps(config),
        ],
        env={"PYTHONPATH": pythonpath},
    ) as server:

        async def generate() -> None:
            async with TandemClient(server.target) as client:
                request = make_request(text="Hello there", max_tokens=3, request_id="trace-1")
                async for _ in client.stub.Generate(request, timeout=60):
                    pass

        asyncio.run(generate())
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {"role": "worker", "event": "registered", "layers": 30} in events
    finished = [e for e in events if e["event"] == "finished"]
    assert len(finished) == 1 and finished[0]["role"] == "scheduler"
    assert finished[0]["request_id"] == "trace-1" and finished[0]["blocks"] >= 1
