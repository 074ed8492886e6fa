"""Bad values fail at install time, with values.schema.json's message naming
the key (Helm validates the merged values before rendering)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.unit.helm.chart import CHART_DIR, VARIANTS, render, render_error


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": {"replicas": -1}}, "at '/prefill/replicas': minimum: got -1, want 0"),
        ({"decode": {"replicas": -2}}, "at '/decode/replicas': minimum: got -2, want 0"),
        (
            {"kvTransfer": {"connector": "mooncake"}},
            "at '/kvTransfer/connector': value must be one of 'redis', 'shm', 'nixl'",
        ),
        (
            {"redis": {"enabled": False}},
            "at '/redis/externalUrl': minLength: got 0, want 1",
        ),
        (
            {"redis": {"enabled": False, "externalUrl": "cache:6379"}},
            "at '/redis/externalUrl': 'cache:6379' does not match pattern",
        ),
        (
            {"model": {"source": "pvc"}},
            "at '/model/pvc/claimName': minLength: got 0, want 1",
        ),
        (
            {"model": {"source": "s3"}},
            "at '/model/source': value must be one of 'package', 'pvc', 'hostPath'",
        ),
        ({"prefil": {"replicas": 2}}, "additional properties 'prefil' not allowed"),
        (
            {"engine": {"kvEventsEndpoint": "kv-indexer:5557"}},
            "at '/engine/kvEventsEndpoint': 'kv-indexer:5557' does not match pattern",
        ),
        (
            {"decode": {"engine": {"maxNumSeqs": 0}}},
            "at '/decode/engine/maxNumSeqs': minimum: got 0, want 1",
        ),
        (
            {"engine": {"dtype": "int4"}},
            "at '/engine/dtype': value must be one of 'float32', 'bfloat16', 'float16'",
        ),
        (
            {"engine": {"quantization": "q4"}},
            "at '/engine/quantization': value must be one of 'auto', 'none', 'gguf', 'int8'",
        ),
        (
            {"prefill": {"engine": {"int8Activations": "yes"}}},
            "at '/prefill/engine/int8Activations'",
        ),
        (
            {"redis": {"auth": {"password": "p@ss/word"}}},
            "at '/redis/auth/password': 'p@ss/word' does not match pattern",
        ),
        ({"router": {"port": 70000}}, "at '/router/port': maximum: got 70,000, want 65,535"),
        (
            {"gateway": {"kind": "envoy"}},
            "at '/gateway/kind': value must be one of 'tandem', 'smg'",
        ),
        (
            {"gateway": {"kind": "smg", "mode": "split"}},
            "at '/gateway/mode': value must be one of 'pd', 'colocated'",
        ),
        (
            {"gateway": {"kind": "smg", "policies": {"prefill": "fastest"}}},
            "at '/gateway/policies/prefill': value must be one of 'random', 'round_robin',"
            " 'passthrough', 'cache_aware', 'power_of_two', 'least_load', 'manual',"
            " 'consistent_hashing', 'prefix_hash', 'bucket'",
        ),
        (
            # smg's bucket policy is for prefill only.
            {"gateway": {"kind": "smg", "policies": {"decode": "bucket"}}},
            "at '/gateway/policies/decode': value must be one of 'random', 'round_robin',"
            " 'passthrough', 'cache_aware', 'power_of_two', 'least_load', 'manual',"
            " 'consistent_hashing', 'prefix_hash'",
        ),
        (
            {"gateway": {"kind": "smg", "mode": "colocated", "policies": {"colocated": "bucket"}}},
            "at '/gateway/policies/colocated': value must be one of 'random'",
        ),
        ({"gateway": {"discovery": {"enabled": "yes"}}}, "at '/gateway/discovery/enabled'"),
        ({"gateway": {"healthCheckPort": 0}}, "at '/gateway/healthCheckPort': minimum: got 0"),
        ({"gateway": {"kind": "smg", "policy": "random"}}, "additional properties 'policy'"),
    ],
)
def test_bad_values_fail_with_the_schemas_message(values: dict[str, Any], message: str) -> None:
    error = render_error(values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error


def test_the_schema_alone_refuses_them_too() -> None:
    """`helm install` and `helm lint` run the same check before any template."""
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.merge_values({}))
        with pytest.raises(helm.HelmValuesError, match="/kvTransfer/connector"):
            chart.validate_schema(chart.merge_values({"kvTransfer": {"connector": "rdma"}}))


def test_the_policies_smg_accepts_pass() -> None:
    """The schema's enums are smg 1.13.0's choices (`smg launch --help`)."""
    for prefill in ("cache_aware", "bucket", "prefix_hash"):
        for decode in ("least_load", "power_of_two", "round_robin"):
            policies = {"prefill": prefill, "decode": decode}
            assert render({"gateway": {"kind": "smg", "policies": policies}})


def test_the_redis_url_is_only_required_without_the_charts_redis() -> None:
    # Redis disabled but not used: shm and nixl need no URL.
    for connector in ("shm", "nixl"):
        assert render({"redis": {"enabled": False}, "kvTransfer": {"connector": connector}})
    # The chart's Redis needs none either.
    assert render({"redis": {"enabled": True, "externalUrl": ""}})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_passes_the_schema(variant: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.merge_values(VARIANTS[variant]))


def test_termination_margin_must_be_positive() -> None:
    """The grace period must exceed --drain-grace, not equal it."""
    error = render_error({"engine": {"terminationMarginSeconds": 0}})
    assert "at '/engine/terminationMarginSeconds': minimum: got 0, want 1" in error
