"""Keywords xgrammar drops are refused, each named where it sits.

Every refused case carries a probe: a JSON text that breaks only that
keyword, which the installed xgrammar's grammar for the schema accepts.
That is why it is refused; a probe that starts failing means xgrammar now
enforces the keyword, and the refusal can go.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from engine.structured_output.params import ConstraintError, StructuredOutputParams
from engine.structured_output.schema_check import first_unenforceable, regex_dropped_part

INT = {"type": "integer"}
STR = {"type": "string"}

# (schema, where the refused keyword is, words of the reason, a text that
# breaks the keyword and that xgrammar's grammar nevertheless accepts)
REFUSED: list[tuple[dict[str, Any], str, str, object]] = [
    (
        {
            "type": "object",
            "properties": {"ids": {"type": "array", "items": INT, "contains": {"const": 7}}},
            "required": ["ids"],
        },
        "properties.ids.contains",
        "'contains'",
        {"ids": [1, 2, 3]},
    ),
    ({"type": "array", "items": INT, "maxContains": 1}, "maxContains", "'maxContains'", [7, 7]),
    ({"type": "integer", "not": {"const": 3}}, "not", "'not'", 3),
    (
        {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
        "allOf",
        "'allOf' with more than one",
        6,
    ),
    (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "maxLength",
        "'maxLength' together with 'pattern'",
        "abcd",
    ),
    (
        {"type": "string", "minLength": 20, "format": "date"},
        "minLength",
        "'minLength' together with 'format'",
        "2020-01-01",
    ),
    (
        {"type": "string", "format": "email", "pattern": "^z"},
        "pattern",
        "'pattern' together with 'format'",
        "a@b.co",
    ),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems", "'uniqueItems'", [1, 1]),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "'multipleOf'", 1.3),
    (
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
        "'dependentRequired'",
        {"a": 1},
    ),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "if", "'if'", 9),
    (
        {"oneOf": [{"enum": [1, 2]}, {"enum": [2]}]},
        "oneOf",
        "'oneOf' whose branches may overlap",
        2,
    ),
    (
        {"type": "integer", "minimum": 0, "anyOf": [{"type": "integer"}]},
        "type",
        "'type' beside 'anyOf'",
        -1,
    ),
    (
        {"$defs": {"n": INT}, "$ref": "#/$defs/n", "maximum": 3},
        "maximum",
        "'maximum' beside '$ref'",
        9,
    ),
    ({"maximum": 1}, "maximum", "'maximum' without a 'type'", 5),
    ({"minLength": 3}, "minLength", "'minLength' without a 'type'", "a"),
    (
        {"type": "object", "properties": {"a": INT}, "required": ["b"]},
        "required",
        "'b' is required but not in 'properties'",
        {"a": 1},
    ),
    (
        {"type": "string", "pattern": "^(?!x)[a-z]+$"},
        "pattern",
        "a look-ahead",
        "xa",
    ),
    ({"type": "string", "pattern": "a^b"}, "pattern", "an anchor '^'", "ab"),
]


def _accepts(schema: dict[str, Any], value: object) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    # The grammar's separators without any_whitespace are json.dumps' own.
    return bool(_is_grammar_accept_string(grammar, json.dumps(value)))


@pytest.mark.parametrize(("schema", "path", "reason", "breaks_it"), REFUSED)
def test_what_xgrammar_drops_is_refused_naming_the_keyword(
    schema: dict[str, Any], path: str, reason: str, breaks_it: object
) -> None:
    assert _accepts(schema, breaks_it), "xgrammar enforces this now: stop refusing it"
    found = first_unenforceable(schema)
    assert found is not None and found.path == path
    assert reason in found.reason


def test_the_refusal_is_a_constraint_error_naming_the_pointer() -> None:
    schema = REFUSED[0][0]
    with pytest.raises(ConstraintError, match=r"'contains' is not enforced") as info:
        StructuredOutputParams(json=json.dumps(schema))
    assert info.value.field == "structured_outputs.json.properties.ids.contains"
    assert str(info.value).startswith("structured_outputs.json.properties.ids.contains: ")


@pytest.mark.parametrize(
    ("schema", "path"),
    [
        ({"$defs": {"a": {"type": "integer", "not": {}}}}, "$defs.a.not"),
        ({"definitions": {"a": {"type": "integer", "not": {}}}}, "definitions.a.not"),
        ({"anyOf": [INT, {"type": "array", "uniqueItems": True}]}, "anyOf[1].uniqueItems"),
        ({"type": "array", "items": {"type": "integer", "not": {}}}, "items.not"),
        (
            {"type": "array", "prefixItems": [INT, {"type": "number", "multipleOf": 2}]},
            "prefixItems[1].multipleOf",
        ),
        (
            {"type": "object", "additionalProperties": {"type": "integer", "not": {}}},
            "additionalProperties.not",
        ),
        (
            {"type": "object", "properties": {"not": {"type": "integer", "not": {}}}},
            "properties.not.not",
        ),
    ],
)
def test_nested_schemas_are_walked(schema: dict[str, Any], path: str) -> None:
    found = first_unenforceable(schema)
    assert found is not None and found.path == path


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"contains": INT, "not": STR}, "required": ["not"]},
        {"type": "array", "items": INT, "uniqueItems": False, "minItems": 1, "maxItems": 3},
        {"type": "integer", "multipleOf": 3, "minimum": 0, "exclusiveMaximum": 99},
        {"type": "string", "pattern": "^[A-Z]{3}$"},
        {"type": "string", "pattern": r"a\^b[$^]c$"},
        {"type": "string", "minLength": 1, "maxLength": 5},
        {"allOf": [{"type": "integer", "maximum": 5}]},
        {"anyOf": [INT, {"type": "null"}], "title": "n", "default": None, "description": "d"},
        {
            "$defs": {
                "A": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                "B": {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            },
            "discriminator": {"propertyName": "k"},  # as pydantic writes a tagged union
            "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
        },
        {"oneOf": [INT, STR, {"type": "null"}]},
        {"enum": ["red", "green"]},
    ],
)
def test_what_xgrammar_enforces_is_taken(schema: dict[str, Any]) -> None:
    assert first_unenforceable(schema) is None


def test_a_non_local_ref_is_refused() -> None:
    found = first_unenforceable({"$ref": "https://example.com/s.json"})
    assert found is not None and found.path == "$ref" and "only local references" in found.reason


@pytest.mark.parametrize(
    ("pattern", "dropped"),
    [
        ("^abc$", None),
        (r"^a\$b\^c$", None),
        ("[$^]x", None),
        ("^(?=.*[0-9]).+$", "a look-ahead"),
        ("a$b", "an anchor '$' inside the pattern"),
        ("^a|^b", "an anchor '^' inside the pattern"),
    ],
)
def test_regex_parts_xgrammar_drops(pattern: str, dropped: str | None) -> None:
    assert regex_dropped_part(pattern) == dropped
