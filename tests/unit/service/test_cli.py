"""The CLI's parsing: every engine knob reaches the config; help explains flags."""

from __future__ import annotations

import argparse

import pytest

from service import cli
from service.server import ServerConfig


def _serve_args(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(["serve", *argv])


def test_serve_flags_reach_the_engine_config() -> None:
    args = _serve_args(
        "--dtype", "bfloat16", "--kv-cache-memory", "512M", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--block-size", "32", "--no-prefix-caching",
        "--scheduling-policy", "priority", "--max-model-len", "1024",
    )  # fmt: skip
    config = cli.engine_config_from_args(args)
    assert config.model.dtype == "bfloat16"
    assert config.model.kv_cache_memory == 512 * 2**20
    assert config.model.max_model_len == 1024
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.policy == "priority"
    assert config.scheduler.max_num_batched_tokens == 256
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.cache.enable_kv_events


def test_serve_defaults() -> None:
    args = _serve_args()
    assert (args.host, args.port, args.role) == ("127.0.0.1", 50051, "both")
    assert args.model is None  # the embedded default model


@pytest.mark.parametrize(("text", "value"), [("2G", 2**31), ("1.5k", 1536), ("4096", 4096)])
def test_sizes(text: str, value: int) -> None:
    assert cli._bytes(text) == value


def test_bad_size_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--kv-cache-memory", "lots")
    assert "'lots' is not a size" in capsys.readouterr().err


def test_every_flag_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli._parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():  # type: ignore[union-attr]
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"tandem {name} {action.option_strings}: no help"


def test_invalid_server_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerConfig(tls_cert=__import__("pathlib").Path("x.pem"))
    with pytest.raises(ValueError, match="max_waiting_requests"):
        ServerConfig(max_waiting_requests=0)
