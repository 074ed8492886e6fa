"""The structured-output `constraint` oneof, read from either port.

tandem.v1's ``GenerateRequest`` and vLLM's ``SamplingParams`` spell it the
same way (json_schema, json_object, regex, choice with ``choices``,
grammar); only where it sits differs, which ``prefix`` names in errors.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.structured_output.params import ConstraintError, StructuredOutputParams

# Wire field -> StructuredOutputParams field.
_ENGINE_FIELDS = {
    "json_schema": "json",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def read_constraint(msg: Any, prefix: str = "") -> StructuredOutputParams | None:
    """The message's constraint, checked; errors name the wire field
    (``prefix`` + ``choice[1]``). A message outside the oneof's kinds here
    (vLLM's structural_tag) must be refused by the caller first."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object" and not msg.json_object:
        raise InvalidRequestError(prefix + "json_object", "must be true when set")
    field = _ENGINE_FIELDS[kind]
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    values: dict[str, Any] = {field: value}
    try:
        return StructuredOutputParams(**values)
    except ConstraintError as exc:
        # The engine names its own field (structured_outputs.json[...]).
        where = kind + exc.field.removeprefix(f"structured_outputs.{field}")
        raise InvalidRequestError(prefix + where, str(exc).split(": ", 1)[-1]) from exc
