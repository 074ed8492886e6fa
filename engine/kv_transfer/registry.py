"""Connectors by name: how the engine creates a connector without importing
any implementation (the implementations live in ``connectors/``, above the
engine, and import the engine's API).

Each name maps to a connector class or to its ``"module:Class"`` path,
imported on first use (as vLLM's ``KVConnectorFactory`` registers its
connectors lazily). The built-ins are registered here as paths, so a Redis
client is not a dependency of an engine without one. A package can ship a
connector by registering it in the entry point group
``tandem.kv_connectors``::

    [project.entry-points."tandem.kv_connectors"]
    my-store = "my_package.connector:MyConnector"

and code in the process can call ``register_connector``. A connector class
is built as ``cls(role, context)`` (see
``engine.kv_transfer.base.ConnectorContext``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from engine.kv_transfer.base import ConnectorContext, KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from engine.config import KVTransferConfig

ENTRY_POINT_GROUP = "tandem.kv_connectors"

# name -> the class, or its "module:Class" path (imported when first asked for).
_registered: dict[str, str | type[KVConnectorBase]] = {
    "redis": "connectors.redis_connector:RedisConnector",
    "shm": "connectors.shm_connector:SharedMemoryConnector",
    "multi": "connectors.multi:MultiConnector",
    "nixl": "connectors.nixl_connector:NixlConnector",
}


class UnknownConnectorError(ValueError):
    """No connector of that name; the message lists the known ones."""


def register_connector(name: str, target: str | type[KVConnectorBase]) -> None:
    """Make ``target`` available as ``name`` in this process: a connector
    class, or its ``"module:Class"`` path, imported when ``name`` is first
    used. Replaces an earlier registration of ``name`` (a built-in's too)."""
    _registered[name] = target


def known_connectors() -> list[str]:
    names = set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def connector_class(name: str) -> type[KVConnectorBase]:
    """The class registered as ``name`` (in this process, else as an entry
    point); raises UnknownConnectorError if there is none, or if the name
    leads to something that is not a KVConnectorBase subclass."""
    target: object
    if name in _registered:
        target = _registered[name]
        if isinstance(target, str):
            module, _, attr = target.partition(":")
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
