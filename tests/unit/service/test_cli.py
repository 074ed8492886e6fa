"""The CLI's parsing: every engine knob reaches the config; help explains flags."""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.config import ConfigError, LoRAConfig, SpeculativeConfig
from service import cli
from service.client import make_request
from service.gen.tandem.v1 import generation_pb2 as pb
from service.server import ServerConfig


def _serve_args(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(["serve", *argv])


def test_serve_flags_reach_the_engine_config() -> None:
    args = _serve_args(
        "--dtype", "bfloat16", "--kv-cache-memory", "512M", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--block-size", "32", "--no-prefix-caching",
        "--scheduling-policy", "priority", "--max-model-len", "1024", "--async-scheduling",
    )  # fmt: skip
    config = cli.engine_config_from_args(args)
    assert config.scheduler.async_scheduling
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
    assert not cli.engine_config_from_args(args).scheduler.async_scheduling  # off by default


def test_quantization_flags_reach_the_model_config() -> None:
    model = cli.engine_config_from_args(_serve_args()).model
    # Unset: resolved for the weights when they load (engine/numerics.py).
    assert (model.quantization, model.int8_activations) == ("auto", None)
    assert (model.exact, model.kv_cache_dtype) == (False, "auto")
    for choice in ("none", "gguf", "int8"):
        model = cli.engine_config_from_args(_serve_args("--quantization", choice)).model
        assert (model.quantization, model.int8_activations) == (choice, None)
    args = _serve_args("--quantization", "int8", "--int8-activations")
    model = cli.engine_config_from_args(args).model
    assert (model.quantization, model.int8_activations) == ("int8", True)


@pytest.mark.parametrize(
    ("flags", "exact", "int8_activations"),
    [
        (["--exact"], True, None),
        (["--int8-activations", "false"], False, False),
        (["--int8-activations", "true"], False, True),
        (["--exact", "--int8-activations", "off"], True, False),
    ],
)
def test_exact_and_int8_activations_flags(
    flags: list[str], exact: bool, int8_activations: bool | None
) -> None:
    model = cli.engine_config_from_args(_serve_args(*flags)).model
    assert (model.exact, model.int8_activations) == (exact, int8_activations)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--int8-activations", "true"], "int8_activations=True is invalid: expected false"),
        (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype='bfloat16' is invalid: expected 'auto'"),
    ],
)
def test_exact_beside_a_lossy_setting_is_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cli.engine_config_from_args(_serve_args("--exact", *flags))


def test_a_bad_int8_activations_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--int8-activations", "maybe")
    assert "'maybe' is not true or false" in capsys.readouterr().err


def test_an_unknown_quantization_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--quantization", "q4")
    assert "invalid choice: 'q4'" in capsys.readouterr().err


def test_bench_passes_the_quantization_flags_to_its_server() -> None:
    from service import bench

    args = cli._parser().parse_args(["bench"])
    assert (args.quantization, args.exact, args.int8_activations) == ("auto", False, None)
    command = bench._server_command(args, 50099)
    assert command[command.index("--quantization") + 1] == "auto"
    assert "--int8-activations" not in command and "--model" not in command
    assert "--exact" not in command
    args = cli._parser().parse_args(
        ["bench", "--model", "/m", "--quantization", "int8", "--int8-activations"]
    )
    served = cli._parser().parse_args(bench._server_command(args, 50099)[3:])
    assert served.command == "serve" and served.port == 50099 and served.model == "/m"
    model = cli.engine_config_from_args(served).model
    assert (model.quantization, model.int8_activations) == ("int8", True)
    args = cli._parser().parse_args(["bench", "--exact", "--int8-activations", "false"])
    served = cli._parser().parse_args(bench._server_command(args, 50099)[3:])
    model = cli.engine_config_from_args(served).model
    assert (model.exact, model.int8_activations) == (True, False)


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


def test_kv_transfer_config_flag() -> None:
    config = cli.engine_config_from_args(
        _serve_args(
            "--kv-transfer-config",
            '{"kv_connector": "redis", "kv_role": "kv_producer", '
            '"kv_connector_extra_config": {"url": "redis://h:1/0"}}',
            "--role",
            "prefill",
        )
    )
    assert config.kv_transfer is not None
    assert config.kv_transfer.kv_connector == "redis"
    assert config.kv_transfer.kv_role == "kv_producer"
    assert config.kv_transfer.kv_connector_extra_config == {"url": "redis://h:1/0"}


