"""KVTransferParams: the typed form of kv_transfer_params."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2

from engine.kv_transfer.params import KVTransferParams, KVTransferParamsError

# Every field set: what a NIXL prefill pod returns, and a prefill leg's ask.
EVERY_FIELD = KVTransferParams(
    do_remote_decode=False,
    do_remote_prefill=True,
    kv_connector="nixl",
    remote_engine_id="e1",
    num_blocks=3,
    remote_agent="tandem-e1",
    remote_address="127.0.0.1:50061",
    remote_request_id="r1",
    remote_block_ids=(3, 4, 5),
    remote_num_tokens=40,
    remote_compat="abc",
    remote_hold="ab" * 16,
)


def test_round_trip_keeps_only_the_set_keys() -> None:
    params = KVTransferParams.from_dict({"do_remote_decode": True})
    assert params.do_remote_decode is True and params.do_remote_prefill is None
    assert params.to_dict() == {"do_remote_decode": True}
    assert KVTransferParams.from_dict({}).to_dict() == {}


def test_every_field_round_trips() -> None:
    assert all(getattr(EVERY_FIELD, f.name) is not None for f in dataclasses.fields(EVERY_FIELD))
    assert KVTransferParams.from_dict(EVERY_FIELD.to_dict()) == EVERY_FIELD
    assert KVTransferParams.from_dict(KVTransferParams().to_dict()) == KVTransferParams()


def test_every_field_round_trips_through_the_wire_struct() -> None:
    """On the wire the params are a protobuf Struct, whose numbers are
    doubles: they come back as the same params, ints as ints."""
    wire = struct_pb2.Struct()
    wire.update(EVERY_FIELD.to_dict())
    back = KVTransferParams.from_dict(json_format.MessageToDict(wire))
    assert back == EVERY_FIELD
    assert back.remote_block_ids is not None
    assert all(type(b) is int for b in back.remote_block_ids)


def test_integral_numbers_become_ints() -> None:
    params = KVTransferParams.from_dict({"remote_block_ids": [1.0, 2.0], "num_blocks": 2.0})
    assert params.remote_block_ids == (1, 2) and params.num_blocks == 2
    assert params.to_dict() == {"remote_block_ids": [1, 2], "num_blocks": 2}


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"do_remote_decode": 1}, "do_remote_decode"),
        ({"num_blocks": True}, "num_blocks"),
        ({"num_blocks": float("inf")}, "num_blocks"),
        ({"num_blocks": float("nan")}, "num_blocks"),
        ({"remote_num_tokens": -1}, "remote_num_tokens"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"remote_block_ids": [0, None]}, "remote_block_ids[1]"),
        ({"remote_address": None}, "remote_address"),
        ({"remote_compat": 7}, "remote_compat"),
        ({"extra": 1}, "extra"),
    ],
)
def test_wrong_values_name_their_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(KVTransferParamsError) as info:
        KVTransferParams.from_dict(values)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: expected") or "unknown key" in str(info.value)


def test_caller_text_in_messages_is_cut() -> None:
    with pytest.raises(KVTransferParamsError) as info:
        KVTransferParams.from_dict({"k" * 10_000: 1})
    assert len(str(info.value)) < 400
    with pytest.raises(KVTransferParamsError) as info:
        KVTransferParams.from_dict({"remote_agent": list(range(10_000))})
    assert len(str(info.value)) < 200
