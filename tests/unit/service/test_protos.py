"""The generated stubs in service/gen match protos/ (regenerate: make protos)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from service import protogen
from service.gen.tandem.v1 import generation_pb2 as pb


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    # In its own process: grpc_tools' protoc and NIXL (imported by other
    # test modules) bundle clashing absl libraries, and one process cannot
    # load both.
    subprocess.run(
        [sys.executable, "-m", "service.protogen", "--out", str(tmp_path)],
        cwd=protogen.ROOT,
        check=True,
        capture_output=True,
    )
    fresh = [p for p in sorted(tmp_path.rglob("*.py*")) if p.suffix in (".py", ".pyi")]
    assert fresh, "protoc wrote nothing"
    for path in fresh:
        installed = protogen.DEFAULT_OUT / path.relative_to(tmp_path)
        assert installed.exists(), f"{installed} missing: run `make protos`"
        assert installed.read_text() == path.read_text(), (
            f"{installed} is stale: protos/ changed since it was generated; run `make protos`"
        )


def test_every_rpc_of_the_api_is_present() -> None:
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "tandem.v1.Generation"
    assert {m.name for m in service.methods} == {
        "Generate",
        "Abort",
        "Tokenize",
        "GetModelInfo",
        "GetServerStatus",
        "SubscribeKvEvents",
        "LoadLoraAdapter",
        "UnloadLoraAdapter",
        "ListLoraAdapters",
    }
    streaming = {m.name for m in service.methods if m.server_streaming}
    assert streaming == {"Generate", "SubscribeKvEvents"}