def test_bad_kv_transfer_config_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--kv-transfer-config", '{"kv_connector": "redis", "kv_rol": "kv_both"}')
    assert "unknown keys ['kv_rol']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("offload", "connector"), [("shm", "shm"), ("redis", "redis"), ("shm,redis", "multi")]
)
def test_kv_offload_shorthand(offload: str, connector: str) -> None:
    config = cli.engine_config_from_args(
        _serve_args("--kv-offload", offload, "--kv-offload-redis-url", "redis://r:7/1")
    )
    kv = config.kv_transfer
    assert kv is not None and kv.kv_connector == connector and kv.kv_role == "kv_both"
    if connector == "multi":
        tiers = kv.kv_connector_extra_config["connectors"]
        assert [t["kv_connector"] for t in tiers] == ["shm", "redis"]
        assert tiers[1]["kv_connector_extra_config"] == {"url": "redis://r:7/1"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "decode"], "--role decode needs a KV connector"),
        (
            [
                "--role",
                "decode",
                "--kv-transfer-config",
                '{"kv_connector": "shm", "kv_role": "kv_producer"}',
            ],
            "--role decode needs kv_role kv_consumer or kv_both",
        ),
        (
            [
                "--role",
                "prefill",
                "--kv-transfer-config",
                '{"kv_connector": "shm", "kv_role": "kv_consumer"}',
            ],
            "--role prefill needs kv_role kv_producer or kv_both",
        ),
        (
            ["--kv-offload", "shm", "--kv-transfer-config", '{"kv_connector": "shm"}'],
            "give one, not both",
        ),
    ],
)
def test_kv_role_mismatch_is_a_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cli.engine_config_from_args(_serve_args(*argv))


def test_kv_load_failure_policy_flag() -> None:
    config = cli.engine_config_from_args(
        _serve_args("--kv-offload", "redis", "--kv-load-failure-policy", "fail")
    )
    assert config.kv_transfer is not None
    assert config.kv_transfer.kv_load_failure_policy == "fail"
    with pytest.raises(ConfigError, match="--kv-load-failure-policy needs a KV connector"):
        cli.engine_config_from_args(_serve_args("--kv-load-failure-policy", "fail"))


def test_kv_lease_and_transfer_timeout_flags() -> None:
    nixl = '{"kv_connector": "nixl", "kv_role": "kv_producer"}'
    config = cli.engine_config_from_args(
        _serve_args(
            "--role",
            "prefill",
            "--kv-transfer-config",
            nixl,
            "--kv-lease-seconds",
            "5",
            "--kv-transfer-timeout",
            "9.5",
        )
    )
    assert config.kv_transfer is not None
    assert (config.kv_transfer.kv_lease_seconds, config.kv_transfer.kv_transfer_timeout) == (5, 9.5)
    with pytest.raises(ConfigError, match="--kv-lease-seconds needs a KV connector"):
        cli.engine_config_from_args(_serve_args("--kv-lease-seconds", "5"))
    with pytest.raises(ConfigError, match=r"kv_lease_seconds=0\.0 is invalid: expected seconds"):
        cli.engine_config_from_args(
            _serve_args("--kv-transfer-config", nixl, "--kv-lease-seconds", "0")
        )


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
            SpeculativeConfig("ngram", 3, prompt_lookup_max=4),
        ),
        (
            '{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 5}',
            SpeculativeConfig("draft_model", 5, model="/models/draft"),
        ),
        # vLLM infers the method from the keys given.
        ('{"model": "/models/draft"}', SpeculativeConfig("draft_model", model="/models/draft")),
    ],
)
def test_speculative_config_flag(text: str, want: SpeculativeConfig) -> None:
    config = cli.engine_config_from_args(_serve_args("--speculative-config", text))
    assert config.speculative == want


