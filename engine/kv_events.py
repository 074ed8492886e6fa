"""KV cache events (blocks stored, removed, cleared) fanned out to subscribers.

The engine publishes each step's events once; every subscriber (a router
following this pod's prefix cache through SubscribeKvEvents) reads them at
its own pace from a bounded queue. Runs on the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_cache.events import AllBlocksCleared, KVCacheEvent


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    sequence: int
    timestamp: float
    events: list[KVCacheEvent]


class KvEventSubscription:
    """A bounded queue of KV event batches for one subscriber. When it is full
    the oldest batches are dropped and the next batch starts with an
    AllBlocksCleared, so the subscriber knows to forget what it knew."""

    def __init__(
        self, max_pending: int, on_close: Callable[[KvEventSubscription], None] | None = None
    ) -> None:
        self._queue: asyncio.Queue[KvEventBatch | None] = asyncio.Queue()
        self._max_pending = max_pending
        self._on_close = on_close
        self._sequence = 0
        self._overflowed = False

    def publish(self, events: list[KVCacheEvent], timestamp: float) -> None:
        if self._queue.qsize() >= self._max_pending:
            while not self._queue.empty():
                self._queue.get_nowait()
            self._overflowed = True
        batch_events = list(events)
        if self._overflowed:
            batch_events.insert(0, AllBlocksCleared())
            self._overflowed = False
        self._sequence += 1
        self._queue.put_nowait(KvEventBatch(self._sequence, timestamp, batch_events))

    async def next(self) -> KvEventBatch | None:
        """The next batch, or None once the subscription is closed."""
        return await self._queue.get()

    def close(self) -> None:
        """Ends the subscription: ``next`` returns None after what is queued."""
        if self._on_close is not None:
            self._on_close(self)
            self._on_close = None
        self._queue.put_nowait(None)


class KvEventHub:
    """The engine's subscribers; ``publish`` gives each the same events."""

    def __init__(self) -> None:
        self._subscribers: set[KvEventSubscription] = set()

    def subscribe(self, max_pending: int = 1024) -> KvEventSubscription:
        sub = KvEventSubscription(max_pending, self._subscribers.discard)
        self._subscribers.add(sub)
        return sub

    def publish(self, events: list[KVCacheEvent], timestamp: float) -> None:
        for sub in self._subscribers:
            sub.publish(events, timestamp)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """Ends every subscription (the engine stopped)."""
        for sub in list(self._subscribers):
            sub.close()
