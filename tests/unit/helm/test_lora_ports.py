"""LoRA adapters through smg: `lora.adapters[].port` serves an adapter on a
gRPC port of its own on every pool pod (`tandem serve --lora-port NAME=PORT`,
service/adapter_ports.py), and the chart makes each port one more smg worker
(per role in P/D, as tests/integration/test_gateway_lora.py starts smg), so
`/v1/models` through the gateway lists the adapters.

The pods' args are read back by the real CLI parser, smg's by smg's own;
smg's discovery takes the ports from the pods' smg.ai/worker-ports
annotation, read here as smg reads it (comma-separated, in order)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from service import cli
from tests.unit.helm.chart import (
    FULLNAME,
    NAMESPACE,
    NEWEST,
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

PREFILL = f"{FULLNAME}-prefill"
DECODE = f"{FULLNAME}-decode"
GATEWAY = f"{FULLNAME}-gateway"
HOST = f"{NAMESPACE}.svc.cluster.local"

# sql: loaded at start and on a port; poet: loaded at start, tandem.v1 only;
# nightly: a port only, loaded later (`tandem lora load`).
LORA: dict[str, Any] = {
    "lora": {
        "enabled": True,
        "adapters": [
            {"name": "sql", "path": "sql-lora", "port": 50061},
            {"name": "poet", "path": "poet-lora"},
            {"name": "nightly", "port": 50062},
        ],
        "pvc": {"claimName": "adapters"},
    }
}
PORTS = [("sql", 50061), ("nightly", 50062)]
COLOCATED = {"mode": "colocated"}
GATEWAYS: dict[str, dict[str, Any]] = {
    "tandem": {"kind": "tandem"},
    "smg-pd": {"kind": "smg"},
    "smg-pd-static": {"kind": "smg", "discovery": {"enabled": False}},
    "smg-colocated": {"kind": "smg", **COLOCATED},
    "smg-colocated-static": {"kind": "smg", "discovery": {"enabled": False}, **COLOCATED},
    "sidecar-pd": {"kind": "sidecar"},
    "sidecar-colocated": {"kind": "sidecar", **COLOCATED},
}


def _values(gateway: str, **more: Any) -> dict[str, Any]:
    values = copy.deepcopy({**LORA, "gateway": GATEWAYS[gateway], **more})
    if values["gateway"].get("mode") == "colocated":
        values["prefill"] = {**values.get("prefill", {}), "replicas": 0}
    return values


def _serve(objects: list[Obj], pool: str) -> Any:
    c = container(find(objects, "Deployment", f"{FULLNAME}-{pool}"), "tandem")
    return cli._parser().parse_args(expanded_args(objects, c))


def _smg_args(objects: list[Obj]) -> list[str]:
    """The args of smg: the gateway Deployment's, or the decode pods' sidecar's."""
    (args,) = [
        [str(a) for a in c["args"]]
        for deployment in of_kind(objects, "Deployment")
        for c in pod_spec(deployment)["containers"]
        if c.get("command") == ["smg"]
    ]
    return args


def _smg_parse(args: list[str]) -> Any:
    launch_router = pytest.importorskip("smg.launch_router")
    assert args[0] == "launch"
    return launch_router.parse_router_args(args[1:])


def _worker_ports(pod_template: Obj) -> list[int] | None:
    """smg's reading of the smg.ai/worker-ports annotation (its
    resolve_worker_ports: comma-separated, deduplicated in order); None
    without it (smg then dials --service-discovery-port)."""
    raw = pod_template["metadata"].get("annotations", {}).get("smg.ai/worker-ports")
    if raw is None:
        return None
    ports = [int(p.strip()) for p in raw.split(",")]
    return list(dict.fromkeys(ports))


# ---- the pods ---------------------------------------------------------------------


@pytest.mark.parametrize("gateway", sorted(GATEWAYS))
def test_both_pools_serve_each_adapter_on_its_named_port(gateway: str) -> None:
    """Every gateway kind (the router's included) renders `--lora-port` on both
    pools, the ports as named container ports of the Tandem container and of
    the pool's headless Service, and no port number or name twice in a pod."""
    objects = render(_values(gateway))
    for pool in ("prefill", "decode"):
        serve = _serve(objects, pool)
        assert serve.lora_port == PORTS
        assert [name for name, _ in serve.lora_modules] == ["sql", "poet"]
        assert serve.enable_lora and cli.engine_config_from_args(serve).lora is not None
        # What ServerConfig checks when the pod starts.
        assert serve.port not in {port for _, port in PORTS}
        deployment = find(objects, "Deployment", f"{FULLNAME}-{pool}")
        named = {p["name"]: p["containerPort"] for p in container(deployment, "tandem")["ports"]}
        assert {n: p for n, p in named.items() if n.startswith("lora-")} == {
            "lora-0": 50061,  # lora.adapters[0]
            "lora-2": 50062,
        }
        every = [p for c in pod_spec(deployment)["containers"] for p in c["ports"]]
        assert len({p["name"] for p in every}) == len({p["containerPort"] for p in every})
        assert len({p["name"] for p in every}) == len(every)
        service = {
            p["name"]: p for p in find(objects, "Service", f"{FULLNAME}-{pool}")["spec"]["ports"]
        }
        for name in ("lora-0", "lora-2"):
            assert service[name]["targetPort"] == name and service[name]["port"] == named[name]


