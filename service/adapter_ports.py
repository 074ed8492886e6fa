"""LoRA adapters through the smg gateway: each adapter named by
``--lora-port NAME=PORT`` is served on its own port, as its own model.

Why a port per adapter: smg (1.13) passes nothing of a request's OpenAI
``model`` to the engine. The ``vllm.grpc.engine`` GenerateRequest has no
field for an adapter (nor for a priority or a cache salt), and smg leaves
the SGLang protocol's ``lora_id`` empty and never calls its LoRA RPCs (its
request builders fill neither, crates/grpc_client/src/sglang_scheduler.rs;
a ``--model-alias`` is resolved in smg and the engine sees the canonical
request). What smg does do is route by model name: every worker serves
the model its GetModelInfo names, ``/v1/models`` lists each worker's model,
and a model no worker serves is HTTP 404. So a port whose VllmEngine runs
every request under adapter NAME and reports NAME as its model is that
adapter's worker to smg, with nothing in smg changed:

    tandem serve --enable-lora --lora-modules qv8=/adapters/qv8 --lora-port qv8=50061
    tandem gateway --worker 127.0.0.1:50051 --worker 127.0.0.1:50061

The port belongs to the adapter's name, not to one load of it: loaded
later (``tandem lora load``), the name's requests run; unloaded, requests
that started finish and new ones answer NOT_FOUND (smg: 404 naming the
adapter). Every port shares the pod's one engine, input pool, API key, TLS
and health (one HealthServicer object on every server), and listens
before the model loads, as the main port does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from service.grpc_server import host_port, listen, new_server
from service.vllm_servicer import VllmEngineServicer

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health

    from engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass
class AdapterPort:
    """One adapter's server; ``port`` is the bound one after ``listen``."""

    lora_name: str
    port: int
    servicer: VllmEngineServicer
    server: grpc.aio.Server


class AdapterPorts:
    def __init__(
        self,
        ports: Sequence[tuple[str, int]],
        input_pool: ThreadPoolExecutor,
        *,
        role: str,
        kv_connector: str,
        api_key: str | None,
        health_servicer: health.aio.HealthServicer,
    ) -> None:
        self.ports: list[AdapterPort] = []
        for name, port in ports:
            servicer = VllmEngineServicer(
                input_pool, role=role, kv_connector=kv_connector, lora_name=name
            )
            server = new_server(api_key)
            vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            self.ports.append(AdapterPort(name, port, servicer, server))

    def listen(self, host: str, credentials: grpc.ServerCredentials | None) -> None:
        """Binds every port now (ListenError naming the adapter's flag)."""
        for p in self.ports:
            flag = f"--lora-port {p.lora_name}={p.port}"
            p.port = listen(p.server, host, p.port, credentials, flag=flag)

    async def start(self, host: str) -> None:
        for p in self.ports:
            await p.server.start()
            logger.info("LoRA adapter %r served on %s", p.lora_name, host_port(host, p.port))

    def attach(self, engine: AsyncEngine) -> None:
        loaded = {r.lora_name for r in engine.list_loras()}
        for p in self.ports:
            p.servicer.attach(engine)
            if p.lora_name not in loaded:
                # Not an error: `tandem lora load` may load it later.
                logger.warning(
                    "--lora-port %s=%d: no adapter %r is loaded yet; its requests "
                    "answer NOT_FOUND until one is",
                    p.lora_name,
                    p.port,
                    p.lora_name,
                )

    async def stop(self, grace: float) -> None:
        for p in self.ports:
            await p.server.stop(grace=grace)
