"""The side channel: which connectors get one is the connector's word
(``needs_side_channel``; a multi connector's tiers'), and a peer asking by
connector name finds it, whatever composes it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf import wrappers_pb2

from engine.config import EngineConfig, KVTransferConfig
from service.side_channel import KVTransferServicer, with_side_channel

NIXL = KVTransferConfig("nixl", "kv_producer")
MULTI_NIXL = KVTransferConfig(
    "multi",
    "kv_producer",
    {
        "connectors": [
            {"kv_connector": "shm", "kv_connector_extra_config": {"size": 1}},
            {"kv_connector": "nixl", "kv_connector_extra_config": {"handshake_timeout": 3}},
        ]
    },
)


def _told(kv: KVTransferConfig | None) -> EngineConfig:
    return with_side_channel(EngineConfig(kv_transfer=kv), "10.0.0.5", 50061)


def test_a_connector_that_needs_a_side_channel_is_told_where_it_is() -> None:
    told = _told(NIXL).kv_transfer
    assert told is not None
    assert told.kv_connector_extra_config == {
        "side_channel_host": "10.0.0.5",
        "side_channel_port": 50061,
    }
    # What the connector's own extra config says wins.
    mine = KVTransferConfig("nixl", "kv_producer", {"side_channel_host": "pod.example"})
    told = _told(mine).kv_transfer
    assert told is not None and told.kv_connector_extra_config["side_channel_host"] == "pod.example"


@pytest.mark.parametrize(
    "kv",
    [
        None,
        KVTransferConfig("redis", "kv_producer", {"url": "redis://x:6379/0"}),
        KVTransferConfig("multi", "kv_both", {"connectors": [{"kv_connector": "shm"}]}),
        # A bad config is left for the engine to report when it builds it.
        KVTransferConfig("no-such-connector", "kv_both"),
        KVTransferConfig("multi", "kv_both", {"connectors": "nixl"}),
    ],
)
def test_a_connector_without_one_is_left_alone(kv: KVTransferConfig | None) -> None:
    config = EngineConfig(kv_transfer=kv)
    assert with_side_channel(config, "10.0.0.5", 50061) is config


def test_a_multi_connector_tells_its_tier_that_needs_one() -> None:
    told = _told(MULTI_NIXL).kv_transfer
    assert told is not None
    shm, nixl = told.kv_connector_extra_config["connectors"]
    assert shm == {"kv_connector": "shm", "kv_connector_extra_config": {"size": 1}}
    assert nixl == {
        "kv_connector": "nixl",
        "kv_connector_extra_config": {
            "side_channel_host": "10.0.0.5",
            "side_channel_port": 50061,
            "handshake_timeout": 3,
        },
    }
    # The config it was given is not changed.
    assert "side_channel_host" not in str(MULTI_NIXL.kv_connector_extra_config)


class _Engine:
    def __init__(self, kv: KVTransferConfig) -> None:
        self.config = EngineConfig(kv_transfer=kv)

    def side_channel_payload(self) -> bytes:
        return b"handshake"


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _handshake(kv: KVTransferConfig, name: str) -> Any:
    servicer = KVTransferServicer()
    servicer.engine = _Engine(kv)  # type: ignore[assignment]
    ask = servicer.GetHandshake(wrappers_pb2.StringValue(value=name), _Context())
    try:
        return asyncio.run(ask).value
    except _Aborted as e:
        return e.args


@pytest.mark.parametrize("kv", [NIXL, MULTI_NIXL])
def test_a_peer_asking_for_the_connector_by_name_gets_its_handshake(
    kv: KVTransferConfig,
) -> None:
    assert _handshake(kv, "nixl") == b"handshake"
    assert _handshake(kv, "") == b"handshake"
    code, details = _handshake(kv, "mooncake")
    assert code == grpc.StatusCode.NOT_FOUND
    assert details == f"connector: this pod runs {kv.kv_connector!r}, not 'mooncake'"
