"""engine.pod_role: the one owner of what a pod's role implies."""

from __future__ import annotations

import logging

import pytest

from engine.config import (
    KV_ROLES,
    POD_ROLES,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    SpeculativeConfig,
)
from engine.pod_role import ROLE_RULES, apply_role, implied_role, kv_role_of, pod_role

SPEC = SpeculativeConfig("ngram", 3)


def _kv(kv_role: str) -> KVTransferConfig:
    return KVTransferConfig("shm", kv_role)  # type: ignore[arg-type]


def test_every_role_has_rules_and_stands_for_a_direction_it_allows() -> None:
    assert set(ROLE_RULES) == set(POD_ROLES)
    for role, rules in ROLE_RULES.items():
        assert rules.kv_role in rules.kv_roles
        assert kv_role_of(role) == rules.kv_role
    assert [kv_role_of(r) for r in ("prefill", "decode", "both")] == list(KV_ROLES)
    with pytest.raises(ConfigError, match="role='router' is invalid"):
        kv_role_of("router")


def test_a_prefill_pod_drops_the_speculative_config(caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(kv_transfer=_kv("kv_producer"), speculative=SPEC, role="prefill")
    with caplog.at_level(logging.INFO, logger="engine.pod_role"):
        applied = apply_role(config)
    assert applied.speculative is None and applied.role == "prefill"
    assert applied.kv_transfer == config.kv_transfer  # only the speculation goes
    assert "--role prefill: ignoring --speculative-config" in caplog.text
    # A prefill pod whose connector also loads (prefix hits) is still one.
    both_ways = EngineConfig(kv_transfer=_kv("kv_both"), speculative=SPEC, role="prefill")
    assert apply_role(both_ways).speculative is None
    for role, kv_role in (("decode", "kv_consumer"), ("both", "kv_both"), ("both", "kv_producer")):
        kept = EngineConfig(kv_transfer=_kv(kv_role), speculative=SPEC, role=role)  # type: ignore[arg-type]
        assert apply_role(kept).speculative == SPEC, (role, kv_role)


@pytest.mark.parametrize(
    ("role", "kv_role", "message"),
    [
        ("decode", None, "--role decode needs a KV connector"),
        ("prefill", None, "--role prefill needs a KV connector"),
        ("decode", "kv_producer", "--role decode needs kv_role kv_consumer or kv_both"),
        ("prefill", "kv_consumer", "--role prefill needs kv_role kv_producer or kv_both"),
    ],
)
def test_a_connector_that_does_not_fit_the_role_is_refused(
    role: str, kv_role: str | None, message: str
) -> None:
    kv = _kv(kv_role) if kv_role is not None else None
    with pytest.raises(ConfigError, match=message):
        apply_role(EngineConfig(kv_transfer=kv, role=role))  # type: ignore[arg-type]


def test_an_engine_built_without_a_role_takes_its_connectors() -> None:
    assert implied_role(None) == "both"
    assert [implied_role(_kv(r)) for r in KV_ROLES] == ["prefill", "decode", "both"]
    offline_prefill = EngineConfig(kv_transfer=_kv("kv_producer"), speculative=SPEC)
    assert pod_role(offline_prefill) == "prefill"
    applied = apply_role(offline_prefill)
    assert (applied.role, applied.speculative) == ("prefill", None)
    assert apply_role(EngineConfig()).role == "both"


def test_apply_role_is_idempotent() -> None:
    config = EngineConfig(kv_transfer=_kv("kv_producer"), speculative=SPEC, role="prefill")
    once = apply_role(config)
    assert apply_role(once) == once


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ConfigError, match="role='router' is invalid"):
        EngineConfig(role="router")  # type: ignore[arg-type]
