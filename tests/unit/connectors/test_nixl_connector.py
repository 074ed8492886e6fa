"""NixlConnector's scheduler half with typed KVTransferParams: what a
producer offers reaches a consumer, over the wire's Struct, as the place to
READ from. No NIXL agent is needed (the worker half is test_nixl_worker.py)."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
from google.protobuf import json_format, struct_pb2

from connectors.nixl_connector import HoldSpec, NixlConnector, NixlConnectorMetadata
from connectors.nixl_worker import RemoteSource
from engine.config import KVTransferConfig
from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.manager import KVCacheBlocks
from engine.kv_transfer.base import ConnectorContext, KVConnectorRole, KVLayout
from engine.kv_transfer.params import KVTransferParams
from engine.outputs import KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.request_options import RequestOptions
from engine.sampling_params import SamplingParams

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SIDE_CHANNEL = {"side_channel_host": "10.0.0.5", "side_channel_port": 50061}


def _connector(kv_role: str, engine_id: str) -> NixlConnector:
    config = KVTransferConfig("nixl", kv_role, dict(SIDE_CHANNEL))  # type: ignore[arg-type]
    context = ConnectorContext(config, "test-model", LAYOUT, engine_id)
    return NixlConnector(KVConnectorRole.SCHEDULER, context)


def _over_the_wire(params: KVTransferParams) -> KVTransferParams:
    wire = struct_pb2.Struct()
    wire.update(params.to_dict())
    return KVTransferParams.from_dict(json_format.MessageToDict(wire))


def test_a_producers_params_tell_the_consumer_where_to_read() -> None:
    producer = _connector("kv_producer", "p1")
    prefill = Request(
        "r1",
        list(range(10)),
        SamplingParams(max_tokens=1),
        options=RequestOptions(kv_transfer_params=KVTransferParams(do_remote_decode=True)),
    )
    prefill.num_computed_tokens = 10
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = producer.request_finished(prefill, [7, 8, 9])
    assert delay_free  # held for the consumer
    assert params is not None and params.remote_hold is not None
    nonce = params.remote_hold
    assert re.fullmatch("[0-9a-f]{32}", nonce)
    assert params == KVTransferParams(
        do_remote_prefill=True,
        kv_connector="nixl",
        remote_engine_id="p1",
        remote_agent="tandem-p1",
        remote_address="10.0.0.5:50061",
        remote_request_id="r1",
        remote_block_ids=(7, 8, 9),
        remote_num_tokens=10,
        remote_compat=producer.compat_hash,
        remote_hold=nonce,
        num_blocks=3,
    )
    held = producer.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(held, NixlConnectorMetadata)
    assert held.holds == [HoldSpec("r1", nonce, (7, 8, 9))]
    # The decode leg: prompt + the first token, the params as the wire gave them.
    consumer = _connector("kv_consumer", "d1")
    decode = Request(
        "r1",
        list(range(11)),
        SamplingParams(),
        options=RequestOptions(kv_transfer_params=_over_the_wire(params)),
    )
    consumer.request_added(decode)
    assert consumer.get_num_new_matched_tokens(decode, 0) == (10, True)
    meta = consumer.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(meta, NixlConnectorMetadata)
    source = RemoteSource(
        "10.0.0.5:50061", "tandem-p1", "r1", (7, 8, 9), 10, producer.compat_hash, nonce
    )
    assert meta.expects == [("r1", source)]


def test_a_request_that_does_not_hand_over_offers_nothing() -> None:
    producer = _connector("kv_producer", "p1")
    plain = Request("r1", list(range(10)), SamplingParams(max_tokens=1))
    plain.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer.request_finished(plain, [7, 8, 9]) == (False, None)


def test_params_lacking_a_key_are_recomputed_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    consumer = _connector("kv_consumer", "d1")
    params = KVTransferParams(do_remote_prefill=True, remote_agent="tandem-p1")
    decode = Request(
        "d", list(range(11)), SamplingParams(), options=RequestOptions(kv_transfer_params=params)
    )
    with caplog.at_level(logging.ERROR):
        assert consumer.get_num_new_matched_tokens(decode, 0) == (0, False)
    assert "kv_transfer_params lacks 'remote_address'" in caplog.text


def _blocks(*ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def _remote_params() -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True,
        kv_connector="nixl",
        remote_agent="tandem-p1",
        remote_address="10.0.0.5:50061",
        remote_request_id="r1",
        remote_block_ids=(7, 8, 9),
        remote_num_tokens=10,
        remote_compat="c",
        remote_hold="ab" * 16,
    )


def test_a_request_reads_its_remote_kv_once_and_recomputes_after_preemption() -> None:
    """Once the READ was posted the producer may free and reuse its blocks:
    a request preempted afterwards (its num_tokens grown) must never read
    the old hold again, which would load another request's KV."""
    consumer = _connector("kv_consumer", "d1")
    decode = Request(
        "r1",
        list(range(11)),
        SamplingParams(),
        options=RequestOptions(kv_transfer_params=_remote_params()),
    )
    consumer.request_added(decode)
    assert consumer.get_num_new_matched_tokens(decode, 0) == (10, True)
    blocks = _blocks(0, 1, 2)
    consumer.update_state_after_alloc(decode, blocks, 10)
    meta = consumer.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(meta, NixlConnectorMetadata) and len(meta.recvs) == 1
    consumer.update_connector_output(KVConnectorOutput(finished_recving={"r1"}))
    # Preempted: its blocks freed, it waits again with more tokens.
    decode.append_output_token_ids([5, 6, 7])
    assert consumer.get_num_new_matched_tokens(decode, 0) == (0, False)
    consumer.update_state_after_alloc(decode, _blocks(3), 0)
    meta = consumer.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(meta, NixlConnectorMetadata) and not meta.recvs and not meta.ended


def test_a_request_with_nothing_to_read_never_reads_later() -> None:
    """All of it was a local prefix hit: the producer is told to free, so
    a later admission (after a preemption) must not read either."""
    consumer = _connector("kv_consumer", "d1")
    decode = Request(
        "r1",
        list(range(11)),
        SamplingParams(),
        options=RequestOptions(kv_transfer_params=_remote_params()),
    )
    consumer.request_added(decode)
    assert consumer.get_num_new_matched_tokens(decode, 10) == (0, False)
    consumer.update_state_after_alloc(decode, _blocks(0, 1, 2), 0)
    meta = consumer.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(meta, NixlConnectorMetadata) and meta.ended == ["r1"]
    assert consumer.get_num_new_matched_tokens(decode, 0) == (0, False)


def test_params_without_a_hold_nonce_are_recomputed(caplog: pytest.LogCaptureFixture) -> None:
    consumer = _connector("kv_consumer", "d1")
    params = dataclasses.replace(_remote_params(), remote_hold="not-a-nonce")
    decode = Request(
        "d", list(range(11)), SamplingParams(), options=RequestOptions(kv_transfer_params=params)
    )
    with caplog.at_level(logging.ERROR):
        assert consumer.get_num_new_matched_tokens(decode, 0) == (0, False)
    assert "remote_hold: expected 32 hex digits" in caplog.text


def test_an_ipv6_side_channel_host_is_bracketed() -> None:
    config = KVTransferConfig(
        "nixl", "kv_producer", {"side_channel_host": "::1", "side_channel_port": 7}
    )
    connector = NixlConnector(
        KVConnectorRole.SCHEDULER, ConnectorContext(config, "m", LAYOUT, "p1")
    )
    assert connector.address == "[::1]:7"
