"""SIGTERM/SIGINT handling shared by `tandem serve` and `tandem router`.

While the event loop runs, both signals call the server's stop callback
(a drain for a pod). Once the server has stopped, SIGTERM is ignored for
the rest of the process: what is left is the exit itself (the engine
thread's join, freeing the KV cache), and a second SIGTERM there (a test's
or an orchestrator's repeat) would otherwise kill a cleanly drained process
with -15. asyncio's own clean-up, when the loop closes, would put the
default action back, so the handlers are taken off here first.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals(loop: asyncio.AbstractEventLoop, on_stop: Callable[[int], None]) -> Iterator[None]:
    """`on_stop(signum)` runs on the loop for each SIGTERM/SIGINT inside the
    block; after it, SIGTERM is ignored and SIGINT has its default."""
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_stop, signum)
    try:
        yield
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