def test_no_speculative_config_is_no_speculation() -> None:
    assert cli.engine_config_from_args(_serve_args()).speculative is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "ngram",', "speculative_config is not valid JSON"),
        ("[3]", "speculative_config='[3]' is invalid: expected a JSON object"),
        ('{"num_speculative_tokens": 3, "num_spec": 2}', "unknown keys ['num_spec']"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens=0 is invalid"),
        ('{"method": "ngram", "model": "/m"}', "model='/m' is invalid"),
        ('{"method": "medusa"}', "method='medusa' is invalid"),
    ],
)
def test_bad_speculative_config_is_a_clear_error(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _serve_args("--speculative-config", text)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config" in err and message in err


def test_speculative_config_of_the_wrong_type_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A TypeError inside the config's checks is still an argparse error, not a traceback.
    with pytest.raises(SystemExit):
        _serve_args("--speculative-config", '{"prompt_lookup_min": "1"}')
    assert "argument --speculative-config" in capsys.readouterr().err


def test_a_prefill_pod_drops_the_speculative_config(caplog: pytest.LogCaptureFixture) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    producer = '{"kv_connector": "shm", "kv_role": "kv_producer"}'
    with caplog.at_level(logging.INFO, logger="service.cli"):
        prefill = cli.engine_config_from_args(
            _serve_args(
                "--role", "prefill", "--kv-transfer-config", producer, "--speculative-config", spec
            )
        )
    assert prefill.speculative is None
    assert prefill.kv_transfer is not None  # only the speculation is dropped
    assert "--role prefill: ignoring --speculative-config" in caplog.text
    consumer = '{"kv_connector": "shm", "kv_role": "kv_consumer"}'
    decode = cli.engine_config_from_args(
        _serve_args(
            "--role", "decode", "--kv-transfer-config", consumer, "--speculative-config", spec
        )
    )
    assert decode.speculative == SpeculativeConfig("ngram", 3)


def test_status_shows_speculation_figures() -> None:
    spec = pb.SpecDecodingStatus(
        num_drafts=10,
        num_draft_tokens=30,
        num_accepted_tokens=18,
        num_accepted_tokens_per_pos=[8, 6, 4],
    )
    assert cli._spec_decoding_line(spec) == (
        "speculate  18/30 draft tokens accepted (60.0%); mean acceptance length 2.80 "
        "over 10 drafts; by position 0.80, 0.60, 0.40"
    )
    # Speculating but no draft verified yet: zeros, not a division by zero.
    idle = pb.SpecDecodingStatus(num_accepted_tokens_per_pos=[0, 0])
    assert cli._spec_decoding_line(idle) == (
        "speculate  0/0 draft tokens accepted (0.0%); mean acceptance length 0.00 "
        "over 0 drafts; by position 0.00, 0.00"
    )


def test_status_shows_degradations_only_when_there_are_some() -> None:
    from service.gen.tandem.v1 import generation_pb2 as pb

    assert cli._degradation_lines(pb.ServerStatus()) == []
    status = pb.ServerStatus(
        kv_recomputed_tokens=84,
        kv_transfer_failures={"peer_unreachable": 2, "missing": 1},
        kv_leases_lapsed=3,
        metrics_errors=1,
    )
    assert cli._degradation_lines(status) == [
        "kv faults  84 prompt tokens recomputed; transfer failures: missing 1, peer_unreachable 2",
        "kv holds   0 held for a peer; 3 freed unread (lease lapsed)",
        "metrics    1 updates raised (see the server log)",
    ]


def test_kv_events_flags_reach_the_server_config() -> None:
    args = _serve_args(
        "--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558",
        "--kv-events-topic", "kv@pod@model", "--kv-events-buffer-steps", "50",
    )  # fmt: skip
    config = cli.kv_events_from_args(args)
    assert config is not None
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert (config.topic, config.buffer_steps) == ("kv@pod@model", 50)
    defaults = cli.kv_events_from_args(_serve_args("--kv-events-endpoint", "tcp://*:5557"))
    assert defaults is not None and (defaults.topic, defaults.buffer_steps) == ("", 10_000)
    assert cli.kv_events_from_args(_serve_args()) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-events-topic", "t"], "--kv-events-topic needs --kv-events-endpoint"),
        (
            ["--kv-events-replay-endpoint", "tcp://*:5558", "--kv-events-buffer-steps", "5"],
            "--kv-events-replay-endpoint, --kv-events-buffer-steps needs --kv-events-endpoint",
        ),
        (
            ["--kv-events-endpoint", "tcp://*:5557", "--no-kv-events"],
            "--kv-events-endpoint publishes the KV cache events that --no-kv-events turns off",
        ),
    ],
)
def test_kv_events_flag_conflicts(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cli.kv_events_from_args(_serve_args(*argv))


def test_bad_kv_events_endpoint_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--kv-events-endpoint", "localhost:5557"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tandem serve: --kv-events-endpoint: 'localhost:5557' is not a ZMQ")


