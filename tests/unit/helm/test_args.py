"""The rendered containers run what the tandem CLI accepts, listen where the
probes, Services and the router look, and get the time they need to drain.

Arguments are expanded as Kubernetes expands them ($(POD_IP),
$(REDIS_PASSWORD)) and then parsed by the real `tandem` parser."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest

from engine.kv_transfer.registry import known_connectors
from service import cli
from service import router as router_module
from service import server as server_module
from service.server import ServerConfig
from tests.unit.helm.chart import (
    FULLNAME,
    NAMESPACE,
    VARIANTS,
    Obj,
    container,
    container_env,
    expand,
    expanded_args,
    find,
    label_selector_matches,
    pod_spec,
    render,
    tandem_workloads,
)

VARIANT_NAMES = sorted(VARIANTS)
WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]"}


def parse(args: list[str]) -> argparse.Namespace:
    """The tandem CLI's own parsing; a refusal fails the test with its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli._parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"tandem refuses {args}:\n{err.getvalue()}")


def _parsed(variant: str) -> list[tuple[Obj, Obj, argparse.Namespace]]:
    objects = render(VARIANTS[variant])
    return [(d, c, parse(expanded_args(objects, c))) for d, c in tandem_workloads(objects)]


def _pools(variant: str) -> dict[str, tuple[Obj, Obj, argparse.Namespace]]:
    return {
        d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): (d, c, a)
        for d, c, a in _parsed(variant)
        if a.command == "serve"
    }


def _router(variant: str) -> tuple[Obj, Obj, argparse.Namespace]:
    (found,) = [(d, c, a) for d, c, a in _parsed(variant) if a.command == "router"]
    return found


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_every_tandem_container_parses(variant: str) -> None:
    parsed = _parsed(variant)
    commands = sorted(a.command for _, _, a in parsed)
    assert commands == ["router", "serve", "serve"]
    objects = render(VARIANTS[variant])
    for _, c, _ in parsed:
        left = [a for a in expanded_args(objects, c) if "$(" in a]
        assert not left, f"undefined variables stay unexpanded: {left}"


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_pools_serve_their_role_with_a_known_connector(variant: str) -> None:
    pools = _pools(variant)
    assert set(pools) == {"prefill", "decode"}
    for name, (_, _, args) in pools.items():
        assert args.role == name
        # The CLI's own checks: the role matches the connector's direction,
        # and every engine knob makes a valid EngineConfig.
        engine = cli.engine_config_from_args(args)
        kv = engine.kv_transfer
        assert kv is not None
        assert kv.kv_role == ("kv_producer" if name == "prefill" else "kv_consumer")
        assert kv.kv_connector == VARIANTS[variant].get("kvTransfer", {}).get("connector", "redis")
        assert kv.kv_connector in known_connectors()
        ServerConfig(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            drain_grace_seconds=args.drain_grace,
            max_waiting_requests=args.max_waiting_requests,
        )


def test_engine_values_reach_the_flags() -> None:
    pools = _pools("everything")
    prefill = cli.engine_config_from_args(pools["prefill"][2])
    decode = cli.engine_config_from_args(pools["decode"][2])
    objects = render(VARIANTS["everything"])
    for name, config in (("prefill", prefill), ("decode", decode)):
        args = expanded_args(objects, pools[name][1])
        # float32, the CLI's default too (int8 weights need it): given all the same.
        assert args[args.index("--dtype") + 1] == "float32"
        assert config.model.dtype == "float32" and config.model.device == "cpu"
        assert config.model.quantization == "int8"
        assert config.model.max_model_len == 2048
        assert config.model.kv_cache_memory == 2 * 2**30
        assert config.model.kv_cache_dtype == "bfloat16"
        assert config.scheduler.async_scheduling
        assert config.cache.block_size == 32
        assert not config.cache.enable_kv_events  # engine.extraArgs
        kv = config.kv_transfer
        assert kv is not None and kv.kv_load_failure_policy == "fail"
        assert kv.kv_connector_extra_config["ttl_seconds"] == 600
        assert kv.kv_connector_extra_config["key_prefix"] == "prod:"  # extraConfig wins
    # Pool overrides win over engine; the rest is inherited.
    assert prefill.scheduler.max_num_batched_tokens == 16384
    assert not prefill.scheduler.enable_chunked_prefill  # prefill.engine.extraArgs
    assert decode.scheduler.enable_chunked_prefill
    assert decode.scheduler.max_num_batched_tokens == 1_000_000
    assert (prefill.scheduler.max_num_seqs, decode.scheduler.max_num_seqs) == (64, 512)
    # Three states: the flag alone where true; a pool's false wins over
    # engine's true and says false (unset would mean on for GGUF blocks on
    # CPU: engine/numerics.py).
    assert prefill.model.int8_activations and decode.model.int8_activations is False
    decode_args = expanded_args(objects, pools["decode"][1])
    assert decode_args[decode_args.index("--int8-activations") + 1] == "false"
    assert "--int8-activations" in expanded_args(objects, pools["prefill"][1])
    assert (pools["prefill"][2].port, pools["decode"][2].port) == (50051, 50061)
    assert pools["decode"][2].log_level == "debug"


