"""The sampling fields, one row each: how every ``SamplingParams`` field
travels on each wire and on the command line.

Both converters (``service.convert`` for tandem.v1, ``service.vllm_convert``
for the vLLM engine protocol that smg speaks) read requests through
``read_sampling``, and ``tandem generate`` makes its flags with
``add_flags``: none of them names a sampling field. A field's type and
default are ``SamplingParams``'s own (read from the dataclass, never
written here), and its checks are ``SamplingParams``'s. docs/serving.md's
field table is ``markdown_table()`` (a test compares them; ``python -m
service.sampling_fields`` rewrites it, ``--check`` says if it is stale).

Adding a sampling parameter: the field (and its check) in
``engine/sampling_params.py``, the code that honours it (the sampler, the
detokenizer, ...), its field in ``protos/tandem/v1/generation.proto``, and a
row here. The tests that walk this table then ask for an example value.

Reading a wire: a field with presence (proto3 ``optional``) is taken when
set, even when zero; a field without presence is taken when not zero (0,
false, "", an empty list or map mean unset, as vLLM's servicer reads its
fields), so an unset field always leaves ``SamplingParams``'s default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured_output.params import StructuredOutputParams
from service.constraints import read_constraint

Protocol = Literal["tandem", "vllm"]
PROTOCOLS: tuple[Protocol, ...] = ("tandem", "vllm")

_UNSET: Any = object()


@dataclass(frozen=True)
class Wire:
    """How one protocol carries a field.

    ``name``: the proto field in that protocol's ``SamplingParams``
    message (in its ``GenerateRequest`` when ``on_request``; a oneof's name
    for a constraint). ``optional``: the field has presence (see the module
    docstring). ``decode``: wire value -> engine value, for a field whose
    spelling differs (default: the value; lists and maps copied).
    ``read``: a named converter that reads the message itself, for a field
    no single proto field holds; it returns None for unset and raises
    InvalidRequestError naming ``prefix`` + its field. ``note``: what the
    docs say of this spelling."""

    name: str
    optional: bool = False
    on_request: bool = False
    decode: Callable[[Any], Any] | None = None
    read: Callable[[Any, str], Any] | None = None
    note: str = ""

    def value(self, msg: Any, prefix: str) -> Any:
        """The engine's value for this field in ``msg``, or ``_UNSET``."""
        if self.read is not None:
            got = self.read(msg, "" if self.on_request else prefix)
            return _UNSET if got is None else got
        if self.optional:
            if not msg.HasField(self.name):
                return _UNSET
            raw = getattr(msg, self.name)
        else:
            raw = getattr(msg, self.name)
            if not raw:
                return _UNSET
        if self.decode is not None:
            return self.decode(raw)
        if isinstance(raw, int | float | str | bytes):
            return raw
        return dict(raw) if isinstance(raw, Mapping) else list(raw)


@dataclass(frozen=True)
class Flag:
    """``tandem generate --<name with dashes>``; unset, the request leaves
    the field unset (the server's default applies) unless ``default`` (the
    command's own choice) is given."""

    help: str
    default: Any = None


@dataclass(frozen=True)
class SamplingField:
    """One ``SamplingParams`` field: ``doc`` says what it does, ``tandem``
    and ``vllm`` how each protocol carries it (None: it does not),
    ``flag`` whether ``tandem generate`` has a flag for it (``cli``: the
    flags that set it where the command makes them itself)."""

    name: str
    doc: str
    tandem: Wire | None
    vllm: Wire | None
    flag: Flag | None = None
    cli: str = ""

    @property
    def default(self) -> Any:
        """``SamplingParams``'s default for it."""
        return _defaults()[self.name]

    @property
    def type(self) -> Any:
        """``SamplingParams``'s annotation of it, resolved."""
        return typing.get_type_hints(SamplingParams)[self.name]

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    def wire(self, protocol: Protocol) -> Wire | None:
        return self.tandem if protocol == "tandem" else self.vllm


@cache
def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        if f.init:
            factory = f.default_factory
            out[f.name] = f.default if factory is dataclasses.MISSING else factory()
    return out


# --- the named converters --------------------------------------------------------


def signed32(value: int) -> int:
    """tandem.v1's uint32 ``top_k`` read as the int32 a client may have
    meant: -1 (vLLM's "top_k off") sent from an int32 arrives as
    4294967295, and is taken as -1 (off); other negatives are then refused
    instead of acting as "off"."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _vllm_logprobs(value: int) -> int:
    if value < 0:
        raise SamplingParamsError(
            "logprobs", "-1 (the whole vocabulary) is not supported; use 0-20"
        )
    return value


def _vllm_constraint(msg: Any, prefix: str) -> StructuredOutputParams | None:
    """vLLM's constraint oneof: structural tags are refused; json_object
    false is unset, as vLLM's servicer reads it (tandem.v1 refuses it)."""
    kind = msg.WhichOneof("constraint")
    if kind == "structural_tag":
        raise InvalidRequestError(
            prefix + "structural_tag",
            "structural tags are not supported; use json_schema, regex, choice or grammar",
        )
    if kind == "json_object" and not msg.json_object:
        return None
    return read_constraint(msg, prefix)