class _RecordingClient:
    """Stands in for TandemClient: keeps the request `generate` would send."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def __aenter__(self) -> _RecordingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def generate(self, **kwargs: Any) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(make_request(**kwargs))
        yield pb.GenerateResponse(token_ids=[1], text="ok", usage=pb.Usage(completion_tokens=1))


def test_generate_sampling_flags_reach_the_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client = _RecordingClient()
    monkeypatch.setattr(cli, "_client", lambda args: client)
    args = cli._parser().parse_args(
        ["generate", "hi", "--presence-penalty", "0.5", "--frequency-penalty", "-1",
         "--repetition-penalty", "1.25", "--min-p", "0.125"]
    )  # fmt: skip
    assert args.run(args) == 0
    sampling = client.requests[0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == 1.25 and sampling.min_p == 0.125
    assert "ok" in capsys.readouterr().out
    # Unset flags leave the fields unset (the server's defaults apply).
    assert args.run(cli._parser().parse_args(["generate", "hi"])) == 0
    plain = client.requests[1].sampling
    assert not plain.HasField("repetition_penalty") and plain.presence_penalty == 0.0


def test_generate_sends_the_cache_salt_and_the_stop_string_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = _RecordingClient()
    monkeypatch.setattr(cli, "_client", lambda args: client)
    argv = ["generate", "hi", "--cache-salt", "t1", "--stop", "x", "--include-stop-str-in-output"]
    args = cli._parser().parse_args(argv)
    assert args.run(args) == 0
    sent = client.requests[0]
    assert sent.cache_salt == "t1" and list(sent.sampling.stop) == ["x"]
    assert sent.sampling.include_stop_str_in_output


class _StatusClient:
    """Stands in for TandemClient: answers `tandem status`'s two calls."""

    def __init__(self, status: pb.ServerStatus, info: pb.ModelInfo | None = None) -> None:
        self._status = status
        self._info = info or pb.ModelInfo(model_name="m", role="both")

    async def __aenter__(self) -> _StatusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def model_info(self) -> pb.ModelInfo:
        return self._info

    async def status(self) -> pb.ServerStatus:
        return self._status


@pytest.mark.parametrize("speculating", [False, True])
def test_status_prints_speculation_only_when_the_server_speculates(
    speculating: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status = pb.ServerStatus(num_running=1)
    if speculating:
        status.spec_decoding.num_accepted_tokens_per_pos.extend([0, 0, 0])
    monkeypatch.setattr(cli, "_client", lambda args: _StatusClient(status))
    args = cli._parser().parse_args(["status"])
    assert args.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("requests   1 running") for line in lines)
    speculate = [line for line in lines if line.startswith("speculate")]
    assert len(speculate) == int(speculating)


@pytest.mark.parametrize(
    ("weight_format", "line"),
    [
        ("q4_1+q8_0", "model      m (LlamaForCausalLM, float32; weights q4_1+q8_0)"),
        ("", "model      m (LlamaForCausalLM, float32)"),  # an older server says none
    ],
)
def test_status_prints_the_weight_format(
    weight_format: str,
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    info = pb.ModelInfo(
        model_name="m",
        architecture="LlamaForCausalLM",
        dtype="float32",
        role="both",
        weight_format=weight_format,
    )
    status = pb.ServerStatus(weight_format=weight_format)
    monkeypatch.setattr(cli, "_client", lambda args: _StatusClient(status, info))
    args = cli._parser().parse_args(["status"])
    assert args.run(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == line


@pytest.mark.parametrize(
    ("numerics", "line"),
    [
        ("fast (default)", "numerics   fast (default): int8 activations, bfloat16 KV cache"),
        ("", None),  # an older server says nothing
    ],
)
def test_status_prints_which_path_runs(
    numerics: str,
    line: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    info = pb.ModelInfo(
        model_name="m",
        numerics=numerics,
        activations="int8" if numerics else "",
        kv_cache_dtype="bfloat16" if numerics else "",
    )
    monkeypatch.setattr(cli, "_client", lambda args: _StatusClient(pb.ServerStatus(), info))
    args = cli._parser().parse_args(["status"])
    assert args.run(args) == 0
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("numerics")]
    assert lines == ([line] if line else [])


# --- LoRA --------------------------------------------------------------------------


def test_lora_flags_reach_the_engine_config() -> None:
    assert cli.engine_config_from_args(_serve_args()).lora is None
    on = cli.engine_config_from_args(_serve_args("--enable-lora"))
    assert on.lora == LoRAConfig()
    tuned = cli.lora_from_args(
        _serve_args("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
                    "--max-cpu-loras", "3")
    )  # fmt: skip
    assert tuned == LoRAConfig(max_loras=2, max_lora_rank=64, max_cpu_loras=3)
    # The host cache defaults to at least one step's adapters.
    assert cli.lora_from_args(_serve_args("--enable-lora", "--max-loras", "32")) == LoRAConfig(
        max_loras=32, max_cpu_loras=32
    )


def test_lora_modules_imply_enable_lora() -> None:
    args = _serve_args("--lora-modules", "a=/x/a", "b=/y=z", "--max-loras", "2")
    assert args.lora_modules == [("a", "/x/a"), ("b", "/y=z")]
    assert cli.lora_from_args(args) == LoRAConfig(max_loras=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-loras", "2"], "tandem serve: --max-loras needs --enable-lora"),
        (["--enable-lora", "--max-loras", "0"], "tandem serve: max_loras=0 is invalid"),
        (
            ["--lora-modules", "a=/x", "a=/y"],
            "tandem serve: lora_modules: each name once, got ['a'] more than once",
        ),
        (["--lora-port", "a=50061"], "tandem serve: lora_ports: LoRA is off"),
        (
            ["--enable-lora", "--lora-port", "a=50061", "--lora-port", "a=50062"],
            "tandem serve: lora_ports: one port per adapter, got ['a'] more than once",
        ),
        (
            ["--enable-lora", "--port", "50061", "--lora-port", "a=50061"],
            "tandem serve: lora_ports: each port once and not --port's, got [50061]",
        ),
    ],
)
def test_bad_lora_flags_exit_2_before_the_model_loads(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *argv]) == 2
    assert capsys.readouterr().err.startswith(message)


