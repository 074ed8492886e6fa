"""gateway.kind=smg: the Shepherd Model Gateway replaces the tandem router.

Its args are checked exactly, then read by smg's own parser and finally run
by the real `smg` binary (the rendered command line, outside a cluster: no
pods to find, so it must come up live and not ready). The default
(gateway.kind=tandem) renders as before, with no smg object."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service import cli
from tests.unit.helm.chart import (
    CHART_DIR,
    CRDS,
    FULLNAME,
    NAMESPACE,
    NEWEST,
    OLDEST,
    Obj,
    container,
    find,
    kubernetes_error,
    label_selector_matches,
    of_kind,
    pod_spec,
    render,
    render_error,
    render_files,
)

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

GATEWAY = f"{FULLNAME}-gateway"
SMG: dict[str, Any] = {"gateway": {"kind": "smg"}}
STATIC: dict[str, Any] = {"gateway": {"kind": "smg", "discovery": {"enabled": False}}}
COLOCATED: dict[str, Any] = {
    "gateway": {"kind": "smg", "mode": "colocated"},
    "prefill": {"replicas": 0},
}
COLOCATED_STATIC: dict[str, Any] = {
    "gateway": {
        "kind": "smg",
        "mode": "colocated",
        "discovery": {"enabled": False},
        "policies": {"colocated": "round_robin"},
    },
    "prefill": {"replicas": 0},
}
EVERYTHING: dict[str, Any] = {
    "gateway": {
        "kind": "smg",
        "replicas": 2,
        "port": 8080,
        "healthCheckPort": 8081,
        "prometheusPort": 9400,
        "image": {"repository": "registry.local/smg", "tag": "1.13.0", "pullPolicy": "Always"},
        "policies": {"prefill": "bucket", "decode": "power_of_two"},
        "shutdownGraceSeconds": 60,
        "extraArgs": ["--max-concurrent-requests", "512"],
        "service": {"type": "LoadBalancer", "port": 80},
    },
    "logLevel": "warning",
    "kvTransfer": {"connector": "nixl"},
    "decode": {"engine": {"port": 50061}},
    "metrics": {"serviceMonitor": {"enabled": True}},
}
SMG_VARIANTS = {
    "smg-pd": SMG,
    "smg-pd-static": STATIC,
    "smg-colocated": COLOCATED,
    "smg-colocated-static": COLOCATED_STATIC,
    "smg-everything": EVERYTHING,
}
POOL_HOST = f"{NAMESPACE}.svc.cluster.local"


def _gateway(objects: list[Obj]) -> tuple[Obj, Obj]:
    deployment = find(objects, "Deployment", GATEWAY)
    return deployment, container(deployment)


def _args(values: dict[str, Any]) -> list[str]:
    _, c = _gateway(render(values))
    assert c["command"] == ["smg"]
    return [str(a) for a in c["args"]]


def _pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _named_ports(c: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- the default stays the tandem router -----------------------------------------


def _comparable(objects: list[Obj]) -> list[Obj]:
    """The objects, less the chart's generated Redis password (new per render)."""
    out = copy.deepcopy(objects)
    for obj in of_kind(out, "Secret"):
        obj.pop("data", None)
    return sorted(out, key=lambda o: (o["kind"], o["metadata"]["name"]))


def test_the_default_is_the_tandem_router_and_ignores_the_smg_settings() -> None:
    default = render()
    names = {f"{o['kind']}/{o['metadata']['name']}" for o in default}
    assert not [n for n in names if n.endswith("-gateway")]
    assert not of_kind(default, "Role") and not of_kind(default, "RoleBinding")
    router = find(default, "Deployment", f"{FULLNAME}-router")
    assert container(router)["command"] == ["tandem"]
    # Every other gateway key is smg's alone: with kind=tandem it changes nothing.
    tandem_with_smg_settings = {
        "gateway": {
            "kind": "tandem",
            "mode": "colocated",
            "discovery": {"enabled": False},
            "port": 9999,
            "policies": {"decode": "random"},
        }
    }
    assert _comparable(render(tandem_with_smg_settings)) == _comparable(default)
    assert "router" in render_files()["tandem/templates/NOTES.txt"]


