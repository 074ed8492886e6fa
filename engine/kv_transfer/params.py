"""KVTransferParams: what a prefill leg hands a decode leg, typed.

The router asks a prefill pod to keep a request's KV
(``do_remote_decode``); the prefill pod's connector answers where the KV is;
the router passes that to the decode leg, whose connector reads it. Inside
every process these params are a ``KVTransferParams`` (``Request``,
``EngineCoreOutput``, the connector API); only on the wire
(``GenerateRequest``/``GenerateResponse.kv_transfer_params``, a protobuf
Struct) are they a JSON-like dict, as in vLLM: ``from_dict`` on the way in
(service/convert.py), ``to_dict`` on the way out. ``from_dict`` refuses a
wrong type (``"do_remote_decode": "yes"``, which a truthiness test would
take for true) or an unknown key naming the key, before any connector reads
it. The keys are the ones Tandem's router and connectors exchange:

    do_remote_decode    prefill leg: keep the KV for a decode pod
    do_remote_prefill   decode leg: the KV comes from a prefill pod
    kv_connector        the connector that produced these params
    remote_engine_id    the producer's engine id
    num_blocks          leading prompt blocks the producer saved (store connectors)
    remote_agent, remote_address, remote_request_id, remote_block_ids,
    remote_num_tokens, remote_compat
                        where a pull connector (NIXL) reads the KV from
    remote_hold         the nonce of the producer's hold on those blocks:
                        a consumer presents it to claim them
                        (connectors/nixl_holds.py)

Struct numbers are doubles: an integral value such as ``3.0`` is accepted
for an int field (and returned as ``3``); ``3.5`` is not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class KVTransferParamsError(ValueError):
    """A kv_transfer_params entry is wrong; ``key`` names it, ``reason``
    says what was expected."""

    def __init__(self, key: str, reason: str) -> None:
        key = _short(key)
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class KVTransferParams:
    """Every field is optional (None: absent from the dict)."""

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    kv_connector: str | None = None
    remote_engine_id: str | None = None
    num_blocks: int | None = None
    remote_agent: str | None = None
    remote_address: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_num_tokens: int | None = None
    remote_compat: str | None = None
    remote_hold: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferParams:
        """Raises KVTransferParamsError naming the first unknown key or the
        first value of the wrong type."""
        checked: dict[str, Any] = {}
        for key, value in values.items():
            kind = _KINDS.get(key)
            if kind is None:
                raise KVTransferParamsError(
                    key, f"unknown key; expected one of {', '.join(sorted(_KINDS))}"
                )
            checked[key] = _CHECKS[kind](key, value)
        return cls(**checked)

    def to_dict(self) -> dict[str, Any]:
        """The set fields, for the wire (lists, not tuples): what
        ``from_dict`` reads back as these params."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise KVTransferParamsError(key, f"expected a bool, got {_short(repr(value))}")
    return value


def _str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise KVTransferParamsError(key, f"expected a string, got {_short(repr(value))}")
    return value


def _count(key: str, value: object) -> int:
    """An int >= 0; a JSON number (a float) must be integral."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KVTransferParamsError(key, f"expected an integer >= 0, got {_short(repr(value))}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise KVTransferParamsError(key, f"expected an integer >= 0, got {_short(repr(value))}")
    if value < 0:
        raise KVTransferParamsError(key, f"expected an integer >= 0, got {_short(repr(value))}")
    return int(value)


def _counts(key: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KVTransferParamsError(
            key, f"expected a list of integers >= 0, got {_short(repr(value))}"
        )
    return tuple(_count(f"{key}[{i}]", v) for i, v in enumerate(value))


def _short(text: str, limit: int = 60) -> str:
    """Caller-supplied text cut for an error message (which travels in a
    gRPC trailer: a megabyte of it would not)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_CHECKS: dict[str, Callable[[str, object], object]] = {
    "bool": _bool,
    "str": _str,
    "int": _count,
    "ints": _counts,
}

# The type of each field, from its annotation (the two must not drift).
_KINDS: dict[str, str] = {
    f.name: {
        "bool | None": "bool",
        "str | None": "str",
        "int | None": "int",
        "tuple[int, ...] | None": "ints",
    }[str(f.type)]
    for f in dataclasses.fields(KVTransferParams)
}
