"""Typed connector options: what a connector takes in ``kv_connector_extra_config``.

A connector declares its options as a frozen dataclass deriving from
``ConnectorOptions``, one field per key, each with its type, default and a
one-line doc (``option``)::

    @dataclass(frozen=True)
    class RedisOptions(StoreOptions):
        url: str = option("redis://127.0.0.1:6379/0", "where Redis is")

and names it as its ``options_class`` (``engine.kv_transfer.base``). Each
connector's options class lives with the connector (``connectors/``); this
module is the base they share. ``parse`` builds it from the dict, refusing
what a typo would otherwise make silently ineffective: an unknown key
(named with the connector, the keys it takes, and the closest of them), or
a value of the wrong type. An int is taken for
a float (JSON writes ``2.0`` as ``2``); a bool is not taken for an int
(``true`` is no port number). Containers are checked only as such: the
connector checks their items.

A connector that declares no options class (a third-party one) reads the
raw dict, as before.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Self, TypeVar, Union, get_args, get_origin, get_type_hints

from engine.config import ConfigError, KVTransferConfig

T = TypeVar("T")

# What an error message calls a value of each accepted type.
_TYPE_NAMES: dict[object, str] = {
    bool: "a bool",
    int: "an int",
    float: "a number",
    str: "a string",
    type(None): "null",
    list: "a list",
    dict: "an object",
}


def option(default: T, doc: str) -> T:
    """A field of an options class: its default and what it does (the doc
    is kept in the field's metadata, so it is checked to be there)."""
    return field(default=default, metadata={"doc": doc})


class _Mismatch(Exception):
    """A value is not of the type asked for (internal to ``_coerce``)."""


@dataclass(frozen=True)
class ConnectorOptions:
    """Base of every connector's options (no keys of its own)."""

    @classmethod
    def of(cls, config: KVTransferConfig) -> Self:
        """The options of ``config``'s connector, from its extra config."""
        return cls.parse(config.kv_connector_extra_config, config.kv_connector)

    @classmethod
    def parse(
        cls, extra: Mapping[str, Any], connector: str, where: str = "kv_connector_extra_config"
    ) -> Self:
        """``extra`` as these options; a ConfigError names ``where`` (the
        dict's place in the config) and the ``connector`` it is for."""
        hints = get_type_hints(cls)
        known = {f.name: f for f in fields(cls)}
        context = f"{where} of the {connector!r} connector"
        refuse_unknown_keys(context, extra, sorted(known))
        missing = [
            name
            for name, f in known.items()
            if name not in extra and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise ConfigError(f"{context} lacks {', '.join(map(repr, missing))}")
        values = {key: _checked(context, key, value, hints[key]) for key, value in extra.items()}
        return cls(**values)


def refuse_unknown_keys(context: str, given: Iterable[str], known: Sequence[str]) -> None:
    """ConfigError naming each key of ``given`` not in ``known`` (with the
    closest known one, if any is close), ``context`` and what it takes."""
    unknown = [key for key in given if key not in known]
    if not unknown:
        return
    named = [f"{key!r}{_suggestion(str(key), known)}" for key in unknown]
    noun = "key" if len(unknown) == 1 else "keys"
    takes = ", ".join(known) if known else "no keys"
    raise ConfigError(f"{context} has unknown {noun} {', '.join(named)}: it takes {takes}")


def _suggestion(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _checked(context: str, key: str, value: object, hint: object) -> object:
    try:
        return _coerce(value, hint)
    except _Mismatch:
        raise ConfigError(
            f"{context}: {key}={value!r} is invalid: expected {_expected(hint)}"
        ) from None


def _coerce(value: object, hint: object) -> object:
    """``value`` as ``hint`` wants it (an int made a float), or _Mismatch."""
    if hint is Any:
        return value
    if get_origin(hint) in (Union, types.UnionType):
        for arm in get_args(hint):
            try:
                return _coerce(value, arm)
            except _Mismatch:
                continue
        raise _Mismatch
    if hint is float:
        # bool is an int subclass: refused here as for int.
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    plain = get_origin(hint) or hint
    if plain in _TYPE_NAMES and isinstance(plain, type):
        if isinstance(value, plain):
            return value
        raise _Mismatch
    # A programming error in an options class, not a bad config.
    raise TypeError(f"options cannot be of type {hint!r}")


def _expected(hint: object) -> str:
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_expected(arm) for arm in get_args(hint))
    return _TYPE_NAMES.get(get_origin(hint) or hint, repr(hint))


@dataclass(frozen=True)
class SideChannelOptions(ConnectorOptions):
    """The keys ``KVConnectorBase.with_side_channel`` adds for a connector
    that ``needs_side_channel`` (unless the user gave them): every such
    connector's options derive from this, so what the server tells it is
    never refused."""

    side_channel_host: str = option(
        "127.0.0.1", "where peers reach this pod's gRPC server (filled in by tandem serve)"
    )
    side_channel_port: int = option(50051, "that server's port (filled in by tandem serve)")
