"""gateway.kind=sidecar: smg in every decode pod, over its own Tandem; LoRA
adapters loaded at start on both pools; the InferencePool of the Gateway API
inference extension over the sidecars (helm/examples/inference-pool.yaml).

The sidecar's command line is checked exactly and read by smg's own parser;
tests/integration/test_sidecar.py runs it against a real `tandem serve`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
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
    expanded_args,
    find,
    kubernetes_error,
    label_selector_matches,
    of_kind,
    pod_spec,
    render,
    render_error,
    render_files,
)

# Seconds each (Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

EXAMPLE = CHART_DIR.parent / "examples" / "inference-pool.yaml"
CRD_SCHEMA = Path(__file__).parent / "crds" / "inferencepool-v1.json"
GATEWAY = f"{FULLNAME}-gateway"
DECODE = f"{FULLNAME}-decode"
PREFILL = f"{FULLNAME}-prefill"
POOL_HOST = f"{NAMESPACE}.svc.cluster.local"

SIDECAR: dict[str, Any] = {"gateway": {"kind": "sidecar"}}
COLOCATED: dict[str, Any] = {
    "gateway": {"kind": "sidecar", "mode": "colocated"},
    "prefill": {"replicas": 0},
}
EVERYTHING: dict[str, Any] = {
    "gateway": {
        "kind": "sidecar",
        "port": 8080,
        "healthCheckPort": 8081,
        "image": {"repository": "registry.local/smg", "tag": "1.13.0", "pullPolicy": "Always"},
        "policies": {"prefill": "prefix_hash", "decode": "round_robin"},
        "shutdownGraceSeconds": 90,
        "extraArgs": ["--max-concurrent-requests", "512"],
        "service": {"type": "LoadBalancer", "port": 80},
        "sidecar": {"prometheusPort": 9500, "resources": {"requests": {"cpu": "100m"}}},
    },
    "decode": {"engine": {"port": 50061}},
    "metrics": {"port": 9400, "serviceMonitor": {"enabled": True}},
    "networkPolicy": {
        "sidecarFrom": [{"namespaceSelector": {"matchLabels": {"name": "gateways"}}}]
    },
    "lora": {
        "adapters": [{"name": "sql", "path": "sql-lora"}],
        "source": "hostPath",
        "hostPath": {"path": "/mnt/adapters"},
    },
}


def _example() -> dict[str, Any]:
    values: dict[str, Any] = helm.values_from_yaml(EXAMPLE.read_text())
    return values


VARIANTS: dict[str, dict[str, Any]] = {
    "sidecar-pd": SIDECAR,
    "sidecar-colocated": COLOCATED,
    "sidecar-everything": EVERYTHING,
    "inference-pool-example": _example(),
}


def _pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _smg(objects: list[Obj]) -> Obj:
    return container(find(objects, "Deployment", DECODE), "smg")


def _args(values: dict[str, Any]) -> list[str]:
    c = _smg(render(values))
    assert c["command"] == ["smg"]
    return [str(a) for a in c["args"]]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _smg_parse(args: list[str]) -> Any:
    """smg's own parsing of `smg launch ARGS` (RouterArgs)."""
    launch_router = pytest.importorskip("smg.launch_router")
    assert args[0] == "launch"
    return launch_router.parse_router_args(args[1:])


def _serve_args(objects: list[Obj], pool: str) -> Any:
    c = container(find(objects, "Deployment", f"{FULLNAME}-{pool}"), "tandem")
    return cli._parser().parse_args(expanded_args(objects, c))


