"""What a pod's part in prefill/decode disaggregation implies, in one place.

``EngineConfig.role`` (``tandem serve --role``) is the source of truth;
everything that follows from it is decided here, for the engine core and
the CLI alike:

- which KV connector directions the role allows, and whether it needs a
  connector at all (a prefill pod must save, a decode pod must load);
- the connector direction the role stands for (``kv_role_of``: what the
  Helm chart gives each pool, and what GetServerInfo reports);
- that a prefill pod never speculates: it samples one token per request,
  so drafts would only cost it a proposer (and a draft model's memory).

``kv_role`` stays the connector's own setting (which way it moves KV: a
prefill pod may also load prefix hits with ``kv_both``); nothing decides a
pod's P/D behaviour from it, except that an engine built without a role
takes the one its connector implies (``implied_role``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from engine.config import (
    KV_ROLES,
    POD_ROLES,
    ConfigError,
    EngineConfig,
    KVRole,
    KVTransferConfig,
    PodRole,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleRules:
    """What one role implies."""

    # The connector direction the role stands for.
    kv_role: KVRole
    # The directions its connector may have.
    kv_roles: tuple[KVRole, ...]
    needs_connector: bool
    speculates: bool


ROLE_RULES: dict[PodRole, RoleRules] = {
    "prefill": RoleRules("kv_producer", ("kv_producer", "kv_both"), True, speculates=False),
    "decode": RoleRules("kv_consumer", ("kv_consumer", "kv_both"), True, speculates=True),
    "both": RoleRules("kv_both", KV_ROLES, False, speculates=True),
}


def rules(role: str) -> RoleRules:
    """The rules of ``role``; ConfigError for a name that is not a role."""
    for name in POD_ROLES:
        if name == role:
            return ROLE_RULES[name]
    raise ConfigError(f"role={role!r} is invalid: expected {' | '.join(POD_ROLES)}")


def kv_role_of(role: str) -> KVRole:
    """The connector direction ``role`` stands for."""
    return rules(role).kv_role


def implied_role(kv: KVTransferConfig | None) -> PodRole:
    """The role of an engine built without one: a connector that only saves
    makes a prefill pod, one that only loads a decode pod."""
    if kv is None or kv.kv_role == "kv_both":
        return "both"
    return "prefill" if kv.kv_role == "kv_producer" else "decode"


def pod_role(config: EngineConfig) -> PodRole:
    """The role ``config`` is for: its own, or the one its connector implies."""
    return config.role if config.role is not None else implied_role(config.kv_transfer)


def apply_role(config: EngineConfig, log: logging.Logger = logger) -> EngineConfig:
    """``config`` with its role set (``implied_role`` when None) and what
    the role rules out dropped (logged on ``log``). Raises ConfigError when
    the KV connector does not fit the role. Idempotent."""
    role = pod_role(config)
    rule = rules(role)
    kv = config.kv_transfer
    if kv is None and rule.needs_connector:
        raise ConfigError(f"--role {role} needs a KV connector (--kv-transfer-config)")
    if kv is not None and kv.kv_role not in rule.kv_roles:
        raise ConfigError(
            f"--role {role} needs kv_role {' or '.join(rule.kv_roles)}, not {kv.kv_role}"
        )
    speculative = config.speculative
    if speculative is not None and not rule.speculates:
        log.info("--role %s: ignoring --speculative-config (%s pods never speculate)", role, role)
        speculative = None
    return replace(config, role=role, speculative=speculative)
