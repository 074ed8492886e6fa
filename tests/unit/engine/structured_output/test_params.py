"""StructuredOutputParams: exactly one constraint, checked, with a stable key."""

from __future__ import annotations

import json

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured_output.params import (
    ConstraintError,
    ConstraintKind,
    StructuredOutputParams,
)


def test_each_kind_and_its_key() -> None:
    assert StructuredOutputParams(json={"type": "object"}).key == (
        ConstraintKind.JSON,
        '{"type":"object"}',
    )
    assert StructuredOutputParams(json_object=True).kind is ConstraintKind.JSON_OBJECT
    assert StructuredOutputParams(regex="a+").spec == "a+"
    assert StructuredOutputParams(choice=["a", "é"]).spec == '["a", "é"]'
    assert StructuredOutputParams(grammar='root ::= "x"').kind is ConstraintKind.GRAMMAR


def test_a_schema_as_text_or_dict_is_the_same_key() -> None:
    text = '{"type": "object", "required": ["a"], "properties": {"a": {}}}'
    same = {"type": "object", "required": ["a"], "properties": {"a": {}}}
    assert StructuredOutputParams(json=text).key == StructuredOutputParams(json=same).key


def test_a_schema_keeps_its_key_order() -> None:
    """The backend generates properties in the schema's order (OpenAI's
    promise): nothing re-sorts them, and another order is another key."""
    properties = {"zeta": {"type": "integer"}, "alpha": {"type": "string"}, "mid": {}}
    schema = {"type": "object", "properties": properties, "required": ["zeta", "alpha"]}
    so = StructuredOutputParams(json=schema)
    assert list(json.loads(so.spec)["properties"]) == ["zeta", "alpha", "mid"]
    assert so.spec == json.dumps(schema, separators=(",", ":"))
    assert StructuredOutputParams(json=json.dumps(schema)).key == so.key
    reordered = {"required": ["zeta", "alpha"], "type": "object", "properties": properties}
    assert StructuredOutputParams(json=reordered).key != so.key


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({}, "structured_outputs", "exactly one constraint must be given, got none"),
        ({"regex": "a", "grammar": "b"}, "structured_outputs", "got regex, grammar"),
        ({"json": "{not json"}, "structured_outputs.json", "is not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json", "must be an object, got list"),
        ({"regex": "  "}, "structured_outputs.regex", "non-empty string"),
        ({"choice": []}, "structured_outputs.choice", "non-empty list"),
        ({"choice": ["a", ""]}, "structured_outputs.choice[1]", "non-empty string"),
        ({"grammar": ""}, "structured_outputs.grammar", "non-empty string"),
    ],
)
def test_bad_constraints_name_their_field(
    kwargs: dict[str, object], field: str, message: str
) -> None:
    with pytest.raises(ConstraintError, match=message) as info:
        StructuredOutputParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_sampling_params_take_only_the_constraint_type() -> None:
    so = StructuredOutputParams(regex="a+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