@pytest.mark.parametrize("variant", sorted(SMG_VARIANTS))
def test_smg_replaces_every_tandem_router_object(variant: str) -> None:
    objects = render(SMG_VARIANTS[variant])
    assert not [o for o in objects if o["metadata"]["name"] == f"{FULLNAME}-router"]
    for deployment in of_kind(objects, "Deployment"):
        for c in pod_spec(deployment)["containers"]:
            args = [str(a) for a in c.get("args", [])]
            assert not (c.get("command") == ["tandem"] and "router" in args)
    (gateway,) = [d for d in of_kind(objects, "Deployment") if container(d)["command"] == ["smg"]]
    assert gateway["metadata"]["name"] == GATEWAY
    # The pools stay as they are: `tandem serve` with their role.
    for name in ("prefill", "decode"):
        pool = container(find(objects, "Deployment", f"{FULLNAME}-{name}"))
        assert cli._parser().parse_args([str(a) for a in pool["args"]]).role == name


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (SMG, {"ServiceAccount/-gateway", "Role/-gateway", "RoleBinding/-gateway"}),
        (COLOCATED, {"ServiceAccount/-gateway", "Role/-gateway", "RoleBinding/-gateway"}),
        (STATIC, set()),
        (COLOCATED_STATIC, set()),
    ],
)
def test_what_smg_deploys(values: dict[str, Any], expected: set[str]) -> None:
    objects = render(values)
    kinds = {f"{o['kind']}/{o['metadata']['name'].removeprefix(FULLNAME)}" for o in objects}
    base = {
        "ServiceAccount/",
        "Deployment/-prefill",
        "Deployment/-decode",
        "Deployment/-gateway",
        "Service/-prefill",
        "Service/-decode",
        "Service/-gateway",
        "PodDisruptionBudget/-prefill",
        "PodDisruptionBudget/-decode",
        "PodDisruptionBudget/-gateway",
        "NetworkPolicy/-pools",
        "NetworkPolicy/-redis",
        "StatefulSet/-redis",
        "Service/-redis",
        "Secret/-redis",
    }
    assert kinds == base | expected


@pytest.mark.parametrize("variant", sorted(SMG_VARIANTS))
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_smg_object_is_valid_kubernetes(variant: str, version: str) -> None:
    errors = [
        error
        for obj in render(SMG_VARIANTS[variant])
        if obj["kind"] not in CRDS
        for error in [kubernetes_error(obj, version)]
        if error
    ]
    assert not errors, "\n".join(errors)


# ---- the exact command lines -------------------------------------------------------

COMMON_TAIL = [
    "--health-check-port",
    "8001",
    "--prometheus-host",
    "0.0.0.0",
    "--prometheus-port",
    "9090",
    "--log-level",
    "info",
    "--shutdown-grace-period-secs",
    "30",
    "--worker-wedge-secs",
    "30",
    "--worker-stall-secs",
    "10",
]
HEAD = ["launch", "--host", "0.0.0.0", "--port", "8000", "--backend", "vllm"]
DISCOVERY = [
    "--service-discovery",
    "--service-discovery-namespace",
    NAMESPACE,
    "--service-discovery-port",
    "50051",
]


def _selector(component: str) -> list[str]:
    return [
        f"app.kubernetes.io/component={component}",
        "app.kubernetes.io/instance=demo",
        "app.kubernetes.io/name=tandem",
    ]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            SMG,
            [
                *HEAD,
                "--pd-disaggregation",
                *DISCOVERY,
                "--prefill-selector",
                *_selector("prefill"),
                "--decode-selector",
                *_selector("decode"),
                "--prefill-policy",
                "cache_aware",
                "--decode-policy",
                "least_load",
                *COMMON_TAIL,
            ],
        ),
        (
            STATIC,
            [
                *HEAD,
                "--pd-disaggregation",
                "--prefill",
                f"grpc://{FULLNAME}-prefill.{POOL_HOST}:50051",
                "--decode",
                f"grpc://{FULLNAME}-decode.{POOL_HOST}:50051",
                "--prefill-policy",
                "cache_aware",
                "--decode-policy",
                "least_load",
                *COMMON_TAIL,
            ],
        ),
        (
            COLOCATED,
            [
                *HEAD,
                *DISCOVERY,
                "--selector",
                *_selector("decode"),
                "--policy",
                "cache_aware",
                *COMMON_TAIL,
            ],
        ),
        (
            COLOCATED_STATIC,
            [
                *HEAD,
                "--worker-urls",
                f"grpc://{FULLNAME}-decode.{POOL_HOST}:50051",
                "--policy",
                "round_robin",
                *COMMON_TAIL,
            ],
        ),
    ],
)
def test_smg_args(values: dict[str, Any], expected: list[str]) -> None:
    assert _args(values) == expected


