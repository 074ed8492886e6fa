"""The servicer over an AsyncEngine with a scripted core: Abort, refusals
and the server's own aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

import grpc

from engine.async_engine import AsyncEngine
from engine.request import RequestStatus
from service.client import make_request as make_pb_request
from service.errors import was_refused
from service.gen.tandem.v1 import generation_pb2 as pb
from service.gen.tandem.v1 import generation_pb2_grpc as pb_grpc
from service.grpc_server import new_server
from service.servicer import GenerationServicer
from tests.unit.engine.scripted_core import ScriptedCore, make_request, start_engine

NO_CONTEXT = cast(grpc.aio.ServicerContext, None)  # used only before the engine is attached


def test_abort_ends_live_requests_and_releases_finished_ones_kv() -> None:
    """The documented Abort: live ids are aborted (and answered); the others
    may be finished prefill legs whose KV is held for a decode that will
    not come, and are released."""

    async def go() -> tuple[list[str], ScriptedCore]:
        core = ScriptedCore(hold_kv=True)
        engine = await start_engine(core)
        servicer = GenerationServicer()
        servicer.attach(engine)
        try:
            live = engine.submit(make_request(engine, "live", max_tokens=100))
            await live.__anext__()
            held = engine.submit(make_request(engine, "held", max_tokens=1))
            assert [o.finished async for o in held] == [True]
            request = pb.AbortRequest(request_ids=["live", "held", "unknown"])
            response = await servicer.Abort(request, NO_CONTEXT)
            for _ in range(500):  # the engine thread applies commands between steps
                if core.released:
                    break
                await asyncio.sleep(0.01)
            return list(response.aborted_request_ids), core
        finally:
            await engine.shutdown()

    aborted, core = asyncio.run(go())
    assert aborted == ["live"]
    assert core.aborted == [("live", RequestStatus.FINISHED_ABORTED)]
    assert core.released == ["held", "unknown"] and not core.held_kv


# --- refusals and the server's own aborts, over a real gRPC server -----------------

Body = Callable[[pb_grpc.GenerationStub, ScriptedCore, AsyncEngine], Awaitable[object]]


def serve(body: Body, core: ScriptedCore) -> object:
    """Runs ``body`` against a GenerationServicer on a real gRPC server."""

    async def go() -> object:
        engine = await start_engine(core)
        servicer = GenerationServicer()
        servicer.attach(engine)
        server = new_server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
                return await body(stub, core, engine)
        finally:
            await server.stop(0)
            if not engine.draining:  # the body may have shut it down itself
                await engine.shutdown()

    return asyncio.run(go())


async def _error(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
    """The error a Generate stream ends with, after whatever it answered."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError(f"the call ended {await call.code()}")


def _generate(rid: str, max_tokens: int = 3) -> pb.GenerateRequest:
    return make_pb_request(token_ids=[1, 2, 3], max_tokens=max_tokens, request_id=rid)


def test_a_duplicate_id_is_refused_with_the_refused_marker() -> None:
    """Both duplicates, of a live request's id and of one the scheduler
    still holds (a finished prefill leg's, its KV kept for a decode pod),
    end INVALID_ARGUMENT marked refused: nothing of them ran, so a router
    must release nothing under that id."""

    async def body(stub: pb_grpc.GenerationStub, core: ScriptedCore, _: AsyncEngine) -> object:
        live = stub.Generate(_generate("live", max_tokens=1000))
        await live.read()  # running
        core.held.add("held")
        errors = [await _error(stub.Generate(_generate(rid))) for rid in ("live", "held")]
        live.cancel()
        return errors

    errors = serve(body, ScriptedCore())
    assert isinstance(errors, list)
    for error, holder in zip(errors, ("a live request", "a finished request"), strict=True):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert holder in (error.details() or "")
        assert was_refused(error), error.details()


def test_a_request_the_servers_drain_aborts_ends_unavailable() -> None:
    """The drain's grace is over and the server aborts what still runs: its
    client asked for nothing, so the call ends UNAVAILABLE (retry
    elsewhere), never OK with finish reason ABORT; not marked refused (it ran)."""

    async def body(stub: pb_grpc.GenerationStub, _: ScriptedCore, engine: AsyncEngine) -> object:
        call = stub.Generate(_generate("r", max_tokens=100000))
        await call.read()  # running
        shutdown = asyncio.create_task(engine.shutdown())
        error = await _error(call)
        await shutdown
        return error

    error = serve(body, ScriptedCore())
    assert isinstance(error, grpc.aio.AioRpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert (error.details() or "").startswith("the server is draining")
    assert not was_refused(error)
