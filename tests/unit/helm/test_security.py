"""API keys and TLS come from the user's Secrets: keys as environment
variables (never in args), TLS material as read-only mounts the servers'
flags point into; the router gets what it needs to reach the pools (their
key, their CA only, a client certificate) and nothing more."""

from __future__ import annotations

import argparse
import os
from pathlib import PurePosixPath
from typing import Any
from unittest import mock

import pytest

from service import cli
from tests.unit.helm.chart import (
    FULLNAME,
    VARIANTS,
    Obj,
    container,
    container_env,
    expanded_args,
    find,
    pod_spec,
    render,
    render_error,
)

SECURED = VARIANTS["secured"]


def _parse(objects: list[Obj], c: Obj) -> argparse.Namespace:
    """The container's args, parsed as `tandem` parses them in the pod: the
    parser reads its key flags' defaults from the container's environment."""
    with mock.patch.dict(os.environ, container_env(objects, c), clear=True):
        return cli._parser().parse_args(expanded_args(objects, c))


def _workloads(values: dict[str, Any]) -> dict[str, tuple[Obj, Obj, argparse.Namespace]]:
    objects = render(values)
    found = {}
    for name in ("prefill", "decode", "router"):
        workload = find(objects, "Deployment", f"{FULLNAME}-{name}")
        c = container(workload)
        found[name] = (workload, c, _parse(objects, c))
    return found


def _mounted_from(workload: Obj, c: Obj, path: PurePosixPath) -> tuple[str, str]:
    """(Secret name, key) a file in the container comes from; fails if it is
    not on a read-only Secret mount."""
    for mount in c.get("volumeMounts", []):
        root = PurePosixPath(mount["mountPath"])
        if path.parent == root:
            assert mount.get("readOnly"), mount
            (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
            secret = volume["secret"]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            if items:
                assert path.name in items, f"{path} is not among {items}"
            return secret["secretName"], items.get(path.name, path.name)
    raise AssertionError(f"{path} is on no volume mount")


def test_keys_come_from_the_secrets_as_environment() -> None:
    objects = render(SECURED)
    found = _workloads(SECURED)
    for name in ("prefill", "decode"):
        _, c, args = found[name]
        assert args.api_key == "from-pools-key-api-key", name
    _, c, args = found["router"]
    assert args.api_key == "from-clients-key-token"  # what clients must send
    assert args.pod_api_key == "from-pools-key-api-key"  # what the pods require
    for _, c, _ in found.values():
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
        assert all("key" in ref and "name" in ref for ref in refs.values())
        assert not any("from-" in a for a in expanded_args(objects, c)), "a key in the args"


def test_tls_material_is_mounted_where_the_flags_point() -> None:
    found = _workloads(SECURED)
    for name in ("prefill", "decode"):
        workload, c, args = found[name]
        assert _mounted_from(workload, c, PurePosixPath(args.tls_cert)) == ("pools-tls", "tls.crt")
        assert _mounted_from(workload, c, PurePosixPath(args.tls_key)) == ("pools-tls", "tls.key")
        assert _mounted_from(workload, c, PurePosixPath(args.tls_client_ca)) == (
            "pools-tls",
            "ca.crt",
        )
    workload, c, args = found["router"]
    assert _mounted_from(workload, c, PurePosixPath(args.tls_cert)) == ("router-tls", "tls.crt")
    assert _mounted_from(workload, c, PurePosixPath(args.tls_key)) == ("router-tls", "tls.key")
    assert _mounted_from(workload, c, PurePosixPath(args.tls_client_ca)) == ("router-tls", "ca.crt")
    assert _mounted_from(workload, c, PurePosixPath(args.pod_tls_ca)) == ("pools-tls", "ca.crt")
    client = ("router-client-tls", "tls.crt")
    assert _mounted_from(workload, c, PurePosixPath(args.pod_tls_cert)) == client
    client_key = ("router-client-tls", "tls.key")
    assert _mounted_from(workload, c, PurePosixPath(args.pod_tls_key)) == client_key
    # The pods are dialled by IP: their certificate is checked for this name.
    assert args.pod_tls_server_name == f"{FULLNAME}-pools"
    # The router sees the pools' CA, never their private key.
    (pods_ca,) = [
        v
        for v in pod_spec(workload)["volumes"]
        if v.get("secret", {}).get("secretName") == "pools-tls"
    ]
    assert pods_ca["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # The whole set makes a valid router configuration.
    config = cli.router_config_from_args(args)
    assert config.tls.client_ca is not None and config.pods.tls.cert is not None


def test_without_secrets_nothing_is_mounted_or_required() -> None:
    for name, (workload, c, args) in _workloads({}).items():
        assert (args.api_key, args.tls_cert, args.tls_client_ca) == (None, None, None), name
        assert not [v for v in pod_spec(workload)["volumes"] if "secret" in v], name
        assert "TANDEM_API_KEY" not in {e["name"] for e in c.get("env", [])}, name
    args = _workloads({})["router"][2]
    assert (args.pod_api_key, args.pod_tls_ca, args.pod_tls_server_name) == (None, None, None)


def test_tls_without_client_certificates_and_a_named_server() -> None:
    values = {"tls": {"pools": {"existingSecret": "p", "serverName": "pods.example"}}}
    found = _workloads(values)
    assert found["prefill"][2].tls_client_ca is None
    router = found["router"][2]
    assert router.pod_tls_server_name == "pods.example"
    assert router.pod_tls_ca is not None and router.pod_tls_cert is None
    assert router.tls_cert is None  # the router's own port stays plaintext


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"tls": {"pools": {"existingSecret": "p", "clientAuth": True}}},
            "at '/tls/pools/clientSecret'",
        ),
        ({"tls": {"router": {"clientAuth": True}}}, "at '/tls/router/existingSecret'"),
        (
            {"kvTransfer": {"connector": "nixl"}, "auth": {"pools": {"existingSecret": "k"}}},
            "auth.pools and tls.pools are not supported with kvTransfer.connector=nixl",
        ),
    ],
)
def test_incomplete_or_unsupported_settings_fail(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)
