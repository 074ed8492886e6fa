"""JSON-schema keywords the grammar backend cannot enforce, found before
a request is taken.

xgrammar (the one backend, ``xgrammar_backend.py``) compiles any schema,
but drops some keywords with at most a log line, so an output could break
the schema the client was promised. Such a schema is refused instead,
naming the keyword and where it sits (``properties.ids.contains``). What
is listed here was found by compiling schemas with the installed xgrammar
and matching strings that break only that keyword (the tests hold those
probes: tests/unit/engine/structured_output/test_schema_check.py).

Pure Python: ``params`` imports this, and the scheduler imports ``params``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

# Never enforced wherever they appear.
_IGNORED = {
    "contains": "'contains' is not enforced by the grammar backend",
    "minContains": "'minContains' is not enforced by the grammar backend",
    "maxContains": "'maxContains' is not enforced by the grammar backend",
    "not": "'not' is not enforced by the grammar backend",
    "if": "'if'/'then'/'else' are not enforced by the grammar backend",
    "then": "'if'/'then'/'else' are not enforced by the grammar backend",
    "else": "'if'/'then'/'else' are not enforced by the grammar backend",
    "dependentRequired": "'dependentRequired' is not enforced by the grammar backend",
    "dependentSchemas": "'dependentSchemas' is not enforced by the grammar backend",
    "dependencies": "'dependencies' is not enforced by the grammar backend",
}
# Keywords that change nothing the output may be: allowed anywhere.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
        "$id",
        "$defs",
        "definitions",
        "discriminator",  # OpenAPI's, which pydantic writes beside a tagged oneOf
    }
)
# The backend reads only the first of these it finds in a schema object;
# every other assertion beside it is dropped.
_COMPOSITIONS = ("$ref", "anyOf", "oneOf", "allOf")
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_STRING_LENGTH = ("minLength", "maxLength")
# Where subschemas sit: one schema, a list of them, or a map of names to them.
_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class Unenforceable(NamedTuple):
    """``path``: where the keyword is, dotted (``properties.ids.contains``,
    ``anyOf[1].not``; "" is the root); ``reason`` names the keyword."""

    path: str
    reason: str


def first_unenforceable(schema: object) -> Unenforceable | None:
    """The first keyword in ``schema`` (in its own order) that the backend
    would drop, or None when it enforces the whole schema."""
    return next(_walk(schema, "", schema), None)


def _walk(schema: object, path: str, root: object) -> Iterator[Unenforceable]:
    if not isinstance(schema, dict):
        return  # true / false (or a malformed value, which the backend refuses)
    for keyword in schema:
        reason = _check(schema, keyword, root)
        if reason is not None:
            yield Unenforceable(_join(path, keyword), reason)
        yield from _walk_children(schema, keyword, _join(path, keyword), root)


def _walk_children(
    schema: Mapping[str, Any], keyword: str, path: str, root: object
) -> Iterator[Unenforceable]:
    value = schema[keyword]
    if keyword in _ONE:
        yield from _walk(value, path, root)
    elif keyword in _LIST and isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _walk(sub, f"{path}[{i}]", root)
    elif keyword in _MAP and isinstance(value, dict):
        for name, sub in value.items():
            yield from _walk(sub, _join(path, name), root)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _check(schema: Mapping[str, Any], keyword: str, root: object) -> str | None:
    """Why the backend would drop ``keyword`` here; None if it enforces it."""
    value = schema[keyword]
    if keyword in _IGNORED:
        return _IGNORED[keyword]
    if keyword == "uniqueItems":
        return "'uniqueItems' is not enforced by the grammar backend" if value else None
    if (composed := _composition_of(schema)) is not None and keyword != composed:
        if keyword not in _ANNOTATIONS:
            where = "the referenced schema" if composed == "$ref" else "each branch"
            return (
                f"'{keyword}' beside '{composed}' is not enforced by the grammar backend "
                f"(it reads only one of them); move it into {where}"
            )
        return None
    return _check_one(schema, keyword, value, root)


def _check_one(schema: Mapping[str, Any], keyword: str, value: Any, root: object) -> str | None:
    match keyword:
        case "allOf" if isinstance(value, list) and len(value) > 1:
            return (
                "'allOf' with more than one schema is not enforced by the grammar "
                "backend; merge them into one"
            )
        case "oneOf" if isinstance(value, list) and not _pairwise_disjoint(value, root):
            return (
                "'oneOf' whose branches may overlap is enforced only as 'anyOf' by the "
                "grammar backend; use 'anyOf', or make the branches disjoint (different "
                "types, or a required property with a different 'const' in each)"
            )
        case "$ref" if isinstance(value, str) and value != "#" and not value.startswith("#/"):
            return f"'$ref' {value!r} is not enforced: only local references ('#/...') are"
        case "minLength" | "maxLength":
            return _length_beside(schema, keyword)
        case "pattern":
            return _pattern_problem(schema, value)
        case "multipleOf":
            return _multiple_of_problem(schema, value)
        case "required" if isinstance(value, list):
            return _undeclared_required(schema, value)
    if keyword in _NUMERIC and _untyped(schema):
        return (
            f"'{keyword}' without a 'type' is not enforced by the grammar backend; "
            'add "type": "number" or "integer"'
        )
    return None


def _composition_of(schema: Mapping[str, Any]) -> str | None:
    return next((k for k in schema if k in _COMPOSITIONS), None)


def _untyped(schema: Mapping[str, Any]) -> bool:
    return "type" not in schema and "enum" not in schema and "const" not in schema


def _length_beside(schema: Mapping[str, Any], keyword: str) -> str | None:
    for other in ("pattern", "format"):
        if other in schema:
            return (
                f"'{keyword}' together with '{other}' is not enforced by the grammar "
                f"backend; state the length in a 'pattern' alone"
            )
    if _untyped(schema):
        return _untyped_string(keyword)
    return None


def _untyped_string(keyword: str) -> str:
    return (
        f"'{keyword}' without a 'type' is not enforced by the grammar backend; "
        'add "type": "string"'
    )


def _pattern_problem(schema: Mapping[str, Any], pattern: object) -> str | None:
    if "format" in schema:
        return (
            "'pattern' together with 'format' is not enforced by the grammar backend "
            "(only 'format' is)"
        )
    if _untyped(schema):
        return _untyped_string("pattern")
    if isinstance(pattern, str) and (dropped := regex_dropped_part(pattern)) is not None:
        return f"'pattern' uses {dropped}, which the grammar backend ignores"
    return None


def _multiple_of_problem(schema: Mapping[str, Any], value: object) -> str | None:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if schema.get("type") == "integer" and integral and not isinstance(value, bool):
        return None
    return (
        "'multipleOf' is enforced by the grammar backend only as a whole number "
        'on "type": "integer"'
    )


def _undeclared_required(schema: Mapping[str, Any], required: list[Any]) -> str | None:
    if "patternProperties" in schema:
        return None  # a pattern may declare it
    declared = schema.get("properties")
    names = declared if isinstance(declared, dict) else {}
    missing = [n for n in required if isinstance(n, str) and n not in names]
    if missing:
        return (
            f"{missing[0]!r} is required but not in 'properties': the grammar backend "
            "does not enforce that; declare it there"
        )
    return None


def regex_dropped_part(pattern: str) -> str | None:
    """What of ``pattern`` the backend would silently drop: a look-ahead,
    or an anchor (^, $) that is not at the pattern's very start or end."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2  # an escaped character is a literal
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return "a look-ahead"
        elif (c == "^" and i != 0) or (c == "$" and i != len(pattern) - 1):
            return f"an anchor '{c}' inside the pattern"
        i += 1
    return None


