"""JSON schemas that structured output is tested with: every keyword kind
xgrammar enforces that the default model can fill in a few dozen tokens
(bounded strings, integers and numbers, an enum, a bounded array, a nested
object).
Shared by tests/e2e/test_structured_output.py and benchmarks/gpu_check.py
(a plain module: the GPU machine has no pytest)."""

from __future__ import annotations

SCHEMAS: dict[str, dict[str, object]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "email": {"type": "string", "maxLength": 30},
                },
                "required": ["id", "email"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "discount": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["price", "discount"],
        "additionalProperties": False,
    },
}
