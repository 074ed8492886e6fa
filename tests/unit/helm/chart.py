"""Rendering helm/tandem with Helm's Go library (helm-python-sdk) and reading
what comes out: Kubernetes objects, containers, their environment, and their
arguments as Kubernetes would expand them."""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate

CHART_DIR = Path(__file__).resolve().parents[3] / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-tandem"

Obj = dict[str, Any]

# Values for the downward API fields the chart uses (what a kubelet would fill in).
POD_IP = "10.4.2.17"
_FIELD_VALUES = {"status.podIP": POD_IP}

# One values file per shape of deployment; each connector choice is one.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "redis-external": {
        "redis": {
            "enabled": False,
            "externalUrl": "rediss://:$(REDIS_PASSWORD)@redis.example.com:6380/3",
            "externalPasswordSecret": {"name": "team-redis", "key": "password"},
        }
    },
    "shm": {"kvTransfer": {"connector": "shm", "shm": {"capacityBytes": 4 * 2**30}}},
    "nixl": {"kvTransfer": {"connector": "nixl", "leaseSeconds": 45, "transferTimeoutSeconds": 90}},
    "pvc-model": {
        "model": {"source": "pvc", "pvc": {"claimName": "models"}, "path": "llama-3.1-8b"}
    },
    "hostpath-model": {
        "model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "path": "m.gguf"}
    },
    # API keys and TLS (mTLS both ways) from Secrets the user brings.
    "secured": {
        "auth": {
            "router": {"existingSecret": "clients-key", "key": "token"},
            "pools": {"existingSecret": "pools-key"},
        },
        "tls": {
            "router": {"existingSecret": "router-tls", "clientAuth": True},
            "pools": {
                "existingSecret": "pools-tls",
                "clientAuth": True,
                "clientSecret": "router-client-tls",
            },
        },
    },
    "everything": {
        "image": {"flavor": "cpu"},
        "logLevel": "debug",
        "engine": {
            "drainGraceSeconds": 12.5,
            "dtype": "float32",
            "quantization": "int8",
            "int8Activations": True,
            "device": "cpu",
            "maxModelLen": 2048,
            "kvCacheMemory": "2G",
            "kvCacheDtype": "bfloat16",
            "asyncScheduling": True,
            "blockSize": 32,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 1_000_000,
            "extraArgs": ["--no-kv-events"],
        },
        "kvTransfer": {
            "loadFailurePolicy": "fail",
            "redis": {"ttlSeconds": 600},
            "extraConfig": {"key_prefix": "prod:"},
        },
        "prefill": {
            "engine": {"maxNumBatchedTokens": 16384, "extraArgs": ["--no-chunked-prefill"]},
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
        },
        "decode": {
            "replicas": 3,
            "engine": {"port": 50061, "maxNumSeqs": 512, "int8Activations": False},
            "autoscaling": {
                "enabled": True,
                "maxReplicas": 8,
                "metrics": [
                    {
                        "type": "Pods",
                        "pods": {
                            "metric": {"name": "tandem_requests_waiting"},
                            "target": {"type": "AverageValue", "averageValue": "4"},
                        },
                    }
                ],
            },
        },
        "router": {
            "replicas": 2,
            "port": 8443,
            "pollSeconds": 0.25,
            "service": {"type": "LoadBalancer", "port": 443},
        },
        "metrics": {"port": 9400, "serviceMonitor": {"enabled": True}},
        "redis": {"persistence": {"enabled": False}, "auth": {"password": "pw-123"}},
        "networkPolicy": {
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
        },
    },
}


# Chart.yaml's kubeVersion (>=1.27), or the oldest schemas this kubernetes-validate has.
OLDEST = next(
    v
    for v in kubernetes_validate.utils.all_versions()
    if tuple(map(int, v.split(".")[:2])) >= (1, 27)
)
NEWEST = kubernetes_validate.utils.latest_version()
# Custom resources: no Kubernetes schema; checked in test_wiring (and the
# InferencePool against its CRD's schema in test_sidecar) instead.
CRDS = {"ServiceMonitor", "InferencePool"}


def kubernetes_error(obj: Obj, version: str) -> str | None:
    """None if the object is valid against that Kubernetes version's schemas
    (strict: unknown fields fail too), else the error."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return f"{obj['kind']}/{obj['metadata']['name']} at {path}: {e.message}"
    return None


class RenderFailed(Exception):
    """Helm refused the values or a template failed; str() is Helm's message."""


@functools.cache
def _render(values_json: str) -> tuple[tuple[str, str], ...]:
    values = json.loads(values_json)
    with helm.Chart.load(CHART_DIR) as chart:
        try:
            out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
        except helm.HelmError as e:
            raise RenderFailed(str(e)) from e
    return tuple(sorted(out.items()))


def render_files(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text (cached per values)."""
    return dict(_render(json.dumps(values or {}, sort_keys=True)))


def render(values: dict[str, Any] | None = None) -> list[Obj]:
    """The Kubernetes objects the chart renders for these values."""
    objects: list[Obj] = []
    for path, text in render_files(values).items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in re.split(r"(?m)^---[ \t]*$", text):
            obj = helm.values_from_yaml(doc) if doc.strip() else {}
            if obj:
                objects.append(obj)
    return objects


def render_error(values: dict[str, Any]) -> str:
    try:
        render(values)
    except RenderFailed as e:
        return str(e)
    raise AssertionError(f"the chart rendered values it should refuse: {values}")


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: found {len(found)} in {_names(objects)}"
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def _names(objects: list[Obj]) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in objects]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Obj, name: str | None = None) -> Obj:
    containers: list[Obj] = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions In/NotIn/Exists)."""
    if not labels_match(selector.get("matchLabels", {}), labels):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def secret_value(objects: list[Obj], name: str, key: str) -> str | None:
    """A key of a Secret the chart renders; None if the chart does not render it."""
    for secret in of_kind(objects, "Secret"):
        if secret["metadata"]["name"] == name:
            data = secret.get("data", {})
            assert key in data, f"Secret {name} has no key {key}"
            return base64.b64decode(data[key]).decode()
    return None


def container_env(objects: list[Obj], c: Obj) -> dict[str, str]:
    """The container's environment as the kubelet builds it: literal values
    (expanding earlier variables), downward-API fields, and Secret keys (the
    chart's own Secret's value, or a stand-in for a Secret the user brings)."""
    env: dict[str, str] = {}
    for item in c.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[name] = _FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = secret_value(objects, ref["name"], ref["key"])
            env[name] = value if value is not None else f"from-{ref['name']}-{ref['key']}"
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values: a
    defined variable is replaced, an undefined one stays as written, and
    $$ is a literal $."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def expanded_args(objects: list[Obj], c: Obj) -> list[str]:
    env = container_env(objects, c)
    return [expand(str(a), env) for a in c.get("args", [])]


def tandem_workloads(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(Deployment, container) for every container that runs `tandem`."""
    for deployment in of_kind(objects, "Deployment"):
        for c in pod_spec(deployment)["containers"]:
            if c.get("command") == ["tandem"]:
                yield deployment, c
