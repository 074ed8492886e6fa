"""service.stop_signals: the stop callback inside the block, SIGTERM
ignored after it (a repeat during the exit must not kill the process)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from service.stop_signals import stop_signals


@pytest.fixture
def saved_handlers() -> Iterator[None]:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.mark.usefixtures("saved_handlers")
def test_sigterm_reaches_the_callback_then_is_ignored() -> None:
    seen: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        got = asyncio.Event()

        def on_stop(signum: int) -> None:
            seen.append(signum)
            got.set()

        with stop_signals(loop, on_stop):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(got.wait(), 5)

    asyncio.run(main())
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == signal.default_int_handler
    os.kill(os.getpid(), signal.SIGTERM)  # ignored: this test process lives on


@pytest.mark.usefixtures("saved_handlers")
def test_an_error_inside_still_leaves_sigterm_ignored() -> None:
    async def main() -> None:
        with stop_signals(asyncio.get_running_loop(), lambda _s: None):
            raise RuntimeError("start-up failed")

    with pytest.raises(RuntimeError, match="start-up failed"):
        asyncio.run(main())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