# --- the table -------------------------------------------------------------------

_CONSTRAINT_KINDS = "json_schema, json_object, regex, choice, grammar"

FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "max_tokens",
        "most tokens to generate (at least 1)",
        Wire("max_tokens", optional=True),
        Wire("max_tokens", optional=True),
        Flag("most tokens to generate", default=128),
    ),
    SamplingField(
        "min_tokens",
        "EOS, stop tokens and stop strings are ignored until this many tokens exist",
        Wire("min_tokens"),
        Wire("min_tokens"),
        Flag("no stop before this many tokens"),
    ),
    SamplingField(
        "temperature",
        "0 is greedy; at most 100",
        Wire("temperature", optional=True),
        Wire("temperature", optional=True),
        Flag("0 is greedy", default=0.0),
    ),
    SamplingField(
        "top_p",
        "nucleus sampling mass in (0, 1]; 1 is off",
        Wire("top_p", optional=True),
        Wire("top_p"),
        Flag("nucleus sampling mass in (0, 1]; 1 is off"),
    ),
    SamplingField(
        "top_k",
        "sample among the k most likely tokens; 0 and -1 are off",
        Wire("top_k", decode=signed32, note="uint32; 2^31 and up are read as int32: -1 is off"),
        Wire("top_k"),
        Flag("sample among the k most likely; 0 is off"),
    ),
    SamplingField(
        "seed",
        "makes sampling reproducible (choice i of n is seeded seed + i)",
        Wire("seed", optional=True),
        Wire("seed", optional=True),
        Flag("seed for reproducible sampling"),
    ),
    SamplingField(
        "stop",
        "generation stops when the text contains one of these",
        Wire("stop"),
        Wire("stop"),
        Flag("stop string (repeatable)"),
    ),
    SamplingField(
        "stop_token_ids",
        "generation stops after one of these tokens (it is included)",
        Wire("stop_token_ids"),
        Wire("stop_token_ids"),
    ),
    SamplingField(
        "ignore_eos",
        "keep generating past the end-of-sequence token",
        Wire("ignore_eos"),
        Wire("ignore_eos"),
        Flag("keep generating past the end-of-sequence token"),
    ),
    SamplingField(
        "include_stop_str_in_output",
        "a matched stop string stays at the end of the text (vLLM's field)",
        Wire("include_stop_str_in_output"),
        Wire("include_stop_str_in_output", note="smg's OpenAI endpoint: `no_stop_trim`"),
        Flag("keep the matched stop string at the end of the text"),
    ),
    SamplingField(
        "logprobs",
        "logprobs of each sampled token and of this many top alternatives (0-20)",
        Wire("logprobs", optional=True),
        Wire("logprobs", optional=True, decode=_vllm_logprobs, note="-1 (all) refused"),
    ),
    SamplingField(
        "prompt_logprobs",
        "logprob of each prompt token and this many top alternatives (0-20)",
        Wire("prompt_logprobs", optional=True),
        Wire("prompt_logprobs", optional=True, note="sent as input_logprobs"),
    ),
    SamplingField(
        "presence_penalty",
        "subtracted once per token present in the output; in [-2, 2]",
        Wire("presence_penalty"),
        Wire("presence_penalty"),
        Flag("subtracted once from tokens already in the output, in [-2, 2]"),
    ),
    SamplingField(
        "frequency_penalty",
        "subtracted per occurrence in the output; in [-2, 2]",
        Wire("frequency_penalty"),
        Wire("frequency_penalty"),
        Flag("subtracted per occurrence in the output, in [-2, 2]"),
    ),
    SamplingField(
        "repetition_penalty",
        "divides positive (multiplies negative) logits of prompt and output tokens; 1 is off",
        Wire("repetition_penalty", optional=True),
        Wire("repetition_penalty"),
        Flag("> 1 discourages tokens of the prompt and output, e.g. 1.2; 1 is off"),
    ),
    SamplingField(
        "min_p",
        "drops tokens below min_p times the top probability; in [0, 1]",
        Wire("min_p"),
        Wire("min_p"),
        Flag("drop tokens below this fraction of the top probability; 0 is off"),
    ),
    SamplingField(
        "logit_bias",
        "token id -> bias in [-100, 100] added to its logit",
        Wire("logit_bias"),
        Wire("logit_bias"),
    ),
    SamplingField(
        "structured_outputs",
        "the output matches a JSON schema, any JSON object, a regex, a choice or a grammar",
        Wire(
            "constraint",
            on_request=True,
            read=read_constraint,
            note=f"oneof on GenerateRequest: {_CONSTRAINT_KINDS}",
        ),
        Wire("constraint", read=_vllm_constraint, note=f"oneof: {_CONSTRAINT_KINDS}"),
        cli="`--json-schema`, `--json-object`, `--regex`, `--choice`, `--grammar`",
    ),
)

