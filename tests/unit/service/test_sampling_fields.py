"""The sampling-field table: it covers every SamplingParams field and every
field of both protocols' messages, both converters and the CLI read each
field through it, and docs/serving.md shows it as it is."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine import SamplingParams
from engine.structured_output.params import StructuredOutputParams
from service import cli, convert, vllm_convert
from service.client import make_request
from service.gen.tandem.v1 import generation_pb2 as pb
from service.sampling_fields import (
    BY_NAME,
    DOC_BEGIN,
    DOC_END,
    FIELDS,
    OTHER_WIRE_FIELDS,
    PROTOCOLS,
    SERVING_DOC,
    Protocol,
    SamplingField,
    Wire,
    flag_values,
    markdown_table,
    rewritten,
)

# A value other than the default for every field (a new field needs one):
# zeros where the field has presence, to show a set zero is taken.
EXAMPLES: dict[str, Any] = {
    "max_tokens": 7,
    "min_tokens": 2,
    "temperature": 0.0,
    "top_p": 0.5,
    "top_k": 5,
    "seed": 0,
    "stop": ["x", "yz"],
    "stop_token_ids": [3, 4],
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "logprobs": 0,
    "prompt_logprobs": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.25,
    "min_p": 0.125,
    "logit_bias": {5: 2.0},
    "structured_outputs": StructuredOutputParams(regex="[0-9]+"),
}

MESSAGES = {"tandem": pb.SamplingParams, "vllm": vpb.SamplingParams}


def _init_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(SamplingParams) if f.init]


def test_every_sampling_params_field_has_one_row_and_an_example() -> None:
    names = [f.name for f in FIELDS]
    assert sorted(names) == sorted(_init_fields())
    assert len(set(names)) == len(names)
    assert sorted(EXAMPLES) == sorted(names)
    for name, value in EXAMPLES.items():
        assert value != BY_NAME[name].default, name
    SamplingParams(**EXAMPLES)  # valid together


def _covered(protocol: Protocol) -> set[str]:
    """The SamplingParams message's fields the table reads (a oneof: all
    its fields)."""
    descriptor = MESSAGES[protocol].DESCRIPTOR
    names: set[str] = set()
    for f in FIELDS:
        wire = f.wire(protocol)
        if wire is None or wire.on_request:
            continue
        oneof = descriptor.oneofs_by_name.get(wire.name)
        names |= {x.name for x in oneof.fields} if oneof is not None else {wire.name}
    return names


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_field_of_the_protocols_message_is_read_or_accounted_for(protocol: Protocol) -> None:
    wire_fields = set(MESSAGES[protocol].DESCRIPTOR.fields_by_name)
    covered = _covered(protocol)
    others = set(OTHER_WIRE_FIELDS[protocol])
    assert covered <= wire_fields, covered - wire_fields
    assert others <= wire_fields, others - wire_fields
    assert wire_fields - covered - others == set()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_presence_is_as_the_proto_declares(protocol: Protocol) -> None:
    for f in FIELDS:
        wire = f.wire(protocol)
        if wire is None or wire.read is not None:
            continue
        message = pb.GenerateRequest if wire.on_request else MESSAGES[protocol]
        assert wire.optional == message.DESCRIPTOR.fields_by_name[wire.name].has_presence, f.name


def _set(target: Any, wire: Wire, field: SamplingField, value: Any) -> None:
    if field.name == "structured_outputs":
        target.regex = value.regex
    elif isinstance(value, list):
        getattr(target, wire.name).extend(value)
    elif isinstance(value, dict):
        getattr(target, wire.name).update(value)
    else:
        setattr(target, wire.name, value)


def _read(protocol: Protocol, values: dict[str, Any]) -> SamplingParams:
    if protocol == "tandem":
        request = pb.GenerateRequest(text="x")
        for name, value in values.items():
            wire = BY_NAME[name].tandem
            assert wire is not None
            _set(request if wire.on_request else request.sampling, wire, BY_NAME[name], value)
        return convert.sampling_params(request)
    msg = vpb.SamplingParams()
    for name, value in values.items():
        wire = BY_NAME[name].vllm
        assert wire is not None
        _set(msg, wire, BY_NAME[name], value)
    return vllm_convert.sampling_params(msg)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_field_crosses_each_wire(protocol: Protocol, name: str) -> None:
    if BY_NAME[name].wire(protocol) is None:
        pytest.skip(f"{protocol} does not carry {name}")
    assert _read(protocol, {name: EXAMPLES[name]}) == SamplingParams(**{name: EXAMPLES[name]})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_all_fields_together_and_none_at_all(protocol: Protocol) -> None:
    carried = {k: v for k, v in EXAMPLES.items() if BY_NAME[k].wire(protocol) is not None}
    assert _read(protocol, carried) == SamplingParams(**carried)
    assert _read(protocol, {}) == SamplingParams()


def _argv(field: SamplingField, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [field.flag_name]
    if isinstance(value, list):
        return [arg for item in value for arg in (field.flag_name, str(item))]
    return [field.flag_name, str(value)]


@pytest.mark.parametrize("name", [f.name for f in FIELDS if f.flag is not None])
def test_each_generate_flag_reaches_the_server_s_sampling_params(name: str) -> None:
    field = BY_NAME[name]
    args = cli._parser().parse_args(["generate", "hi", *_argv(field, EXAMPLES[name])])
    sent = make_request(text="hi", **flag_values(args))
    assert getattr(convert.sampling_params(sent), name) == EXAMPLES[name]


def test_generate_flags_left_unset_send_nothing_but_the_command_s_defaults() -> None:
    args = cli._parser().parse_args(["generate", "hi"])
    sent = make_request(text="hi", **flag_values(args)).sampling
    defaults = {f.tandem.name for f in FIELDS if f.flag and f.flag.default is not None and f.tandem}
    assert {f.name for f, _ in sent.ListFields()} == defaults


def test_the_serving_doc_shows_the_table_as_it_is() -> None:
    """If this fails: python -m service.sampling_fields"""
    text = SERVING_DOC.read_text()
    block = text.split(DOC_BEGIN + "\n", 1)[1].split(DOC_END, 1)[0]
    assert block == markdown_table() + "\n"
    assert rewritten(text) == text
