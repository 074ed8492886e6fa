"""Assembles and runs one Tandem gRPC server.

Start-up order: listen first with health NOT_SERVING (so orchestrators see
the pod), load and warm up the model, then flip health to SERVING. SIGTERM
(or `drain()`) flips health to NOT_SERVING, refuses new requests with
UNAVAILABLE, lets in-flight ones finish for up to the grace period, aborts
what is left, and stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine import AsyncEngine, ConfigError, EngineConfig
from engine.pod_role import apply_role, pod_role
from service.adapter_ports import AdapterPorts
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.gen.tandem.v1 import kv_transfer_pb2_grpc
from service.grpc_server import ListenError, host_port, listen, new_server
from service.kv_event_publisher import ZmqKvEventPublisher
from service.kv_events_config import KvEventsConfig, recording_events
from service.metrics import ServiceMetrics
from service.servicer import GenerationServicer, new_input_pool
from service.side_channel import KVTransferServicer, with_side_channel
from service.stop_signals import stop_signals
from service.tls import ServerTLS
from service.vllm_servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from service.vllm_servicer import VllmEngineServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    api_key: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients must present a cert it signed (mTLS)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    drain_grace_seconds: float = 30.0
    max_waiting_requests: int = 1024
    # The model name clients and gateways see (GetModelInfo); None: the
    # model directory's name.
    served_model_name: str | None = None
    kv_events: KvEventsConfig | None = None  # set: publish KV events over ZMQ (vLLM format)
    # (name, path) of LoRA adapters loaded before the server reports SERVING
    # (--lora-modules); one that fails to load fails the start.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # (name, port): LoRA adapter `name` served on its own port as its own
    # model, for the smg gateway (--lora-port; service/adapter_ports.py).
    lora_ports: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca: needs tls_cert and tls_key (mTLS is TLS plus this)")
        if self.max_waiting_requests < 1:
            raise ConfigError(
                f"max_waiting_requests: must be >= 1, got {self.max_waiting_requests}"
            )
        if self.drain_grace_seconds < 0:
            raise ConfigError(f"drain_grace_seconds: must be >= 0, got {self.drain_grace_seconds}")
        names = [name for name, _ in self.lora_modules]
        if duplicates := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigError(f"lora_modules: each name once, got {duplicates} more than once")
        names = [name for name, _ in self.lora_ports]
        if duplicates := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigError(f"lora_ports: one port per adapter, got {duplicates} more than once")
        ports = [port for _, port in self.lora_ports if port]
        if self.port in ports or len(set(ports)) != len(ports):
            raise ConfigError(f"lora_ports: each port once and not --port's, got {ports}")


class TandemServer:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        if config.kv_events is not None:
            engine_config = recording_events(engine_config)
        if config.lora_modules and engine_config.lora is None:
            raise ConfigError("lora_modules: LoRA is off (EngineConfig.lora is None)")
        if config.lora_ports and engine_config.lora is None:
            raise ConfigError("lora_ports: LoRA is off (EngineConfig.lora is None)")
        # The pod's role (--role) lives in the engine config: checked, and
        # what it implies applied, before anything listens.
        engine_config = apply_role(engine_config)
        self.role = pod_role(engine_config)
        self.engine_config = engine_config
        self.config = config
        self.metrics = ServiceMetrics()
        self.health = health.aio.HealthServicer()
        kv = engine_config.kv_transfer
        connector = kv.kv_connector if kv is not None else ""
        inputs = new_input_pool()
        self.servicer = GenerationServicer(
            role=self.role,
            kv_connector=connector,
            input_pool=inputs,
            served_model_name=config.served_model_name,
            on_loras_changed=self.metrics.lora_adapters.set,
        )
        # The field's engine protocol, for the smg gateway (same port).
        self.vllm_servicer = VllmEngineServicer(
            inputs,
            role=self.role,
            kv_connector=connector,
            served_model_name=config.served_model_name,
        )
        # One more VllmEngine port per --lora-port adapter (same engine).
        self.adapter_ports = AdapterPorts(
            config.lora_ports,
            inputs,
            role=self.role,
            kv_connector=connector,
            api_key=config.api_key,
            health_servicer=self.health,
        )
        self.side_channel = KVTransferServicer()
        self.kv_publisher: ZmqKvEventPublisher | None = None
        self.engine: AsyncEngine | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._connector_watch: asyncio.Task[None] | None = None
        self._draining = False

    async def start(self) -> int:
        """Listens, loads the model, then reports SERVING. Returns the port."""
        cfg = self.config
        server = new_server(cfg.api_key)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)  # type: ignore[no-untyped-call]
        vpb_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(self.side_channel, server)  # type: ignore[no-untyped-call]
        names = (
            SERVICE_NAME,
            VLLM_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        )
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
        # Every port is taken before the model loads: a taken one ends
        # the start at once (ListenError).
        self.port = listen(server, cfg.host, cfg.port, _server_credentials(cfg))
        self.adapter_ports.listen(cfg.host, _server_credentials(cfg))
        if cfg.metrics_port is not None:
            self._serve_metrics(cfg.metrics_host, cfg.metrics_port)
        if cfg.kv_events is not None:
            self.kv_publisher = ZmqKvEventPublisher(cfg.kv_events)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        await self.adapter_ports.start(cfg.host)
        logger.info("listening on %s; loading the model", host_port(cfg.host, self.port))
        self.engine = await AsyncEngine.create(
            with_side_channel(self.engine_config, cfg.host, self.port),
            max_waiting_requests=cfg.max_waiting_requests,
            observer=self.metrics,
        )
        self.servicer.attach(self.engine)
        self.vllm_servicer.attach(self.engine)
        self.side_channel.engine = self.engine
        self.engine.add_failure_listener(self._on_engine_failure)
        lora = self.engine_config.lora
        self.metrics.describe_engine(
            cfg.served_model_name or self.engine.info.model_name,
            lora.max_loras if lora is not None else None,
        )
        await self._load_lora_modules(self.engine)
        self.adapter_ports.attach(self.engine)
        if self.kv_publisher is not None:
            # Subscribed before SERVING: no request's blocks go unpublished.
            self.kv_publisher.start(self.engine.subscribe_kv_events())
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.engine_config.kv_transfer is not None:
            self._connector_watch = asyncio.get_running_loop().create_task(self._watch_connector())
        logger.info("serving %s (role %s)", self.engine.info.model_name, self.role)
        return self.port

    async def _load_lora_modules(self, engine: AsyncEngine) -> None:
        """--lora-modules, before SERVING: a pod that reports ready has them.
        One that does not load stops the start (ConfigError, exit code 2)
        with the engine's message naming the file at fault."""
        await self.servicer.loras.load_at_start(engine, self.config.lora_modules)

    def _serve_metrics(self, host: str, port: int) -> None:
        try:
            self.metrics.serve(port, host)
        except OSError as exc:
            raise ListenError(
                f"--metrics-port: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        logger.info("metrics on http://%s:%d/metrics", host, port)

    async def drain(self, grace: float | None = None) -> None:
        """Stops admitting, lets in-flight requests finish and peers read
        the KV blocks held for them, then stops; all within `grace`."""
        grace = self.config.drain_grace_seconds if grace is None else grace
        deadline = asyncio.get_running_loop().time() + grace
        self._draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.engine is not None:
            self.engine.begin_drain()
            logger.info("draining: %d requests in flight", self.engine.num_live)
            if not await self.engine.wait_idle(grace):
                logger.warning("drain grace (%g s) over: aborting the rest", grace)
            else:
                await self._wait_kv_released(self.engine, deadline)
        await self.stop()

    async def _wait_kv_released(self, engine: AsyncEngine, deadline: float) -> None:
        """A prefill pod's finished requests keep their KV blocks until the
        decode pods READ them: exiting first would make each decode pod
        recompute. Every hold ends by the peer's done or reject, or its
        lease lapsing; the gRPC side channel keeps serving meanwhile."""
        held = engine.num_held_kv
        if not held:
            return
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        logger.info(
            "draining: waiting up to %.0f s for peers to read the KV blocks of %d request(s)",
            left,
            held,
        )
        if await engine.wait_kv_released(left):
            logger.info("draining: every held KV block was read or released")
        else:
            logger.warning(
                "drain grace over with the KV blocks of %d request(s) unread: "
                "their decode pods will recompute them",
                engine.num_held_kv,
            )

    async def stop(self) -> None:
        if self._connector_watch is not None:
            self._connector_watch.cancel()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.kv_publisher is not None:
            # After the engine: the evictions of its last step still go out.
            publisher, self.kv_publisher = self.kv_publisher, None
            await publisher.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.adapter_ports.stop(grace=1.0)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _on_engine_failure(self, exc: BaseException) -> None:
        logger.error("engine failed (%r): health NOT_SERVING", exc)
        self._health_task = asyncio.get_running_loop().create_task(
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        )

    async def _watch_connector(self, period: float = 1.0) -> None:
        """NOT_SERVING while the KV connector's transfer thread is dead or
        wedged (requests would wait on loads that never finish); SERVING
        again if it recovers."""
        engine = self.engine
        assert engine is not None
        broken = False
        while True:
            await asyncio.sleep(period)
            problem = engine.connector_health()
            if (problem is not None) == broken or self._draining or not engine.healthy:
                continue
            broken = problem is not None
            if broken:
                logger.error("KV connector unhealthy (%s): health NOT_SERVING", problem)
            else:
                logger.info("KV connector healthy again: health SERVING")
            await self._set_health(
                health_pb2.HealthCheckResponse.NOT_SERVING
                if broken
                else health_pb2.HealthCheckResponse.SERVING
            )

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME, VLLM_SERVICE_NAME):
            await self.health.set(name, status)


def _server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    return ServerTLS(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca).credentials()


async def serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Runs a server until SIGTERM/SIGINT, then drains it (exit code 0)."""
    server = TandemServer(engine_config, config)
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        if not draining:
            logger.info("%s: draining", signal.Signals(signum).name)
            draining.append(loop.create_task(server.drain()))

    with stop_signals(loop, on_signal):
        try:
            await server.start()
        except BaseException:
            # Stop the listening gRPC server before the loop closes (it would
            # otherwise complain from its finalizer after the real error).
            await server.stop()
            raise
        await server.wait_stopped()