def test_values_reach_the_smg_flags() -> None:
    objects = render(EVERYTHING)
    deployment, c = _gateway(objects)
    args = [str(a) for a in c["args"]]
    assert c["image"] == "registry.local/smg:1.13.0"
    assert c["imagePullPolicy"] == "Always"
    assert deployment["spec"]["replicas"] == 2
    assert (_flag(args, "--port"), _flag(args, "--health-check-port")) == ("8080", "8081")
    assert _flag(args, "--prometheus-port") == "9400"
    assert _flag(args, "--prefill-policy") == "bucket"
    assert _flag(args, "--decode-policy") == "power_of_two"  # fine with discovery
    assert _flag(args, "--log-level") == "warn"  # smg's name for warning
    assert _flag(args, "--shutdown-grace-period-secs") == "60"
    assert args[-2:] == ["--max-concurrent-requests", "512"]
    # Without an override, the gateway runs Tandem's own image (it has smg).
    default_c = _gateway(render(SMG))[1]
    pool = container(find(render(SMG), "Deployment", f"{FULLNAME}-decode"))
    assert default_c["image"] == pool["image"]
    assert default_c["imagePullPolicy"] == pool["imagePullPolicy"]


# ---- what smg makes of them --------------------------------------------------------


def _smg_parse(args: list[str]) -> Any:
    """smg's own parsing of `smg launch ARGS` (RouterArgs)."""
    launch_router = pytest.importorskip("smg.launch_router")
    assert args[0] == "launch"
    return launch_router.parse_router_args(args[1:])


def test_smg_finds_exactly_each_pools_pods_with_discovery() -> None:
    objects = render(SMG)
    parsed = _smg_parse(_args(SMG))
    assert parsed.pd_disaggregation and parsed.service_discovery
    assert parsed.service_discovery_namespace == NAMESPACE
    assert parsed.backend == "vllm"
    assert (parsed.prefill_policy, parsed.decode_policy) == ("cache_aware", "least_load")
    prefill = _pod_labels(find(objects, "Deployment", f"{FULLNAME}-prefill"))
    decode = _pod_labels(find(objects, "Deployment", f"{FULLNAME}-decode"))
    others = [
        _pod_labels(w)
        for w in (*of_kind(objects, "Deployment"), *of_kind(objects, "StatefulSet"))
        if w["metadata"]["name"] not in (f"{FULLNAME}-prefill", f"{FULLNAME}-decode")
    ]
    for selector, mine, theirs in (
        (parsed.prefill_selector, prefill, decode),
        (parsed.decode_selector, decode, prefill),
    ):
        assert label_selector_matches({"matchLabels": selector}, mine)
        assert not label_selector_matches({"matchLabels": selector}, theirs)
        assert not any(label_selector_matches({"matchLabels": selector}, o) for o in others)
    # Discovered pods are dialled at this port: the pools' gRPC port.
    grpc = cli._parser().parse_args([str(a) for a in container(_pool(objects, "decode"))["args"]])
    assert parsed.service_discovery_port == grpc.port


def _pool(objects: list[Obj], name: str) -> Obj:
    return find(objects, "Deployment", f"{FULLNAME}-{name}")