def test_a_lora_module_must_be_name_equals_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--lora-modules", "just-a-path")
    assert "'just-a-path' is not NAME=PATH" in capsys.readouterr().err


def test_lora_ports_are_name_equals_port(capsys: pytest.CaptureFixture[str]) -> None:
    args = _serve_args("--enable-lora", "--lora-port", "a=50061", "--lora-port", "b=0")
    assert args.lora_port == [("a", 50061), ("b", 0)]
    with pytest.raises(SystemExit):
        _serve_args("--lora-port", "a=http")
    assert "'a=http' is not NAME=PORT" in capsys.readouterr().err


class _LoraClient(_RecordingClient):
    """Also answers `tandem lora`'s calls, keeping what they asked."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, ...]] = []
        self.adapter = pb.LoraAdapter(lora_name="a", lora_path="/x/a", rank=8, cache_key="lora:1")

    async def load_lora(self, name: str, path: str) -> pb.LoraAdapter:
        self.calls.append(("load", name, path))
        return self.adapter

    async def unload_lora(self, name: str) -> pb.LoraAdapter:
        self.calls.append(("unload", name))
        return self.adapter

    async def list_loras(self) -> list[pb.LoraAdapter]:
        self.calls.append(("list",))
        return [self.adapter]


def test_lora_commands_and_the_generate_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client = _LoraClient()
    monkeypatch.setattr(cli, "_client", lambda args: client)
    for argv in (["load", "a", "/x/a"], ["unload", "a"], ["list"]):
        args = cli._parser().parse_args(["lora", *argv])
        assert args.run(args) == 0
    assert client.calls == [("load", "a", "/x/a"), ("unload", "a"), ("list",)]
    assert capsys.readouterr().out.splitlines() == [
        "loaded a\trank 8\tlora:1\t/x/a",
        "unloaded a\trank 8\tlora:1\t/x/a",
        "a\trank 8\tlora:1\t/x/a",
    ]
    args = cli._parser().parse_args(["generate", "hi", "--lora", "a"])
    assert args.run(args) == 0
    assert client.requests[0].lora_name == "a"


def test_status_shows_lora_when_it_is_on() -> None:
    config = pb.LoraConfig(max_loras=2, max_lora_rank=16)
    adapters = [pb.LoraAdapter(lora_name=n) for n in ("b", "a")]
    assert cli._lora_line(config, adapters) == "lora       a, b (at most 2 per step, rank <= 16)"
    assert cli._lora_line(config, []).startswith("lora       none loaded")


def test_status_prints_the_tokens_the_cache_holds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    info = pb.ModelInfo(model_name="m", num_kv_blocks=11, block_size=16, kv_cache_dtype="int8")
    monkeypatch.setattr(cli, "_client", lambda args: _StatusClient(pb.ServerStatus(), info))
    args = cli._parser().parse_args(["status"])
    assert args.run(args) == 0
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("kv cache")]
    assert lines == ["kv cache   11 blocks of 16 (160 tokens, int8); usage 0.0%"]


def test_status_counts_a_token_once_per_kv_cache_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    info = pb.ModelInfo(model_name="m", num_kv_blocks=13, block_size=16, kv_cache_groups=6)
    monkeypatch.setattr(cli, "_client", lambda args: _StatusClient(pb.ServerStatus(), info))
    args = cli._parser().parse_args(["status"])
    assert args.run(args) == 0
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith("kv cache")]
    assert lines == [
        "kv cache   13 blocks of 16 (32 tokens in 6 groups, windowed ones freed past the window); "
        "usage 0.0%"
    ]
