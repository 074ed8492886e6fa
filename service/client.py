"""A small Python client for tandem.v1 (used by the CLI, the benchmark and tests).

    async with TandemClient("127.0.0.1:50051") as client:
        async for chunk in client.generate(text="Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)

Any other gRPC client works the same way: the protos are in `protos/`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service import tls
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc


def open_channel(
    target: str,
    *,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> grpc.aio.Channel:
    """An insecure channel, or TLS when `tls_ca` is given (mTLS with cert+key)."""
    return tls.open_channel(target, tls.ClientTLS(tls_ca, tls_cert, tls_key))


class TandemClient:
    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        self.channel = open_channel(target, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.stub = pb_grpc.GenerationStub(self.channel)  # type: ignore[no-untyped-call]
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def __aenter__(self) -> TandemClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def generate_call(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> grpc.aio.UnaryStreamCall:
        """The raw call (iterate it; `.cancel()` aborts the request)."""
        return self.stub.Generate(request, metadata=self.metadata, timeout=timeout)

    async def generate(
        self,
        *,
        text: str | None = None,
        token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        request_id: str = "",
        priority: int = 0,
        timeout: float | None = None,
        lora_name: str = "",
        cache_salt: str = "",
        **sampling: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        request = make_request(
            text=text,
            token_ids=token_ids,
            messages=messages,
            request_id=request_id,
            priority=priority,
            lora_name=lora_name,
            cache_salt=cache_salt,
            **sampling,
        )
        async for chunk in self.generate_call(request, timeout):
            yield chunk

    async def abort(self, request_ids: list[str]) -> list[str]:
        resp = await self.stub.Abort(
            pb.AbortRequest(request_ids=request_ids), metadata=self.metadata
        )
        return list(resp.aborted_request_ids)

    async def tokenize(self, text: str) -> list[int]:
        resp = await self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata)
        return list(resp.token_ids)

    async def model_info(self) -> pb.ModelInfo:
        info: pb.ModelInfo = await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=self.metadata
        )
        return info

    async def status(self) -> pb.ServerStatus:
        status: pb.ServerStatus = await self.stub.GetServerStatus(
            pb.GetServerStatusRequest(), metadata=self.metadata
        )
        return status

    async def load_lora(self, name: str, path: str) -> pb.LoraAdapter:
        """Loads the PEFT adapter at `path` (on the server's machine) as `name`."""
        adapter: pb.LoraAdapter = await self.stub.LoadLoraAdapter(
            pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path), metadata=self.metadata
        )
        return adapter

    async def unload_lora(self, name: str) -> pb.LoraAdapter:
        resp: pb.UnloadLoraAdapterResponse = await self.stub.UnloadLoraAdapter(
            pb.UnloadLoraAdapterRequest(lora_name=name), metadata=self.metadata
        )
        return resp.adapter

    async def list_loras(self) -> list[pb.LoraAdapter]:
        resp: pb.ListLoraAdaptersResponse = await self.stub.ListLoraAdapters(
            pb.ListLoraAdaptersRequest(), metadata=self.metadata
        )
        return list(resp.adapters)


def make_request(
    *,
    text: str | None = None,
    token_ids: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    request_id: str = "",
    priority: int = 0,
    constraint: dict[str, Any] | None = None,
    lora_name: str = "",
    cache_salt: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments (sampling names as in the
    proto). ``constraint``: one structured-output field and its value
    (``{"regex": "[0-9]+"}``, ``{"choice": ["a", "b"]}``, ``{"json_schema":
    {...}}`` as a dict or JSON text). ``lora_name``: a loaded LoRA adapter
    ("": the base model). ``cache_salt``: see GenerateRequest.cache_salt."""
    request = pb.GenerateRequest(
        request_id=request_id, priority=priority, lora_name=lora_name, cache_salt=cache_salt
    )
    for kind, value in (constraint or {}).items():
        if kind == "choice":
            request.choice.choices.extend(value)
        elif kind == "json_schema" and not isinstance(value, str):
            request.json_schema = json.dumps(value)
        else:
            setattr(request, kind, value)
    if text is not None:
        request.text = text
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif messages is not None:
        request.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    for key, value in sampling.items():
        if value is None:
            continue
        field = getattr(request.sampling, key)
        if isinstance(value, list | tuple):
            field.extend(value)
        elif isinstance(value, dict):  # a map field (logit_bias)
            field.update(value)
        else:
            setattr(request.sampling, key, value)
    return request


async def wait_serving(
    target: str, timeout: float = 600.0, alive: Callable[[], bool] | None = None
) -> None:
    """Polls health until `target` reports SERVING. Raises TimeoutError after
    `timeout` s, or RuntimeError as soon as `alive()` (e.g. "is the server
    process still running") turns false."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise RuntimeError(f"the server at {target} exited before it was SERVING")
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{target} did not become SERVING within {timeout:.0f} s")
