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
    POD_ROLES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.pod_role import apply_role
from engine.stats import SpecDecodingStats
from service import gateway, sampling_fields
from service.knob_flags import ENGINE_KNOBS, add_knob_flag, knob_values, parse_size

if TYPE_CHECKING:
    from service.gen.tandem.v1 import generation_pb2 as pb
    from service.kv_events_config import KvEventsConfig
    from service.router import RouterConfig

DEFAULT_SERVER = "127.0.0.1:50051"
# Sizes like 2G (service.knob_flags): --kv-offload-shm-bytes and the size knobs.
_bytes = parse_size

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

# Engine knobs (engine.config: name, type, default, help and flag are
# declared there, once) become `tandem serve` flags in these groups.
_KNOB_GROUPS = {
    "model": "model",
    "scheduler": "scheduler",
    "cache": "KV cache",
    "kv_transfer": "KV transfer (connectors, offloading, P/D)",
    "lora": "LoRA adapters",
}


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run a gRPC server", description="Run a Tandem gRPC server.")
    p.set_defaults(run=_run_serve)
    groups = {name: p.add_argument_group(title) for name, title in _KNOB_GROUPS.items()}
    for k in ENGINE_KNOBS:
        add_knob_flag(groups[k.section], k)
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
    _add_lora_flags(groups["lora"])
    groups["cache"].add_argument(
        "--no-kv-events",
        action="store_true",
        help="do not record KV cache events (SubscribeKvEvents then streams none)",
    )
    _add_kv_events_flags(p)
    k = groups["kv_transfer"]
    k.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        help='the KV connector, as JSON: {"kv_connector": "redis|shm|multi|<plugin>", '
        '"kv_role": "kv_producer|kv_consumer|kv_both", "kv_connector_extra_config": {...}} '
        "(default: none)",
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
        choices=list(POD_ROLES),
        help="this server's part in prefill/decode disaggregation; engine/pod_role.py says "
        "what each implies (default: both)",
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


def _add_lora_flags(g: argparse._ArgumentGroup) -> None:
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
        "--lora-port",
        action="append",
        type=_lora_port,
        metavar="NAME=PORT",
        help="serve adapter NAME on its own PORT as a model of its own, for the smg gateway "
        "(its engine protocol carries no adapter; give smg this port as another --worker); "
        "repeatable; needs --enable-lora (or --lora-modules)",
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def _lora_port(text: str) -> tuple[str, int]:
    name, sep, port = text.partition("=")
    if not sep or not name.strip() or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PORT")
    return name, int(port)


def lora_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """LoRAConfig with --enable-lora or --lora-modules, else None (then the
    other LoRA flags are refused rather than silently ignored)."""
    knobs = knob_values(args, "lora")
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


def kv_transfer_from_args(args: argparse.Namespace) -> KVTransferConfig | None:
    """--kv-transfer-config, or what --kv-offload stands for, with the KV
    transfer knobs' flags over it (engine.pod_role then checks it fits --role)."""
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
    overrides = knob_values(args, "kv_transfer")
    if overrides:
        if config is None:
            flags = ", ".join("--" + name.replace("_", "-") for name in overrides)
            raise ConfigError(f"{flags} needs a KV connector")
        config = replace(config, **overrides)
    return config


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from `tandem serve`'s flags, with what --role
    implies applied (engine.pod_role: a prefill pod drops
    --speculative-config; the connector must fit the role)."""
    config = EngineConfig(
        model=ModelConfig(**knob_values(args, "model")),
        scheduler=SchedulerConfig(**knob_values(args, "scheduler")),
        # KV events are recorded by default when serving (SubscribeKvEvents).
        cache=CacheConfig(**knob_values(args, "cache"), enable_kv_events=not args.no_kv_events),
        kv_transfer=kv_transfer_from_args(args),
        speculative=args.speculative_config,
        lora=lora_from_args(args),
        role=getattr(args, "role", "both"),
    )
    return apply_role(config, log=logger)


def _run_serve(args: argparse.Namespace) -> int:
    from service.server import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
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
        lora_ports=tuple(args.lora_port or ()),
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
    # One flag per sampling field the table gives one (service/sampling_fields.py).
    sampling_fields.add_flags(p.add_argument_group("sampling"))
    p.add_argument("--lora", default="", help="a loaded LoRA adapter's name (default: base model)")
    p.add_argument(
        "--cache-salt",
        default="",
        help="only requests with the same salt share prefix-cache blocks (default: none)",
    )
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
                constraint=_constraint(args),
                lora_name=args.lora,
                cache_salt=args.cache_salt,
                **sampling_fields.flag_values(args),
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
    if info.numerics:  # "" from an older server
        print(
            f"numerics   {info.numerics}: {info.activations} activations, "
            f"{info.kv_cache_dtype} KV cache"
        )
    # Block 0 is the null block: the others hold tokens, each token a slot
    # in every KV cache group (windowed groups free theirs past the window,
    # so long contexts fit more than this).
    groups = max(info.kv_cache_groups, 1)
    holds = max(info.num_kv_blocks - 1, 0) * info.block_size // groups
    dtype = f", {info.kv_cache_dtype}" if info.kv_cache_dtype else ""
    grouped = f" in {groups} groups, windowed ones freed past the window" if groups > 1 else ""
    print(
        f"kv cache   {info.num_kv_blocks} blocks of {info.block_size} "
        f"({holds} tokens{grouped}{dtype}); usage {status.kv_cache_usage:.1%}"
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
