"""Connectors by name: the built-in ones, plus any a package registers in the
entry point group ``tandem.kv_connectors``::

    [project.entry-points."tandem.kv_connectors"]
    my-store = "my_package.connector:MyConnector"

A connector class is built as ``cls(role, context)`` (see
``connectors.base.ConnectorContext``). Built-ins are imported only when
asked for, so a Redis client is not a dependency of an engine without one.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from connectors.base import ConnectorContext, KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from engine.config import KVTransferConfig

ENTRY_POINT_GROUP = "tandem.kv_connectors"

_BUILTIN = {
    "redis": "connectors.redis_connector:RedisConnector",
    "shm": "connectors.shm_connector:SharedMemoryConnector",
    "multi": "connectors.multi:MultiConnector",
    "nixl": "connectors.nixl_connector:NixlConnector",
}
_registered: dict[str, type[KVConnectorBase]] = {}


class UnknownConnectorError(ValueError):
    """No connector of that name; the message lists the known ones."""


def register_connector(name: str, cls: type[KVConnectorBase]) -> None:
    """Make ``cls`` available as ``name`` in this process."""
    _registered[name] = cls


def known_connectors() -> list[str]:
    names = set(_BUILTIN) | set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def connector_class(name: str) -> type[KVConnectorBase]:
    if name in _registered:
        return _registered[name]
    target: object
    if name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        target = getattr(importlib.import_module(module), attr)
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise UnknownConnectorError(
                f"kv_connector={name!r} is unknown: known connectors are {known_connectors()}"
            )
        target = found[0].load()
    if not (isinstance(target, type) and issubclass(target, KVConnectorBase)):
        raise UnknownConnectorError(
            f"kv_connector={name!r} names {target!r}, which is not a KVConnectorBase subclass"
        )
    return target


def check_connector_config(config: KVTransferConfig) -> None:
    """Raise (UnknownConnectorError, ConfigError) if ``config`` names no
    connector or gives it options it does not take: the engine calls this
    before it loads the model, so a typo stops the start at once."""
    connector_class(config.kv_connector).check_config(config)


def create_connector(role: KVConnectorRole, context: ConnectorContext) -> KVConnectorBase:
    return connector_class(context.config.kv_connector)(role, context)
