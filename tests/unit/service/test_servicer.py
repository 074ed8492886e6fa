"""The servicer's Abort over an AsyncEngine with a scripted core."""

from __future__ import annotations

import asyncio
from typing import cast

import grpc

from engine.request import RequestStatus
from service.gen.tandem.v1 import generation_pb2 as pb
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
