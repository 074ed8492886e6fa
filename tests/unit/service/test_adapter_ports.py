"""An adapter's own port (--lora-port, service/adapter_ports.py) over a real
loopback gRPC server, in front of an AsyncEngine with a scripted core."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from service.adapter_ports import AdapterPorts
from service.grpc_server import ListenError
from service.servicer import new_input_pool
from tests.unit.engine.scripted_core import ScriptedCore, start_engine


def _ports(*ports: tuple[str, int], health_servicer: health.aio.HealthServicer) -> AdapterPorts:
    return AdapterPorts(
        ports,
        new_input_pool(),
        role="both",
        kv_connector="",
        api_key=None,
        health_servicer=health_servicer,
    )


def test_each_adapter_port_serves_its_adapter_as_the_model_and_the_pods_health() -> None:
    async def go() -> tuple[list[str], list[int]]:
        shared = health.aio.HealthServicer()
        await shared.set("", health_pb2.HealthCheckResponse.SERVING)
        ports = _ports(("qv8", 0), ("sql", 0), health_servicer=shared)
        ports.listen("127.0.0.1", None)
        await ports.start("127.0.0.1")
        engine = await start_engine(ScriptedCore())
        ports.attach(engine)
        names, statuses = [], []
        try:
            for p in ports.ports:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{p.port}") as channel:
                    info = await vpb_grpc.VllmEngineStub(channel).GetModelInfo(
                        vpb.GetModelInfoRequest()
                    )
                    names.append(info.served_model_name)
                    check = health_pb2_grpc.HealthStub(channel).Check
                    statuses.append((await check(health_pb2.HealthCheckRequest())).status)
        finally:
            await ports.stop(grace=0)
            await engine.shutdown()
        return names, statuses

    names, statuses = asyncio.run(go())
    assert names == ["qv8", "sql"]
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2


def test_a_taken_port_is_refused_naming_the_adapters_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def go() -> None:
            ports = _ports(("qv8", port), health_servicer=health.aio.HealthServicer())
            try:
                ports.listen("127.0.0.1", None)
            finally:
                await ports.stop(grace=0)

        with pytest.raises(ListenError, match=f"--lora-port qv8={port}: cannot listen"):
            asyncio.run(go())