# ---- what the sidecar deploys -------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_every_object_is_valid_kubernetes(variant: str, version: str) -> None:
    errors = [
        error
        for obj in render(VARIANTS[variant])
        if obj["kind"] not in CRDS
        for error in [kubernetes_error(obj, version)]
        if error
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_passes_the_schema(variant: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.merge_values(VARIANTS[variant]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    report = helm.lint(CHART_DIR, VARIANTS[variant], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_only_the_decode_pods_run_smg(variant: str) -> None:
    """No gateway Deployment, no router, no account to read pods: each decode
    pod has its own smg, beside an unchanged `tandem serve --role decode`."""
    objects = render(VARIANTS[variant])
    names = {f"{o['kind']}/{o['metadata']['name']}" for o in objects}
    assert f"Deployment/{GATEWAY}" not in names and f"Deployment/{FULLNAME}-router" not in names
    assert not of_kind(objects, "Role") and not of_kind(objects, "RoleBinding")
    for deployment in of_kind(objects, "Deployment"):
        containers = [c["name"] for c in pod_spec(deployment)["containers"]]
        is_decode = deployment["metadata"]["name"] == DECODE
        assert containers == (["tandem", "smg"] if is_decode else [containers[0]])
    assert _serve_args(objects, "decode").role == "decode"
    # The pools' account keeps no token (smg dials its pod, not the API server).
    assert pod_spec(find(objects, "Deployment", DECODE))["automountServiceAccountToken"] is False


HEAD = ["launch", "--host", "0.0.0.0", "--port", "8000", "--backend", "vllm"]
STARTUP = ["--worker-startup-check-interval", "5", "--worker-startup-timeout-secs", "1800"]
TAIL = [
    "--health-check-port",
    "8001",
    "--prometheus-host",
    "0.0.0.0",
    "--prometheus-port",
    "9091",
    "--log-level",
    "info",
    "--shutdown-grace-period-secs",
    "30",
    "--worker-wedge-secs",
    "30",
    "--worker-stall-secs",
    "10",
]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            SIDECAR,
            [
                *HEAD,
                "--pd-disaggregation",
                "--prefill",
                f"grpc://{PREFILL}.{POOL_HOST}:50051",
                "--decode",
                "grpc://127.0.0.1:50051",
                *STARTUP,
                "--prefill-policy",
                "cache_aware",
                "--decode-policy",
                "least_load",
                *TAIL,
            ],
        ),
        (
            COLOCATED,
            [
                *HEAD,
                "--worker-urls",
                "grpc://127.0.0.1:50051",
                *STARTUP,
                "--policy",
                "cache_aware",
                *TAIL,
            ],
        ),
    ],
)
def test_sidecar_args(values: dict[str, Any], expected: list[str]) -> None:
    assert _args(values) == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_smg_dials_its_own_pod_and_the_prefill_pool(variant: str) -> None:
    """smg reads the args as a worker at the pod's own gRPC port on loopback
    (where `tandem serve` listens: 0.0.0.0) and, with mode=pd, the prefill
    pool's headless Service; one more at each LoRA adapter's own port
    (--lora-port; test_lora_ports.py)."""
    values = VARIANTS[variant]
    objects = render(values)
    parsed = _smg_parse(_args(values))
    serve = _serve_args(objects, "decode")
    assert serve.host == "0.0.0.0"
    adapter_ports = [port for _, port in serve.lora_port or []]
    local = [f"grpc://127.0.0.1:{port}" for port in (serve.port, *adapter_ports)]
    if values["gateway"].get("mode", "pd") == "pd":
        assert parsed.pd_disaggregation and parsed.decode_urls == local
        prefill, *_ = [url for url, _ in parsed.prefill_urls]
        assert [bootstrap for _, bootstrap in parsed.prefill_urls] == [None] * len(local)
        service = find(objects, "Service", PREFILL)
        assert service["spec"]["clusterIP"] == "None"
        (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert prefill == f"grpc://{PREFILL}.{POOL_HOST}:{grpc['port']}"
    else:
        assert not parsed.pd_disaggregation and parsed.worker_urls == local
    assert not parsed.service_discovery
    assert parsed.host == "0.0.0.0" and parsed.prometheus_host == "0.0.0.0"


def test_values_reach_the_sidecar() -> None:
    objects = render(EVERYTHING)
    deployment = find(objects, "Deployment", DECODE)
    c = container(deployment, "smg")
    args = [str(a) for a in c["args"]]
    assert c["image"] == "registry.local/smg:1.13.0" and c["imagePullPolicy"] == "Always"
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "512Mi"}  # merged
    assert (_flag(args, "--port"), _flag(args, "--health-check-port")) == ("8080", "8081")
    assert _flag(args, "--prometheus-port") == "9500"
    assert _flag(args, "--decode") == "grpc://127.0.0.1:50061"
    assert (_flag(args, "--prefill-policy"), _flag(args, "--decode-policy")) == (
        "prefix_hash",
        "round_robin",
    )
    assert args[-2:] == ["--max-concurrent-requests", "512"]
    # The pod outlasts both drains: Tandem's (30 + 15) and smg's (90, 5 s, slack).
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] >= 90 + 5 + 5
    assert (
        pod_spec(find(render(SIDECAR), "Deployment", DECODE))["terminationGracePeriodSeconds"] == 45
    )
    # Without an override, the sidecar runs Tandem's image (it has smg).
    default = render(SIDECAR)
    tandem = container(find(default, "Deployment", DECODE), "tandem")
    assert _smg(default)["image"] == tandem["image"]
    assert _smg(default)["securityContext"] == tandem["securityContext"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_pod_one_set_of_ports(variant: str) -> None:
    """Tandem and smg share the pod's network: no port number or name twice,
    and the probes reach smg's health port."""
    deployment = find(render(VARIANTS[variant]), "Deployment", DECODE)
    ports = [p for c in pod_spec(deployment)["containers"] for p in c["ports"]]
    assert len({p["containerPort"] for p in ports}) == len(ports)
    assert len({p["name"] for p in ports}) == len(ports)
    c = container(deployment, "smg")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    args = [str(a) for a in c["args"]]
    assert named == {
        "http": int(_flag(args, "--port")),
        "smg-health": int(_flag(args, "--health-check-port")),
        "smg-metrics": int(_flag(args, "--prometheus-port")),
    }
    assert c["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "smg-health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/readiness", "port": "smg-health"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_smg_is_restarted_only_once_it_gave_up_registering(variant: str) -> None:
    """smg retries a worker that is not up yet (a model loading, a prefill
    pool down) until --worker-startup-timeout-secs, then stays unready for
    good: the liveness probe (on /readiness) restarts it only after that."""
    c = _smg(render(VARIANTS[variant]))
    parsed = _smg_parse([str(a) for a in c["args"]])
    assert parsed.worker_startup_check_interval == 5
    probe = c["livenessProbe"]
    unready_for = probe["periodSeconds"] * probe["failureThreshold"]
    assert unready_for > parsed.worker_startup_timeout_secs + parsed.worker_startup_check_interval
    # Draining (smg not ready for 5 s + its grace) never looks dead.
    grace = int(_flag([str(a) for a in c["args"]], "--shutdown-grace-period-secs"))
    assert unready_for > grace + 5 + probe["periodSeconds"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_gateway_service_reaches_the_sidecars(variant: str) -> None:
    values = VARIANTS[variant]
    objects = render(values)
    service = find(objects, "Service", GATEWAY)
    selector = {"matchLabels": service["spec"]["selector"]}
    for workload in (*of_kind(objects, "Deployment"), *of_kind(objects, "StatefulSet")):
        is_decode = workload["metadata"]["name"] == DECODE
        assert label_selector_matches(selector, _pod_labels(workload)) == is_decode
    smg = {p["name"]: p["containerPort"] for p in _smg(objects)["ports"]}
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert {n: p["targetPort"] for n, p in by_name.items()} == {
        "http": "http",
        "metrics": "smg-metrics",
    }
    assert by_name["metrics"]["port"] == smg["smg-metrics"]
    assert by_name["http"]["port"] == values["gateway"].get("service", {}).get("port", 8000)


def test_the_service_monitor_scrapes_the_sidecars_and_the_pools() -> None:
    objects = render(EVERYTHING)
    monitor = find(objects, "ServiceMonitor", FULLNAME)
    selected = sorted(
        s["metadata"]["name"]
        for s in of_kind(objects, "Service")
        if label_selector_matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    )
    assert selected == [DECODE, GATEWAY, PREFILL]
    (endpoint,) = monitor["spec"]["endpoints"]
    ports = {s["metadata"]["name"]: s["spec"]["ports"] for s in of_kind(objects, "Service")}
    targets = {
        n: [p["targetPort"] for p in ports[n] if p["name"] == endpoint["port"]] for n in selected
    }
    assert targets == {DECODE: ["metrics"], GATEWAY: ["smg-metrics"], PREFILL: ["metrics"]}


def _ingress(objects: list[Obj]) -> list[Obj]:
    rules: list[Obj] = find(objects, "NetworkPolicy", f"{FULLNAME}-pools")["spec"]["ingress"]
    return rules


def _opened(rules: list[Obj], port: int) -> list[Obj]:
    return [r for r in rules if any(p["port"] == port for p in r.get("ports", []))]


def test_network_policy() -> None:
    """pd: the decode pods (their smg) reach the pools' gRPC port; colocated:
    nothing does (smg reaches its own Tandem over loopback). The sidecars'
    OpenAI port is open to sidecarFrom, smg's metrics like Tandem's."""
    objects = render(EVERYTHING)
    rules = _ingress(objects)
    labels = {n: _pod_labels(find(objects, "Deployment", n)) for n in (DECODE, PREFILL)}
    (grpc,) = _opened(rules, 50051)
    assert _opened(rules, 50061) == [grpc]
    (peer,) = grpc["from"]
    assert label_selector_matches(peer["podSelector"], labels[DECODE])
    assert not label_selector_matches(peer["podSelector"], labels[PREFILL])
    (http,) = _opened(rules, 8080)
    assert http["from"] == EVERYTHING["networkPolicy"]["sidecarFrom"]
    assert _opened(rules, 9500) == _opened(rules, 9400)
    colocated = _ingress(render(COLOCATED))
    assert not _opened(colocated, 50051)
    (http,) = _opened(colocated, 8000)
    assert "from" not in http  # sidecarFrom empty: any source


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"gateway": {"kind": "sidecar", "sidecar": {"prometheusPort": 9090}}},
            "with gateway.kind=sidecar, smg shares the decode pods' ports",
        ),
        (
            {"gateway": {"kind": "sidecar", "port": 50051}},
            "must differ (got 50051, 8001, 9091, 50051, 9090)",
        ),
        (
            {"gateway": {"kind": "sidecar", "policies": {"prefill": "power_of_two"}}},
            "gateway.policies.prefill=power_of_two needs at least two workers, and a sidecar",
        ),
        (
            {"gateway": {"kind": "sidecar", "mode": "colocated"}},
            "gateway.mode=colocated sends whole requests to the decode pool",
        ),
        (
            {**SIDECAR, "auth": {"pools": {"existingSecret": "k"}}},
            "auth.* and tls.* are not supported with gateway.kind=sidecar yet",
        ),
        (
            {"inferencePool": {"enabled": True, "endpointPicker": {"serviceName": "epp"}}},
            "inferencePool.enabled needs gateway.kind=sidecar",
        ),
        (
            {**SIDECAR, "inferencePool": {"enabled": True}},
            "at '/inferencePool/endpointPicker/serviceName': minLength: got 0, want 1",
        ),
        ({"gateway": {"kind": "sidecars"}}, "value must be one of 'tandem', 'smg', 'sidecar'"),
    ],
)
def test_what_the_sidecar_cannot_do_fails_the_render(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


def test_notes_tell_how_to_call_the_sidecars() -> None:
    notes = render_files(VARIANTS["inference-pool-example"])["tandem/templates/NOTES.txt"]
    assert "smg in every decode pod, OpenAI HTTP on port 8000 of each" in notes
    assert f"http://{GATEWAY}.{NAMESPACE}.svc.cluster.local:8000/v1" in notes
    assert f"InferencePool {FULLNAME}" in notes and "tandem-epp:9002" in notes
    assert "tandem generate" not in notes
    body = notes.split("-d '", 1)[1].split("'", 1)[0]
    assert json.loads(body)["messages"][0]["role"] == "user"


# ---- LoRA adapters at start --------------------------------------------------------


def _volume_of(objects: list[Obj], pool: str, path: str) -> Obj:
    """The volume a path of the pool's Tandem container lies on."""
    deployment = find(objects, "Deployment", f"{FULLNAME}-{pool}")
    mounts = container(deployment, "tandem")["volumeMounts"]
    (mount,) = [m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True, mount
    volumes: list[Obj] = pod_spec(deployment)["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    return volume


LORA_PVC: dict[str, Any] = {
    "lora": {
        "adapters": [{"name": "sql", "path": "sql-lora"}, {"name": "poet", "path": "/x/poet"}],
        "pvc": {"claimName": "adapters"},
    }
}


@pytest.mark.parametrize("gateway", ["tandem", "smg", "sidecar"])
@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_both_legs_load_the_adapters_at_start(gateway: str, pool: str) -> None:
    values = {**LORA_PVC, "gateway": {"kind": gateway}}
    objects = render(values)
    args = _serve_args(objects, pool)
    assert args.enable_lora
    assert args.lora_modules == [("sql", "/adapters/sql-lora"), ("poet", "/adapters/x/poet")]
    config = cli.engine_config_from_args(args)
    assert config.lora is not None
    for _, path in args.lora_modules:
        volume = _volume_of(objects, pool, path)
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    assert _serve_args(objects, pool).kv_transfer_config is not None  # still parsed after


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_adapter_sources(pool: str) -> None:
    objects = render(EVERYTHING)
    ((_, path),) = _serve_args(objects, pool).lora_modules
    assert _volume_of(objects, pool, path)["hostPath"] == {
        "path": "/mnt/adapters",
        "type": "Directory",
    }
    # Beside the model, on its volume: no volume of their own.
    beside = {
        "model": {"source": "pvc", "pvc": {"claimName": "models"}, "path": "llama"},
        "lora": {"source": "model", "adapters": [{"name": "sql", "path": "loras/sql"}]},
    }
    objects = render(beside)
    ((name, path),) = _serve_args(objects, pool).lora_modules
    assert (name, path) == ("sql", "/models/loras/sql")
    assert _volume_of(objects, pool, path)["persistentVolumeClaim"]["claimName"] == "models"
    volumes = pod_spec(find(objects, "Deployment", f"{FULLNAME}-{pool}"))["volumes"]
    assert "adapters" not in [v["name"] for v in volumes]


def test_lora_enabled_without_adapters_and_off_by_default() -> None:
    objects = render({"lora": {"enabled": True}})
    for pool in ("prefill", "decode"):
        args = _serve_args(objects, pool)
        assert args.enable_lora and not args.lora_modules
        assert cli.engine_config_from_args(args).lora is not None
        volumes = pod_spec(find(objects, "Deployment", f"{FULLNAME}-{pool}"))["volumes"]
        assert "adapters" not in [v["name"] for v in volumes]
    default = render()
    for pool in ("prefill", "decode"):
        args = _serve_args(default, pool)
        assert not args.enable_lora and not args.lora_modules


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"lora": {"adapters": [{"name": "a", "path": "a"}]}},
            "lora.pvc.claimName is required with lora.adapters and lora.source=pvc",
        ),
        (
            {"lora": {"adapters": [{"name": "a", "path": "a"}], "source": "hostPath"}},
            "lora.hostPath.path is required with lora.adapters and lora.source=hostPath",
        ),
        (
            {"lora": {"adapters": [{"name": "a", "path": "a"}], "source": "model"}},
            "lora.source=model reads adapters from the model's volume",
        ),
        (
            {
                "lora": {
                    "adapters": [{"name": "a", "path": "a"}, {"name": "a", "path": "b"}],
                    "pvc": {"claimName": "c"},
                }
            },
            'lora.adapters: the name "a" is given twice',
        ),
        (
            {"lora": {"adapters": [{"name": "a=b", "path": "a"}]}},
            "at '/lora/adapters/0/name': 'a=b' does not match pattern",
        ),
        (
            # A path (loaded at start), a port (test_lora_ports.py), or both.
            {"lora": {"adapters": [{"name": "a"}]}},
            "at '/lora/adapters/0': missing property 'path'",
        ),
    ],
)
def test_adapter_values_the_chart_refuses(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


# ---- the InferencePool example -----------------------------------------------------


def _strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused (kubectl's strict field
    validation does so; the API server would otherwise prune them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _inference_pool(objects: list[Obj]) -> Obj:
    (pool,) = of_kind(objects, "InferencePool")
    return pool


def test_the_example_is_a_valid_inference_pool() -> None:
    """Against the v1 CRD's schema, and its two CEL rules by hand."""
    objects = render(_example())
    pool = _inference_pool(objects)
    crd = json.loads(CRD_SCHEMA.read_text())
    assert pool["apiVersion"] == crd["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, _strict(crd))
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(set(numbers)) == len(numbers)  # "port number must be unique"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # port with a Service
    assert pool["metadata"]["namespace"] == NAMESPACE  # the pods' own: no cross-namespace
    # A misspelt field would fail the check.
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["targetPortNumber"] = 8000
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelt, _strict(crd))


def test_the_pool_selects_exactly_the_sidecar_pods_at_their_openai_port() -> None:
    values = _example()
    objects = render(values)
    pool = _inference_pool(objects)
    assert pool["metadata"]["name"] == FULLNAME
    selector = pool["spec"]["selector"]
    for workload in (*of_kind(objects, "Deployment"), *of_kind(objects, "StatefulSet")):
        is_decode = workload["metadata"]["name"] == DECODE
        assert label_selector_matches(selector, _pod_labels(workload)) == is_decode
    smg = {p["name"]: p["containerPort"] for p in _smg(objects)["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": smg["http"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "tandem-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # The example: adapters on every pod the pool holds, several pods to pick from.
    assert [m[0] for m in _serve_args(objects, "decode").lora_modules] == ["sql", "poet"]
    # Each on its own port too: models of their own to the pod's smg (/v1/models).
    assert _serve_args(objects, "decode").lora_port == [("sql", 50061), ("poet", 50062)]
    assert find(objects, "Deployment", DECODE)["spec"]["replicas"] >= 2
    # Its comment names the flags the endpoint picker needs: the pool's name and
    # Tandem's metrics port (the picker reads the vllm:* gauges there).
    text = EXAMPLE.read_text()
    assert f"--pool-name {FULLNAME}" in text
    assert f"--model-server-metrics-port {values.get('metrics', {}).get('port', 9090)}" in text


def test_the_pool_is_off_by_default_and_follows_its_values() -> None:
    assert not of_kind(render(SIDECAR), "InferencePool")
    named = {
        **EVERYTHING,
        "inferencePool": {
            "enabled": True,
            "name": "chat",
            "endpointPicker": {"serviceName": "epp", "port": 9100, "failureMode": "FailOpen"},
        },
    }
    pool = _inference_pool(render(named))
    assert pool["metadata"]["name"] == "chat"
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
