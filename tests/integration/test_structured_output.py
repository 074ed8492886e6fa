"""Structured output over a real server: each kind of constraint through
tandem.v1, and the errors a bad one gets. (The P/D path: test_pd.py, on
its stack; the OpenAI path: test_gateway.py.)"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import grpc
import jsonschema
import pytest

from service.client import TandemClient, make_request
from service.gen.tandem.v1 import generation_pb2 as pb
from tests.integration.servers import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


async def _one(target: str, constraint: dict[str, Any], **sampling: Any) -> pb.GenerateResponse:
    values = {"max_tokens": 80, "temperature": 0.0, **sampling}
    request = make_request(messages=ASK, constraint=constraint, **values)
    merged = pb.GenerateResponse()
    async with TandemClient(target) as client:
        async for chunk in client.stub.Generate(request, timeout=120):
            merged.token_ids.extend(chunk.token_ids)
            merged.text += chunk.text
            if chunk.finish_reason:
                merged.finish_reason = chunk.finish_reason
    return merged


def test_each_kind_of_constraint(server: ServerProcess) -> None:
    async def go() -> list[pb.GenerateResponse]:
        return list(
            await asyncio.gather(
                _one(server.target, {"json_schema": SCHEMA}),
                _one(server.target, {"json_object": True}),
                _one(server.target, {"regex": r"[A-Z][a-z]+, [0-9]{4}"}),
                _one(server.target, {"choice": ["north", "south"]}),
                _one(server.target, {"grammar": 'root ::= "city: " [a-z]+ "."'}),
                _one(server.target, {"json_schema": json.dumps(SCHEMA)}, seed=5, temperature=1.0),
            )
        )

    schema, any_object, regex, choice, grammar, sampled = asyncio.run(go())
    for out in (schema, any_object, regex, choice, grammar, sampled):
        assert out.finish_reason == pb.FINISH_REASON_STOP, out.text
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    jsonschema.validate(json.loads(sampled.text), SCHEMA)
    assert isinstance(json.loads(any_object.text), dict)
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", regex.text)
    assert choice.text in ("north", "south")
    assert re.fullmatch(r"city: [a-z]+\.", grammar.text)


@pytest.mark.parametrize(
    ("constraint", "details"),
    [
        ({"json_schema": "{not json"}, "json_schema: is not valid JSON"),
        ({"choice": ["a", ""]}, r"choice\[1\]: must be a non-empty string"),
        ({"json_object": False}, "json_object: must be true"),
        ({"regex": "(unclosed"}, r"structured_outputs\.regex: the constraint does not compile"),
        ({"grammar": "root ::= nowhere"}, r"structured_outputs\.grammar: .*compile"),
        ({"json_schema": {"type": 12}}, r"structured_outputs\.json: .*compile"),
        # Keywords xgrammar would drop, named where they sit.
        (
            {"json_schema": {"type": "array", "items": {}, "contains": {"const": 7}}},
            r"^json_schema\.contains: 'contains' is not enforced",
        ),
        (
            {"json_schema": {"type": "object", "properties": {"n": {"not": {"const": 3}}}}},
            r"^json_schema\.properties\.n\.not: 'not' is not enforced",
        ),
        (
            {"json_schema": {"allOf": [{"type": "integer"}, {"maximum": 5}]}},
            r"^json_schema\.allOf: 'allOf' with more than one schema",
        ),
        (
            {"json_schema": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
            r"^json_schema\.maxLength: 'maxLength' together with 'pattern'",
        ),
        # The backend's own message, without its log prefix ("[08:35:16] /project/cpp/...").
        ({"regex": "a(?<=b)"}, r"^structured_outputs\.regex: .*compile: Regex parsing error"),
    ],
)
def test_a_bad_constraint_is_invalid_argument(
    server: ServerProcess, constraint: dict[str, Any], details: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_one(server.target, constraint))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(details, info.value.details() or ""), info.value.details()


def test_an_object_follows_the_schemas_key_order(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {
            "zeta": {"type": "boolean"},
            "alpha": {"type": "boolean"},
            "mid": {"enum": [1, 2]},
        },
        "required": ["zeta", "alpha", "mid"],
        "additionalProperties": False,
    }
    out = asyncio.run(_one(server.target, {"json_schema": json.dumps(schema)}, max_tokens=24))
    assert out.finish_reason == pb.FINISH_REASON_STOP, out.text
    keys = [k for k, _ in json.loads(out.text, object_pairs_hook=list)]
    assert keys == ["zeta", "alpha", "mid"], out.text