def test_without_ports_nothing_changes() -> None:
    """Adapters without a port: no --lora-port, no extra port, no annotation."""
    values = _values("smg-pd")
    for adapter in values["lora"]["adapters"]:
        adapter.setdefault("path", adapter["name"])
        adapter.pop("port", None)
    objects = render(values)
    for pool in ("prefill", "decode"):
        assert _serve(objects, pool).lora_port is None
        deployment = find(objects, "Deployment", f"{FULLNAME}-{pool}")
        assert [p["name"] for p in container(deployment)["ports"]] == ["grpc", "metrics"]
        assert _worker_ports(deployment["spec"]["template"]) is None


@pytest.mark.slow  # Kubernetes' schemas: about half a second each
@pytest.mark.parametrize("gateway", ["tandem", "smg-pd-static", "sidecar-pd"])
def test_valid_kubernetes(gateway: str) -> None:
    errors = [
        error
        for obj in render(_values(gateway))
        if obj["kind"] != "ServiceMonitor"
        for error in [kubernetes_error(obj, NEWEST)]
        if error
    ]
    assert not errors, "\n".join(errors)


def test_the_router_is_unchanged() -> None:
    """gateway.kind=tandem reaches adapters over tandem.v1 (lora_name): its
    Deployment is the same with or without adapter ports."""
    with_ports = render(_values("tandem"))
    without = copy.deepcopy(_values("tandem"))
    for adapter in without["lora"]["adapters"]:
        adapter.pop("port", None)
        adapter.setdefault("path", "x")
    router = f"{FULLNAME}-router"
    assert find(with_ports, "Deployment", router) == find(render(without), "Deployment", router)


# ---- smg's workers ----------------------------------------------------------------


def _pool_urls(pool: str, ports: list[int]) -> list[str]:
    return [f"grpc://{FULLNAME}-{pool}.{HOST}:{port}" for port in ports]


LOCAL = [f"grpc://127.0.0.1:{port}" for port in (50051, 50061, 50062)]


@pytest.mark.parametrize(
    ("gateway", "workers"),
    [
        (
            "smg-pd-static",
            [
                *(
                    a
                    for url in _pool_urls("prefill", [50051, 50061, 50062])
                    for a in ("--prefill", url)
                ),
                *(
                    a
                    for url in _pool_urls("decode", [50051, 50061, 50062])
                    for a in ("--decode", url)
                ),
            ],
        ),
        ("smg-colocated-static", ["--worker-urls", *_pool_urls("decode", [50051, 50061, 50062])]),
        (
            "sidecar-pd",
            [
                *(
                    a
                    for url in _pool_urls("prefill", [50051, 50061, 50062])
                    for a in ("--prefill", url)
                ),
                *(a for url in LOCAL for a in ("--decode", url)),
            ],
        ),
        ("sidecar-colocated", ["--worker-urls", *LOCAL]),
    ],
)
def test_one_smg_worker_per_adapter_port(gateway: str, workers: list[str]) -> None:
    """The exact worker flags (base model first, then each adapter's port), as
    test_gateway_lora.py gives them; smg's parser reads one worker per port
    per role, each at a port the pool's `tandem serve` listens on."""
    objects = render(_values(gateway))
    args = _smg_args(objects)
    head = args.index("--backend") + 2 + (GATEWAYS[gateway].get("mode") != "colocated")
    assert args[head : head + len(workers)] == workers
    parsed = _smg_parse(args)
    listens = {
        pool: {s.port} | {p for _, p in s.lora_port}
        for pool in ("prefill", "decode")
        for s in [_serve(objects, pool)]
    }
    if parsed.pd_disaggregation:
        assert [bootstrap for _, bootstrap in parsed.prefill_urls] == [None] * 3
        roles = {"prefill": [u for u, _ in parsed.prefill_urls], "decode": parsed.decode_urls}
    else:
        roles = {"decode": parsed.worker_urls}
    for pool, urls in roles.items():
        assert {int(u.rsplit(":", 1)[1]) for u in urls} == listens[pool]
        assert len(urls) == 3


@pytest.mark.parametrize("gateway", ["smg-pd", "smg-colocated"])
def test_discovery_finds_every_port_from_the_pods_annotation(gateway: str) -> None:
    """smg discovers pods, and dials a pod at each port its smg.ai/worker-ports
    annotation lists (one worker each) instead of --service-discovery-port:
    the pod's engine port first, then every adapter's."""
    objects = render(_values(gateway))
    assert _smg_parse(_smg_args(objects)).service_discovery
    for pool in ("prefill", "decode"):
        serve = _serve(objects, pool)
        template = find(objects, "Deployment", f"{FULLNAME}-{pool}")["spec"]["template"]
        assert _worker_ports(template) == [serve.port, *(p for _, p in PORTS)]
    # A prefill pool on a port of its own lists that one.
    moved = render(_values(gateway, prefill={"engine": {"port": 50071}}))
    template = find(moved, "Deployment", PREFILL)["spec"]["template"]
    assert _worker_ports(template) == [50071, 50061, 50062]


