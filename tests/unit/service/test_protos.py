"""The generated stubs in service/gen match protos/ (regenerate: make protos)."""

from __future__ import annotations

from pathlib import Path

from service import protogen
from service.gen.tandem.v1 import generation_pb2 as pb


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
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
    }
    streaming = {m.name for m in service.methods if m.server_streaming}
    assert streaming == {"Generate", "SubscribeKvEvents"}
