"""StructuredOutputParams: which constraint a request's output must obey."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output.schema_check import first_unenforceable


class ConstraintError(ValueError):
    """A constraint is malformed. ``field`` names it (``structured_outputs.regex``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class ConstraintKind(enum.StrEnum):
    """The kinds, named as vLLM's ``structured_outputs`` fields."""

    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # EBNF in the GBNF dialect (llama.cpp's, as xgrammar reads it)


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one of the fields is set; validated on construction.

    ``json``: a JSON schema, as a dict or its JSON text. ``json_object``:
    any JSON object. ``regex``: the whole output matches it (xgrammar's
    dialect: ECMAScript-like, no look-around or back-references).
    ``choice``: the output is one of these strings. ``grammar``: an EBNF
    grammar whose start rule is ``root``, in the GBNF dialect of llama.cpp
    (``root ::= "yes" | "no"``). Whether a regex or grammar compiles is known
    only once the backend compiles it; that error names the field too.
    """

    json: str | dict[str, Any] | None = field(default=None, compare=False)
    json_object: bool = field(default=False, compare=False)
    regex: str | None = field(default=None, compare=False)
    choice: list[str] | None = field(default=None, compare=False)
    grammar: str | None = field(default=None, compare=False)
    # (kind, canonical text): equal keys compile to the same grammar, and
    # are equal constraints (a schema as text or as a dict). A schema's keys
    # keep the client's order: objects are generated in that order, so two
    # schemas that differ only in it are different constraints.
    key: tuple[ConstraintKind, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        given = [
            kind
            for kind, value in (
                (ConstraintKind.JSON, self.json),
                (ConstraintKind.JSON_OBJECT, self.json_object or None),
                (ConstraintKind.REGEX, self.regex),
                (ConstraintKind.CHOICE, self.choice),
                (ConstraintKind.GRAMMAR, self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            names = ", ".join(k.value for k in given) or "none"
            raise ConstraintError(
                "structured_outputs", f"exactly one constraint must be given, got {names}"
            )
        object.__setattr__(self, "key", (given[0], self._canonical(given[0])))

    @property
    def kind(self) -> ConstraintKind:
        return self.key[0]

    @property
    def spec(self) -> str:
        """The constraint as text: a schema's compact JSON (keys in the
        client's order), a regex, a grammar, the choices' JSON list; "" for
        any JSON object."""
        return self.key[1]

    def _canonical(self, kind: ConstraintKind) -> str:
        where = f"structured_outputs.{kind.value}"
        match kind:
            case ConstraintKind.JSON:
                return _canonical_schema(self.json, where)
            case ConstraintKind.JSON_OBJECT:
                return ""
            case ConstraintKind.REGEX | ConstraintKind.GRAMMAR:
                text = self.regex if kind is ConstraintKind.REGEX else self.grammar
                if not isinstance(text, str) or not text.strip():
                    raise ConstraintError(where, "must be a non-empty string")
                return text
            case ConstraintKind.CHOICE:
                choices = self.choice
                if not isinstance(choices, list) or not choices:
                    raise ConstraintError(where, "must be a non-empty list of strings")
                for i, c in enumerate(choices):
                    if not isinstance(c, str) or c == "":
                        raise ConstraintError(
                            f"{where}[{i}]", f"must be a non-empty string, got {c!r}"
                        )
                return json.dumps(choices, ensure_ascii=False)


def _canonical_schema(schema: object, where: str) -> str:
    """Compact JSON, never re-sorted: the backend generates an object's
    properties in the order the schema lists them (as OpenAI documents)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConstraintError(where, f"is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise ConstraintError(
            where, f"a JSON schema must be an object, got {type(schema).__name__}"
        )
    if (found := first_unenforceable(schema)) is not None:
        # Refused rather than compiled without it: the output could break it.
        raise ConstraintError(f"{where}.{found.path}" if found.path else where, found.reason)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