def test_kv_events_values_reach_the_flags() -> None:
    values = {
        "engine": {"kvEventsEndpoint": "tcp://kv-indexer:5557", "kvEventsTopic": "kv@pool@m"},
        "decode": {"engine": {"kvEventsReplayEndpoint": "tcp://*:5558"}},
    }
    objects = render(values)
    pools = {
        d["metadata"]["name"].removeprefix(f"{FULLNAME}-"): parse(expanded_args(objects, c))
        for d, c in tandem_workloads(objects)
    }
    prefill = cli.kv_events_from_args(pools["prefill"])
    decode = cli.kv_events_from_args(pools["decode"])
    assert prefill is not None and decode is not None
    assert (prefill.endpoint, prefill.topic, prefill.replay_endpoint) == (
        "tcp://kv-indexer:5557",
        "kv@pool@m",
        None,
    )
    assert decode.replay_endpoint == "tcp://*:5558"
    assert cli.kv_events_from_args(_pools("default")["decode"][2]) is None


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_probes_and_ports_are_where_the_servers_listen(variant: str) -> None:
    for name, (_, c, args) in _pools(variant).items():
        # The kubelet probes the pod IP, and Prometheus scrapes it.
        assert args.host in WILDCARD_HOSTS, name
        assert args.metrics_host in WILDCARD_HOSTS, name
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": args.port, "metrics": args.metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if args.tls_cert is not None:
                # The kubelet's gRPC probe speaks plaintext: a TLS port is
                # only checked to listen.
                assert c[probe]["tcpSocket"] == {"port": args.port}, (name, probe)
                continue
            grpc_probe = c[probe]["grpc"]
            assert grpc_probe["port"] == args.port, (name, probe)
            # The name the server reports in grpc.health.v1 (NOT_SERVING while loading).
            assert grpc_probe["service"] == server_module.SERVICE_NAME
    _, c, args = _router(variant)
    assert args.host in WILDCARD_HOSTS
    assert args.metrics_host in WILDCARD_HOSTS
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    if args.tls_cert is not None:
        assert c["readinessProbe"]["tcpSocket"] == {"port": args.port}
    else:
        assert c["readinessProbe"]["grpc"] == {
            "port": args.port,
            "service": router_module.SERVICE_NAME,
        }
    assert c["livenessProbe"]["tcpSocket"]["port"] == args.port


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_the_router_reaches_every_pool_through_its_headless_service(variant: str) -> None:
    objects = render(VARIANTS[variant])
    _, _, args = _router(variant)
    config = cli.router_config_from_args(args)
    pools = _pools(variant)
    for name, addresses in (("prefill", config.prefill), ("decode", config.decode)):
        (address,) = addresses
        host, _, port = address.rpartition(":")
        service = find(objects, "Service", f"{FULLNAME}-{name}")
        assert host == f"{FULLNAME}-{name}.{NAMESPACE}.svc.cluster.local"
        assert service["spec"]["clusterIP"] == "None"  # DNS answers with every pod
        deployment, c, pod_args = pools[name]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert label_selector_matches({"matchLabels": service["spec"]["selector"]}, labels)
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert int(port) == grpc_port["port"] == pod_args.port
        target = grpc_port["targetPort"]
        assert target in {p["name"] for p in c["ports"] if p["containerPort"] == pod_args.port}
    router_service = find(objects, "Service", f"{FULLNAME}-router")
    router_deployment = find(objects, "Deployment", f"{FULLNAME}-router")
    assert label_selector_matches(
        {"matchLabels": router_service["spec"]["selector"]},
        router_deployment["spec"]["template"]["metadata"]["labels"],
    )
    ports = {p["name"]: p for p in router_service["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics"}
    named = {p["name"]: p["containerPort"] for p in container(router_deployment)["ports"]}
    assert named[ports["grpc"]["targetPort"]] == args.port
    assert named[ports["metrics"]["targetPort"]] == args.metrics_port


@pytest.mark.parametrize("variant", ["default", "everything"])
def test_termination_grace_outlasts_the_drain(variant: str) -> None:
    for name, (deployment, _, args) in _pools(variant).items():
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace > args.drain_grace, name
        assert grace == math.ceil(args.drain_grace) + 15
    assert _pools("everything")["decode"][2].drain_grace == 12.5
    router, c, _ = _router(variant)
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    # The router stops its server with 5 s of grace after the preStop sleep.
    assert pod_spec(router)["terminationGracePeriodSeconds"] > int(sleep[1]) + 5


def test_kv_transfer_config_is_one_json_argument() -> None:
    """The JSON survives YAML quoting intact; Kubernetes' expansion changes
    only the $(REDIS_PASSWORD) in it."""
    objects = render()
    for _, c, args in _pools("default").values():
        raw = c["args"][c["args"].index("--kv-transfer-config") + 1]
        data = json.loads(raw)
        assert set(data) == {"kv_connector", "kv_role", "kv_connector_extra_config"}
        extra = data["kv_connector_extra_config"]
        assert "$(REDIS_PASSWORD)" in extra["url"]
        extra["url"] = expand(extra["url"], container_env(objects, c))
        assert args.kv_transfer_config.kv_connector_extra_config == extra
