"""`tandem gateway`: the smg flags it spells, and what it refuses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import ConfigError
from service import cli, gateway
from service.gateway import GatewayConfig, smg_args


def _config(argv: list[str]) -> GatewayConfig:
    args = cli._parser().parse_args(["gateway", *argv])
    return gateway.config_from_args(args)


def _flag(args: list[str], name: str) -> list[str]:
    """The values after `name`, up to the next flag."""
    i = args.index(name)
    values = []
    for value in args[i + 1 :]:
        if value.startswith("--"):
            break
        values.append(value)
    return values


def test_colocated_pods_are_worker_urls_with_cache_aware_routing() -> None:
    args = smg_args(_config(["--worker", "10.0.0.1:50051", "--worker", "grpc://h:1"]))
    assert args[0] == "launch"
    assert _flag(args, "--worker-urls") == ["grpc://10.0.0.1:50051", "grpc://h:1"]
    assert _flag(args, "--policy") == ["cache_aware"]
    assert _flag(args, "--backend") == ["vllm"]
    assert "--pd-disaggregation" not in args


def test_pd_pools_with_their_policies_and_cpu_friendly_bounds() -> None:
    argv = ["--prefill", "p:1", "--decode", "d:2", "--decode", "d:3", "--port", "8100"]
    args = smg_args(_config(argv))
    assert "--pd-disaggregation" in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--prefill"] == ["grpc://p:1"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--decode"] == [
        "grpc://d:2",
        "grpc://d:3",
    ]
    assert _flag(args, "--prefill-policy") == ["cache_aware"]
    assert _flag(args, "--decode-policy") == ["least_load"]
    assert _flag(args, "--port") == ["8100"]
    assert _flag(args, "--worker-wedge-secs") == ["30"]
    assert _flag(args, "--worker-stall-secs") == ["10"]
    assert "--worker-urls" not in args


def test_args_after_a_double_dash_go_to_smg_last() -> None:
    args = smg_args(_config(["--worker", "a:1", "--", "--max-concurrent-requests", "9"]))
    assert args[-2:] == ["--max-concurrent-requests", "9"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "name at least one pod"),
        (["--prefill", "p:1"], "give both"),
        (["--worker", "a:1", "--prefill", "p:1", "--decode", "d:1"], "not both"),
        (["--worker", "http://a:1"], "speak gRPC"),
        (["--worker", "nohost"], "expected host:port"),
        (["--worker", "a:1", "--policy", "fastest"], "--policy: expected one of"),
    ],
)
def test_bad_flags_are_config_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        smg_args(_config(argv))


def test_smg_parses_the_flags_it_is_given() -> None:
    """smg's own parser (its Python launcher) takes every flag spelled."""
    args = smg_args(_config(["--prefill", "p:1", "--decode", "d:2"]))
    code = (
        "import sys; from smg.launch_router import parse_router_args; "
        "parse_router_args(sys.argv[1:])"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *args[1:]], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr


def test_the_cli_refuses_bad_flags_on_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "gateway", "--prefill", "p:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    want = "tandem gateway: --prefill and --decode: give both (P/D) or neither"
    assert run.stderr.strip() == want
