"""The chart renders for every variant, and every object it renders is valid
against the Kubernetes schemas (kubernetes-validate, strict: unknown fields
fail too) of the oldest Kubernetes the chart supports and of the newest."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.unit.helm.chart import (
    CHART_DIR,
    CRDS,
    FULLNAME,
    NAMESPACE,
    NEWEST,
    OLDEST,
    VARIANTS,
    Obj,
    find,
    kubernetes_error,
    of_kind,
    pod_spec,
    render,
    render_files,
)

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_object_is_valid_kubernetes(variant: str, version: str) -> None:
    objects = render(VARIANTS[variant])
    assert objects
    errors = []
    for obj in objects:
        if obj["kind"] in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, version, strict=True)
            continue
        error = kubernetes_error(obj, version)
        if error:
            errors.append(error)
    assert not errors, "\n".join(errors)


def test_validation_is_strict() -> None:
    """The check above would catch a misspelt field or a wrong type."""
    deployment = find(render(), "Deployment", f"{FULLNAME}-decode")
    assert kubernetes_error(deployment, NEWEST) is None
    misspelt = copy.deepcopy(deployment)
    pod_spec(misspelt)["terminationGracePeriod"] = 30
    assert kubernetes_error(misspelt, NEWEST) is not None
    wrong_type = copy.deepcopy(deployment)
    pod_spec(wrong_type)["containers"][0]["ports"][0]["containerPort"] = "grpc"
    assert kubernetes_error(wrong_type, NEWEST) is not None


def _kinds(objects: list[Obj]) -> set[str]:
    return {f"{o['kind']}/{o['metadata']['name'].removeprefix(FULLNAME)}" for o in objects}


BASE = {
    "ServiceAccount/",
    "Deployment/-prefill",
    "Deployment/-decode",
    "Deployment/-router",
    "Service/-prefill",
    "Service/-decode",
    "Service/-router",
    "PodDisruptionBudget/-prefill",
    "PodDisruptionBudget/-decode",
    "PodDisruptionBudget/-router",
    "NetworkPolicy/-pools",
}
REDIS = {
    "StatefulSet/-redis",
    "Service/-redis",
    "Secret/-redis",
    "NetworkPolicy/-redis",
}


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("default", BASE | REDIS),
        ("redis-external", BASE),
        ("shm", BASE),
        ("nixl", BASE),
        ("pvc-model", BASE | REDIS),
        ("secured", BASE | REDIS),  # no Secret of its own: the user's
        (
            "everything",
            BASE
            | REDIS
            | {
                "HorizontalPodAutoscaler/-prefill",
                "HorizontalPodAutoscaler/-decode",
                "ServiceMonitor/",
            },
        ),
    ],
)
def test_what_each_variant_deploys(variant: str, expected: set[str]) -> None:
    objects = render(VARIANTS[variant])
    assert _kinds(objects) == expected
    assert {o["metadata"]["namespace"] for o in objects} == {NAMESPACE}


def test_optional_parts_can_be_turned_off() -> None:
    values: dict[str, Any] = {
        "serviceAccount": {"create": False},
        "networkPolicy": {"enabled": False},
        "redis": {"enabled": False, "externalUrl": "redis://redis:6379/0"},
        "prefill": {"podDisruptionBudget": {"enabled": False}},
        "decode": {"podDisruptionBudget": {"enabled": False}},
        "router": {"podDisruptionBudget": {"enabled": False}},
    }
    objects = render(values)
    assert _kinds(objects) == {
        "Deployment/-prefill",
        "Deployment/-decode",
        "Deployment/-router",
        "Service/-prefill",
        "Service/-decode",
        "Service/-router",
    }
    for deployment in of_kind(objects, "Deployment"):
        assert pod_spec(deployment)["serviceAccountName"] == "default"


def test_lint_is_clean() -> None:
    report = helm.lint(CHART_DIR, strict=True)
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == []


def test_notes_tell_how_to_call_the_router() -> None:
    notes = render_files(VARIANTS["everything"])["tandem/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} port-forward service/{FULLNAME}-router 50050:443" in notes
    assert "tandem generate --server 127.0.0.1:50050" in notes
    assert f"{FULLNAME}-router.{NAMESPACE}.svc.cluster.local:443" in notes
    assert f"get service {FULLNAME}-router" in notes  # the LoadBalancer's address