# --- oneOf: the backend enforces "exactly one" only for branches it can tell apart


def _pairwise_disjoint(branches: list[Any], root: object) -> bool:
    resolved = [_resolve(b, root) for b in branches]
    return all(_disjoint(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1 :])


def _resolve(schema: object, root: object, depth: int = 0) -> object:
    """A local ``$ref`` followed (a few hops: a loop stays unresolved)."""
    if not isinstance(schema, dict) or depth > 8:
        return schema
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    node: object = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return schema
        node = node[part]
    return _resolve(node, root, depth + 1)


def _disjoint(a: object, b: object) -> bool:
    """True when no JSON value can match both (by a simple sufficient test:
    types apart, fixed values apart, or a required property fixed apart)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    return _values_apart(a, b) or _discriminated(a, b)


def _types(schema: Mapping[str, Any]) -> set[str] | None:
    """The JSON types a schema admits (integer counts as number), or None
    when it does not say."""
    declared = schema.get("type")
    if isinstance(declared, str):
        names = {declared}
    elif isinstance(declared, list):
        names = {t for t in declared if isinstance(t, str)}
    elif (values := _fixed_values(schema)) is not None:
        names = {_json_type(v) for v in values}
    else:
        return None
    return {"number" if t == "integer" else t for t in names}


def _json_type(value: object) -> str:
    match value:
        case bool():
            return "boolean"
        case int() | float():
            return "number"
        case str():
            return "string"
        case None:
            return "null"
        case list():
            return "array"
    return "object"


def _fixed_values(schema: Mapping[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) else None


def _discriminated(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Both require a property whose fixed values differ (a tagged union)."""
    required = set(_names(a.get("required"))) & set(_names(b.get("required")))
    for name in required:
        prop_a, prop_b = _property(a, name), _property(b, name)
        if prop_a is not None and prop_b is not None and _values_apart(prop_a, prop_b):
            return True
    return False


def _values_apart(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    values_a, values_b = _fixed_values(a), _fixed_values(b)
    if values_a is None or values_b is None:
        return False
    return not any(v in values_b for v in values_a)


def _names(value: object) -> list[str]:
    return [n for n in value if isinstance(n, str)] if isinstance(value, list) else []


def _property(schema: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    properties = schema.get("properties")
    prop = properties.get(name) if isinstance(properties, dict) else None
    return prop if isinstance(prop, dict) else None