def test_without_discovery_smg_dials_each_pools_headless_service() -> None:
    objects = render(STATIC)
    parsed = _smg_parse(_args(STATIC))
    assert parsed.pd_disaggregation and not parsed.service_discovery
    (prefill,) = parsed.prefill_urls
    (decode,) = parsed.decode_urls
    assert prefill[1] is None  # no bootstrap port: Tandem hands KV over by its connector
    for name, url in (("prefill", prefill[0]), ("decode", decode)):
        service = find(objects, "Service", f"{FULLNAME}-{name}")
        assert service["spec"]["clusterIP"] == "None"  # the name resolves to the pods
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert url == f"grpc://{FULLNAME}-{name}.{POOL_HOST}:{grpc_port['port']}"
    colocated = _smg_parse(_args(COLOCATED_STATIC))
    assert not colocated.pd_disaggregation
    assert colocated.worker_urls == [f"grpc://{FULLNAME}-decode.{POOL_HOST}:50051"]
    assert colocated.policy == "round_robin"


def test_the_schema_offers_exactly_smgs_policies() -> None:
    router_args = pytest.importorskip("smg.router_args")
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    choices = {a.dest: list(a.choices) for a in parser._actions if a.choices}
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    policies = schema["properties"]["gateway"]["properties"]["policies"]["properties"]
    smg_policy = schema["definitions"]["smgPolicy"]["enum"]
    assert policies["prefill"]["enum"] == choices["prefill_policy"]
    assert policies["decode"] == policies["colocated"] == {"$ref": "#/definitions/smgPolicy"}
    assert smg_policy == choices["decode_policy"] == choices["policy"]
    levels = schema["properties"]["logLevel"]["enum"]
    assert {"warn" if level == "warning" else level for level in levels} <= set(
        choices["log_level"]
    )