def _grpc_rule(objects: list[Obj], peer: Obj) -> list[int]:
    """The ports of the pools' NetworkPolicy that pods with these labels reach."""
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-pools")
    return sorted(
        p["port"]
        for rule in policy["spec"]["ingress"]
        if any(
            "podSelector" in f and label_selector_matches(f["podSelector"], peer)
            for f in rule.get("from", [])
        )
        for p in rule.get("ports", [])
    )


def _labels(objects: list[Obj], name: str) -> Obj:
    labels: Obj = find(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
    return labels


def test_the_network_policy_opens_the_adapter_ports_to_smg_only() -> None:
    smg = render(_values("smg-pd"))
    assert _grpc_rule(smg, _labels(smg, GATEWAY)) == [50051, 50061, 50062]
    sidecar = render(_values("sidecar-pd"))  # the decode pods' smg reaches the prefill pods
    assert _grpc_rule(sidecar, _labels(sidecar, DECODE)) == [50051, 50061, 50062]
    router = render(_values("tandem"))  # tandem.v1 on the gRPC port: the router needs no more
    assert _grpc_rule(router, _labels(router, f"{FULLNAME}-router")) == [50051]


def test_notes_name_the_adapter_models() -> None:
    for gateway in ("smg-pd", "sidecar-pd"):
        notes = render_files(_values(gateway))["tandem/templates/NOTES.txt"]
        assert "LoRA models   sql, nightly" in notes
    assert "LoRA models" not in render_files(_values("tandem"))["tandem/templates/NOTES.txt"]


# ---- refusals ---------------------------------------------------------------------


def _with_ports(*ports: int, **more: Any) -> dict[str, Any]:
    adapters = [{"name": f"a{i}", "path": f"a{i}", "port": port} for i, port in enumerate(ports)]
    return {"lora": {"adapters": adapters, "pvc": {"claimName": "c"}}, **more}


CLASH = "every pool pod listens on each adapter's port beside its own, so they must all differ"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            _with_ports(50061, 50061),
            'the port 50061 of adapter "a1" is also the port of adapter "a0"',
        ),
        (_with_ports(50051), 'the port 50051 of adapter "a0" is also the pools\' engine port'),
        (
            _with_ports(50071, prefill={"engine": {"port": 50071}}),
            'the port 50071 of adapter "a0" is also prefill.engine.port',
        ),
        (
            _with_ports(50061, decode={"engine": {"port": 50061}}),
            'the port 50061 of adapter "a0" is also decode.engine.port',
        ),
        (_with_ports(9090), 'the port 9090 of adapter "a0" is also metrics.port'),
        (
            _with_ports(8000, gateway={"kind": "sidecar"}),
            "is also gateway.port (the smg sidecar's, in every decode pod)",
        ),
        (
            _with_ports(8001, gateway={"kind": "sidecar"}),
            "is also gateway.healthCheckPort (the smg sidecar's, in every decode pod)",
        ),
        (
            _with_ports(9091, gateway={"kind": "sidecar"}),
            "is also gateway.sidecar.prometheusPort (in every decode pod)",
        ),
        (
            {"lora": {"adapters": [{"name": "nightly", "port": 50062}]}},
            '"nightly" has a port and no path, so no pod loads it at start (load it later:'
            " tandem lora load), and that needs lora.enabled=true",
        ),
        (_with_ports(0), "at '/lora/adapters/0/port': minimum: got 0, want 1"),
        (_with_ports(65536), "at '/lora/adapters/0/port': maximum: got 65,536, want 65,535"),
        (
            {"lora": {"enabled": True, "adapters": [{"port": 50061}]}},
            "at '/lora/adapters/0': missing property 'name'",
        ),
        (
            {"lora": {"enabled": True, "adapters": [{"name": "a"}]}},
            "at '/lora/adapters/0': 'anyOf' failed",
        ),
        (
            {"lora": {"enabled": True, "adapters": [{"name": "a", "port": "50061"}]}},
            "at '/lora/adapters/0/port': got string, want integer",
        ),
    ],
)
def test_what_the_chart_refuses(values: dict[str, Any], message: str) -> None:
    error = render_error(values)
    assert message in error
    if "is also" in message:
        assert CLASH in error


def test_ports_that_only_look_close_render() -> None:
    """Neighbouring ports, and the central smg's own ports (another pod)."""
    objects = render(_with_ports(50052, 8000, 8001, gateway={"kind": "smg"}))
    assert _serve(objects, "decode").lora_port == [("a0", 50052), ("a1", 8000), ("a2", 8001)]
