"""KV event subscriptions: every subscriber gets every batch, bounded."""

from __future__ import annotations

import asyncio

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from engine.kv_events import KvEventBatch, KvEventHub


def _removed(name: bytes) -> list[KVCacheEvent]:
    return [BlockRemoved([name * 32])]


def test_each_subscriber_gets_each_batch_in_sequence() -> None:
    async def go() -> tuple[list[KvEventBatch | None], list[KvEventBatch | None]]:
        hub = KvEventHub()
        first, second = hub.subscribe(), hub.subscribe()
        hub.publish(_removed(b"a"), 1.0)
        hub.publish(_removed(b"b"), 2.0)
        hub.close()
        return [await first.next() for _ in range(3)], [await second.next() for _ in range(3)]

    first, second = asyncio.run(go())
    assert first == second
    assert [(b.sequence, b.timestamp) for b in first[:2] if b is not None] == [(1, 1.0), (2, 2.0)]
    assert first[2] is None  # closed


def test_a_full_queue_drops_the_oldest_and_says_so() -> None:
    async def go() -> list[KvEventBatch | None]:
        hub = KvEventHub()
        sub = hub.subscribe(max_pending=2)
        for name in (b"a", b"b", b"c"):
            hub.publish(_removed(name), 0.0)
        sub.close()
        return [await sub.next() for _ in range(2)]

    batch, end = asyncio.run(go())
    assert end is None
    assert batch is not None and batch.sequence == 3
    assert batch.events == [AllBlocksCleared(), *_removed(b"c")]


def test_a_closed_subscription_gets_nothing_more() -> None:
    async def go() -> None:
        hub = KvEventHub()
        sub = hub.subscribe()
        sub.close()
        assert hub.num_subscribers == 0
        hub.publish(_removed(b"a"), 0.0)
        assert await sub.next() is None

    asyncio.run(go())
