"""``tandem gateway``: the Shepherd Model Gateway (smg) in front of Tandem pods.

smg (PyPI ``smg``, a Rust binary in a wheel, installed with Tandem) serves
OpenAI HTTP (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``)
and drives the pods over the engine protocol they serve next to tandem.v1
(``vllm.grpc.engine.VllmEngine``, service/vllm_servicer.py). It tokenizes
and renders chat templates itself, with the tokenizer the pods send it.

This command only spells smg's flags for a Tandem fleet and then becomes
smg (exec: signals, exit code and logs are smg's own):

    tandem gateway --worker 127.0.0.1:50051                 # colocated pods
    tandem gateway --prefill 10.0.0.1:50051 --decode 10.0.0.2:50051   # P/D

A pod's LoRA adapter is a model smg reaches on the adapter's own port
(``tandem serve --lora-port NAME=PORT``, service/adapter_ports.py): name
that port as one more --worker (or --prefill/--decode) and requests whose
``model`` is NAME run under the adapter.

Policies: cache-aware routing for colocated pods and for prefill (requests
sharing a prefix land where it is cached; smg follows the pods' KV events),
and least load for decode, whose work is the generated tokens and
whose cache the KV hand-over fills anyway.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import ConfigError

POLICIES = (
    "random",
    "round_robin",
    "cache_aware",
    "power_of_two",
    "least_load",
    "consistent_hashing",
    "prefix_hash",
)


@dataclass(frozen=True)
class GatewayConfig:
    workers: list[str] = field(default_factory=list)  # colocated pods
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_load"
    block_size: int = 16
    # smg's defaults (3 s without a token, 2 s without contact) fit GPU
    # pods; a CPU pod's prefill of a few long prompts takes longer, and smg
    # would answer 504 "worker silent" meanwhile.
    wedge_seconds: float = 30.0
    stall_seconds: float = 10.0
    prometheus_port: int | None = None
    log_level: str = "info"
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if bool(self.prefill) != bool(self.decode):
            raise ConfigError("--prefill and --decode: give both (P/D) or neither")
        if self.workers and self.prefill:
            raise ConfigError("--worker: colocated pods or a P/D pair of pools, not both")
        if not self.workers and not self.prefill:
            raise ConfigError("--worker (or --prefill and --decode): name at least one pod")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value not in POLICIES:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}: expected one of {', '.join(POLICIES)}, got {value!r}")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)


def worker_url(address: str) -> str:
    """``host:port`` as smg's gRPC worker URL (``grpc://host:port``)."""
    if "://" in address:
        if not address.startswith("grpc://"):
            raise ConfigError(f"{address}: Tandem pods speak gRPC; use host:port or grpc://")
        return address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{address}: expected host:port")
    return f"grpc://{address}"


def smg_args(cfg: GatewayConfig) -> list[str]:
    """The ``smg launch`` arguments for ``cfg`` (after the program name)."""
    args = ["launch", "--host", cfg.host, "--port", str(cfg.port), "--backend", "vllm"]
    args += ["--block-size", str(cfg.block_size), "--log-level", cfg.log_level]
    args += ["--worker-wedge-secs", f"{cfg.wedge_seconds:g}"]
    args += ["--worker-stall-secs", f"{cfg.stall_seconds:g}"]
    if cfg.disaggregated:
        args.append("--pd-disaggregation")
        for url in cfg.prefill:
            args += ["--prefill", worker_url(url)]
        for url in cfg.decode:
            args += ["--decode", worker_url(url)]
        args += ["--prefill-policy", cfg.prefill_policy, "--decode-policy", cfg.decode_policy]
    else:
        args += ["--worker-urls", *(worker_url(u) for u in cfg.workers)]
        args += ["--policy", cfg.policy]
    if cfg.prometheus_port is not None:
        args += ["--prometheus-port", str(cfg.prometheus_port)]
    return [*args, *cfg.extra_args]


def smg_binary() -> str:
    """smg as installed with Tandem (next to this interpreter), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file():
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise ConfigError("smg is not installed (pip install smg, or `make` sets it up)")
    return found


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "gateway",
        help="an OpenAI endpoint (smg) in front of Tandem pods",
        description="Starts the Shepherd Model Gateway (smg) with the flags for Tandem pods: "
        "OpenAI HTTP on --port, cache-aware routing, P/D with --prefill/--decode. "
        "Arguments after -- go to `smg launch` unchanged.",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        help="a colocated pod, or one of its adapters' --lora-port ports: host:port",
    )
    p.add_argument("--prefill", action="append", default=[], help="a prefill pod, host:port")
    p.add_argument("--decode", action="append", default=[], help="a decode pod, host:port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--policy", default="cache_aware", help="colocated routing (cache_aware)")
    p.add_argument("--prefill-policy", default="cache_aware", help="P/D (cache_aware)")
    p.add_argument("--decode-policy", default="least_load", help="P/D (least_load)")
    p.add_argument(
        "--block-size", type=int, default=16, help="the pods' KV block size (default: 16)"
    )
    p.add_argument(
        "--wedge-seconds",
        type=float,
        default=30.0,
        help="a pod with requests in flight and no token for this long gets no new ones "
        "(smg's --worker-wedge-secs; default: 30, for CPU pods' long prefills)",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=10.0,
        help="a pod not heard from for this long gets no requests "
        "(smg's --worker-stall-secs; default: 10)",
    )
    p.add_argument("--prometheus-port", type=int, help="smg's own metrics port")
    p.add_argument("smg_args", nargs=argparse.REMAINDER, help="-- then more `smg launch` flags")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    extra = list(args.smg_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return GatewayConfig(
        workers=args.worker,
        prefill=args.prefill,
        decode=args.decode,
        host=args.host,
        port=args.port,
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        block_size=args.block_size,
        wedge_seconds=args.wedge_seconds,
        stall_seconds=args.stall_seconds,
        prometheus_port=args.prometheus_port,
        log_level={"warning": "warn"}.get(args.log_level, args.log_level),
        extra_args=extra,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    binary = smg_binary()
    argv = [binary, *smg_args(cfg)]
    print("tandem gateway: " + " ".join(argv), file=sys.stderr, flush=True)
    os.execv(binary, argv)  # returns only by raising