BY_NAME: dict[str, SamplingField] = {f.name: f for f in FIELDS}

# The fields of each protocol's SamplingParams message that are no
# SamplingParams field, and what becomes of them.
OTHER_WIRE_FIELDS: dict[Protocol, dict[str, str]] = {
    "tandem": {"n": "choices per call (service/choices.py)"},
    "vllm": {
        "n": "choices per call (service/choices.py)",
        "structural_tag": "refused (INVALID_ARGUMENT)",
        "truncate_prompt_tokens": "refused (INVALID_ARGUMENT)",
        "skip_special_tokens": "ignored, since the gateway detokenizes",
        "spaces_between_special_tokens": "ignored, since the gateway detokenizes",
        "grammar_from_first_token": "ignored, since a grammar always starts at the first token",
    },
}


# --- reading a request -----------------------------------------------------------


def read_sampling(
    protocol: Protocol, msg: Any, *, prefix: str, request: Any = None
) -> SamplingParams:
    """``msg`` (the protocol's SamplingParams message; ``request``, its
    GenerateRequest, for the fields that sit there) as SamplingParams.
    Raises InvalidRequestError naming the proto field (``prefix`` + its
    name)."""
    values: dict[str, Any] = {}
    try:
        for field in FIELDS:
            wire = field.wire(protocol)
            source = request if wire is not None and wire.on_request else msg
            if wire is None or source is None:
                continue
            value = wire.value(source, prefix)
            if value is not _UNSET:
                values[field.name] = value
        return SamplingParams(**values)
    except SamplingParamsError as exc:
        wire = BY_NAME[exc.field].wire(protocol) if exc.field in BY_NAME else None
        name = wire.name if wire is not None else exc.field
        raise InvalidRequestError(prefix + name, str(exc).split(": ", 1)[-1]) from exc


# --- tandem generate -------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag per field the table gives one."""
    for field in FIELDS:
        if field.flag is not None:
            parser.add_argument(field.flag_name, **_argparse_kwargs(field, field.flag))


def _argparse_kwargs(field: SamplingField, flag: Flag) -> dict[str, Any]:
    shown = flag.default if flag.default is not None else field.default
    kwargs: dict[str, Any] = {"default": flag.default, "help": f"{flag.help} (default: {shown})"}
    kind = field.type
    if kind is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(kind) is list:
        kwargs.update(action="append", type=typing.get_args(kind)[0])
    else:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kwargs["type"] = args[0] if args else kind
    return kwargs


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags' values by tandem.v1 field name (None: unset)."""
    return {
        field.tandem.name: getattr(args, field.name)
        for field in FIELDS
        if field.flag is not None and field.tandem is not None
    }


# --- docs ------------------------------------------------------------------------

SERVING_DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
DOC_BEGIN = "<!-- sampling-fields: generated by python -m service.sampling_fields -->"
DOC_END = "<!-- sampling-fields: end -->"


def markdown_table() -> str:
    """The table docs/serving.md shows."""
    rows = [
        "| `SamplingParams` | default | tandem.v1 | vLLM protocol (smg) | `tandem generate` "
        "| what it does |",
        "|---|---|---|---|---|---|",
    ]
    for f in FIELDS:
        flag = f.cli if f.flag is None else f"`{f.flag_name}`"
        rows.append(
            f"| `{f.name}` | `{f.default!r}` | {_wire_cell(f, f.tandem)} "
            f"| {_wire_cell(f, f.vllm)} | {flag} | {f.doc} |"
        )
    labels: dict[Protocol, str] = {"tandem": "tandem.v1's", "vllm": "the vLLM protocol's"}
    for protocol, label in labels.items():
        others = "; ".join(f"`{k}`: {v}" for k, v in OTHER_WIRE_FIELDS[protocol].items())
        rows.append(f"\nAlso in {label} `SamplingParams`: {others}.")
    return "\n".join(rows)


def _wire_cell(field: SamplingField, wire: Wire | None) -> str:
    if wire is None:
        return "—"
    notes = [wire.note] if wire.note else []
    if wire.optional:
        notes.insert(0, "optional")
    elif wire.read is None and field.default:
        notes.insert(0, "0: unset")
    cell = f"`{wire.name}`"
    return f"{cell} ({'; '.join(notes)})" if notes else cell


def rewritten(text: str) -> str:
    """``text`` with the lines between its markers replaced by the table."""
    head, sep, rest = text.partition(DOC_BEGIN + "\n")
    if not sep or DOC_END not in rest:
        raise ValueError(f"no {DOC_BEGIN} ... {DOC_END} block")
    return f"{head}{sep}{markdown_table()}\n{DOC_END}{rest.split(DOC_END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite docs/serving.md's sampling table.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    text = SERVING_DOC.read_text()
    if args.check:
        stale = rewritten(text) != text
        if stale:
            print(f"{SERVING_DOC}: stale; run python -m service.sampling_fields")
        return int(stale)
    SERVING_DOC.write_text(rewritten(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