def test_a_prefill_pool_on_its_own_port_tells_discovery() -> None:
    """smg dials discovered pods at --service-discovery-port (decode's) unless
    the pod's smg.ai/worker-ports annotation names its port."""
    objects = render(EVERYTHING)
    assert _smg_parse(_args(EVERYTHING)).service_discovery_port == 50061
    prefill = _pool(objects, "prefill")["spec"]["template"]["metadata"]
    assert prefill["annotations"]["smg.ai/worker-ports"] == "50051"
    assert "annotations" not in _pool(objects, "decode")["spec"]["template"]["metadata"]
    # Same ports, no discovery, or the tandem router: no annotation.
    for values in (SMG, STATIC, {"decode": {"engine": {"port": 50061}}}):
        for name in ("prefill", "decode"):
            meta = _pool(render(values), name)["spec"]["template"]["metadata"]
            assert "smg.ai/worker-ports" not in meta.get("annotations", {}), (values, name)
    # The user's pod annotations stay beside it.
    mine = render({**EVERYTHING, "prefill": {"podAnnotations": {"team": "llm"}}})
    assert _pool(mine, "prefill")["spec"]["template"]["metadata"]["annotations"] == {
        "team": "llm",
        "smg.ai/worker-ports": "50051",
    }


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def smg_binary() -> str:
    found = shutil.which("smg", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("smg (pinned in pyproject) is not installed")
    return found


@contextlib.contextmanager
def _running(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The command, outside any cluster (no in-cluster account, no kubeconfig:
    discovery finds nothing), its output in `log`; killed and reaped on the
    way out (nothing to drain, and smg's graceful stop waits 5 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = os.devnull
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _wait_live(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"smg exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if _status(url) == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    pytest.fail(f"smg never answered {url}: {log.read_text()[-2000:]}")


def _on_free_ports(values: dict[str, Any]) -> dict[str, Any]:
    port, health, metrics = _free_ports(3)
    values = copy.deepcopy(values)
    values["gateway"].update(port=port, healthCheckPort=health, prometheusPort=metrics)
    return values


@pytest.mark.parametrize("variant", ["smg-pd", "smg-colocated-static"])
def test_smg_runs_the_rendered_command_and_answers_the_probes(
    variant: str, smg_binary: str, tmp_path: Path
) -> None:
    """smg 1.13.0 accepts the whole configuration (its start-up checks run
    before it listens) and serves the probes' paths on the probes' port: live,
    and not ready without workers."""
    _, c = _gateway(render(_on_free_ports(SMG_VARIANTS[variant])))
    ports = _named_ports(c)
    assert c["readinessProbe"]["httpGet"]["port"] == "health"
    assert c["livenessProbe"]["httpGet"]["port"] == "health"
    probe = f"http://127.0.0.1:{ports['health']}"
    log = tmp_path / "smg.log"
    with _running([smg_binary, *[str(a) for a in c["args"]]], log) as process:
        _wait_live(process, probe + c["livenessProbe"]["httpGet"]["path"], log)
        assert _status(probe + c["readinessProbe"]["httpGet"]["path"]) == 503
        assert _status(f"http://127.0.0.1:{ports['metrics']}/metrics") == 200
        assert _status(f"http://127.0.0.1:{ports['http']}/liveness") == 200


def test_smg_refuses_what_the_chart_refuses(smg_binary: str, tmp_path: Path) -> None:
    """Why the chart refuses power_of_two without discovery: smg itself does."""
    args = _args(_on_free_ports(STATIC))
    args[args.index("--decode-policy") + 1] = "power_of_two"
    log = tmp_path / "smg.log"
    with _running([smg_binary, *args], log) as process:
        process.wait(timeout=30)
    assert process.returncode != 0
    assert "requires at least 2 decode workers" in log.read_text()


# ---- Service, probes, draining, accounts -------------------------------------------


@pytest.mark.parametrize("variant", sorted(SMG_VARIANTS))
def test_the_service_and_probes_reach_the_ports_smg_listens_on(variant: str) -> None:
    values = SMG_VARIANTS[variant]
    objects = render(values)
    deployment, c = _gateway(objects)
    args = [str(a) for a in c["args"]]
    assert _flag(args, "--host") == _flag(args, "--prometheus-host") == "0.0.0.0"
    ports = _named_ports(c)
    assert ports == {
        "http": int(_flag(args, "--port")),
        "health": int(_flag(args, "--health-check-port")),
        "metrics": int(_flag(args, "--prometheus-port")),
    }
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "health"}
    service = find(objects, "Service", GATEWAY)
    assert label_selector_matches(
        {"matchLabels": service["spec"]["selector"]}, _pod_labels(deployment)
    )
    for workload in of_kind(objects, "Deployment"):
        if workload is not deployment:
            assert not label_selector_matches(
                {"matchLabels": service["spec"]["selector"]}, _pod_labels(workload)
            )
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(by_name) == {"http", "metrics"}
    assert ports[by_name["http"]["targetPort"]] == ports["http"]
    assert ports[by_name["metrics"]["targetPort"]] == ports["metrics"]
    assert by_name["http"]["port"] == values["gateway"].get("service", {}).get("port", 8000)


def test_termination_grace_outlasts_smgs_drain() -> None:
    for values in (SMG, EVERYTHING):
        deployment, c = _gateway(render(values))
        grace = int(_flag([str(a) for a in c["args"]], "--shutdown-grace-period-secs"))
        # smg keeps listening 5 s after it turns not ready, then drains for grace.
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] >= grace + 5 + 5


def test_only_discovery_gets_an_account_and_a_token() -> None:
    objects = render(SMG)
    deployment, _ = _gateway(objects)
    spec = pod_spec(deployment)
    assert spec["automountServiceAccountToken"] is True
    account = find(objects, "ServiceAccount", GATEWAY)
    assert spec["serviceAccountName"] == GATEWAY
    role = find(objects, "Role", GATEWAY)
    # Least privilege: read the pods of its namespace, nothing else.
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    binding = find(objects, "RoleBinding", GATEWAY)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    # The pools keep the chart's account, with no token.
    for name in ("prefill", "decode"):
        pool = pod_spec(_pool(objects, name))
        assert pool["serviceAccountName"] == FULLNAME
        assert pool["automountServiceAccountToken"] is False
    static = render(STATIC)
    spec = pod_spec(_gateway(static)[0])
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == FULLNAME
    assert not of_kind(static, "Role") and not of_kind(static, "RoleBinding")


def test_only_smg_reaches_the_pools_and_its_metrics_are_scraped() -> None:
    objects = render(EVERYTHING)
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-pools")
    gateway = _pod_labels(_gateway(objects)[0])
    router = {**gateway, "app.kubernetes.io/component": "router"}
    (rule,) = [
        r
        for r in policy["spec"]["ingress"]
        if any(
            "podSelector" in p and "matchExpressions" not in p["podSelector"]
            for p in r.get("from", [])
        )
    ]
    (peer,) = rule["from"]
    assert label_selector_matches(peer["podSelector"], gateway)
    assert not label_selector_matches(peer["podSelector"], router)
    assert sorted(p["port"] for p in rule["ports"]) == [50051, 50061]
    monitor = find(objects, "ServiceMonitor", FULLNAME)
    selected = sorted(
        s["metadata"]["name"]
        for s in of_kind(objects, "Service")
        if label_selector_matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    )
    assert selected == [f"{FULLNAME}-decode", GATEWAY, f"{FULLNAME}-prefill"]
    (endpoint,) = monitor["spec"]["endpoints"]
    service = find(objects, "Service", GATEWAY)
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["port"] == 9400


def test_the_gateway_disruption_budget_covers_only_the_gateway() -> None:
    objects = render(SMG)
    pdb = find(objects, "PodDisruptionBudget", GATEWAY)
    for workload in of_kind(objects, "Deployment"):
        matches = label_selector_matches(pdb["spec"]["selector"], _pod_labels(workload))
        assert matches == (workload["metadata"]["name"] == GATEWAY)
    off = render({"gateway": {"kind": "smg", "podDisruptionBudget": {"enabled": False}}})
    assert not [p for p in of_kind(off, "PodDisruptionBudget") if p["metadata"]["name"] == GATEWAY]


# ---- refusals and notes --------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {**SMG, "auth": {"pools": {"existingSecret": "k"}}},
            "auth.* and tls.* are not supported with gateway.kind=smg yet",
        ),
        (
            {**SMG, "tls": {"router": {"existingSecret": "t"}}},
            "auth.* and tls.* are not supported with gateway.kind=smg yet",
        ),
        (
            {
                "gateway": {
                    "kind": "smg",
                    "discovery": {"enabled": False},
                    "policies": {"decode": "power_of_two"},
                }
            },
            "gateway.policies.decode=power_of_two needs at least two workers",
        ),
        (
            {
                **COLOCATED_STATIC,
                "gateway": {
                    **COLOCATED_STATIC["gateway"],
                    "policies": {"colocated": "power_of_two"},
                },
            },
            "gateway.policies.colocated=power_of_two needs at least two workers",
        ),
        (
            {"gateway": {"kind": "smg", "mode": "colocated"}},
            "gateway.mode=colocated sends whole requests to the decode pool",
        ),
        (
            {
                "gateway": {"kind": "smg", "mode": "colocated"},
                "prefill": {"replicas": 0, "autoscaling": {"enabled": True}},
            },
            "set prefill.replicas=0 and prefill.autoscaling.enabled=false",
        ),
        (
            {"gateway": {"kind": "smg", "prometheusPort": 8001}},
            "gateway.port, gateway.healthCheckPort and gateway.prometheusPort must differ"
            " (got 8000, 8001, 8001)",
        ),
        (
            {"gateway": {"kind": "smg", "image": {"repository": "registry.local/smg"}}},
            "gateway.image.tag is required with gateway.image.repository",
        ),
    ],
)
def test_what_smg_cannot_do_fails_the_render(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


def test_notes_tell_how_to_call_the_openai_api() -> None:
    notes = render_files(SMG)["tandem/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} port-forward service/{GATEWAY} 8000:8000" in notes
    assert f"http://{GATEWAY}.{NAMESPACE}.svc.cluster.local:8000/v1" in notes
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in notes
    assert "tandem generate" not in notes and "router" not in notes
    # The curl example is valid JSON for the chat API.
    body = notes.split("-d '", 1)[1].split("'", 1)[0]
    assert json.loads(body)["messages"][0]["role"] == "user"
    # Several pods per pool without discovery: the notes say they go unused.
    crowded = render_files({**STATIC, "decode": {"replicas": 3}})["tandem/templates/NOTES.txt"]
    assert "other pods get no requests" in crowded
    assert "other pods get no requests" not in render_files(STATIC)["tandem/templates/NOTES.txt"]
    outside = render_files(EVERYTHING)["tandem/templates/NOTES.txt"]
    assert f"get service {GATEWAY}" in outside  # the LoadBalancer's address
