"""The ZMQ publisher over real sockets on loopback: what a vLLM consumer
receives, the replay protocol, and that no subscriber can hold it up."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from engine.config import ConfigError
from engine.kv_cache.events import BlockRemoved, BlockStored
from engine.kv_events import KvEventHub
from service.kv_event_publisher import ReplayBuffer, ZmqKvEventPublisher
from service.kv_events_config import KvEventsConfig

END = (-1).to_bytes(8, "big", signed=True)
ANY_PORT = "tcp://127.0.0.1:*"  # the * makes the publisher bind (vLLM's rule)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def block(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def stored(i: int, tokens: int = 16) -> BlockStored:
    return BlockStored([block(i)], None, [i] * tokens, 16)


def events_of(payload: bytes) -> list[list[Any]]:
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    return list(events)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
) -> list[tuple[int, bytes]]:
    """A DEALER client of the replay protocol: the batches from `start` on,
    checked to end with the end-of-replay marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out: list[tuple[int, bytes]] = []
    try:
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def publisher(**kwargs: Any) -> ZmqKvEventPublisher:
    return ZmqKvEventPublisher(KvEventsConfig(ANY_PORT, **kwargs))


async def started(pub: ZmqKvEventPublisher) -> KvEventHub:
    hub = KvEventHub()
    pub.start(hub.subscribe())
    return hub


@pytest.mark.slow
def test_subscriber_gets_topic_sequence_and_payload(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async def go() -> list[list[bytes]]:
        pub = publisher(topic="kv@pod-a@model")
        sub = ctx.socket(zmq.SUB)
        sub.connect(pub.endpoint)
        sub.subscribe(b"")
        hub = await started(pub)
        received: list[list[bytes]] = []
        while not received:  # ZMQ's slow joiner: send until the subscription is up
            hub.publish([stored(0)], 1.0)
            await asyncio.sleep(0.02)
            if sub.poll(0):
                received.append(sub.recv_multipart())
        hub.publish([stored(1), BlockRemoved([block(0)])], 2.0)
        hub.publish([stored(2)], 3.0)
        await pub.close()  # sends what is queued first
        while sub.poll(2000):
            received.append(sub.recv_multipart())
        sub.close(linger=0)
        return received

    received = asyncio.run(go())
    assert all(topic == b"kv@pod-a@model" for topic, _, _ in received)
    sequences = [int.from_bytes(seq, "big") for _, seq, _ in received]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
    assert all(len(seq) == 8 for _, seq, _ in received)
    *_, second_last, last = [events_of(payload) for _, _, payload in received]
    assert [e[0] for e in second_last] == ["BlockStored", "BlockRemoved"]
    assert last[0][3] == [2] * 16


def test_connects_to_a_subscriber_that_binds(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """llm-d's way: the indexer binds, each pod connects to it."""
    sub = ctx.socket(zmq.SUB)
    sub.bind(ANY_PORT)
    sub.subscribe(b"")
    address = sub.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(address, bytes)

    async def go() -> list[bytes]:
        pub = ZmqKvEventPublisher(KvEventsConfig(address.decode()))
        hub = await started(pub)
        try:
            while True:
                hub.publish([stored(0)], 1.0)
                await asyncio.sleep(0.02)
                if sub.poll(0):
                    return sub.recv_multipart()
        finally:
            await pub.close()

    _, _, payload = asyncio.run(go())
    assert events_of(payload)[0][0] == "BlockStored"


def test_replay_returns_the_requested_range_and_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    async def go() -> None:
        pub = publisher(replay_endpoint=ANY_PORT)
        await started(pub)
        for i in range(5):
            pub.submit([stored(i)], float(i))
        wait_for(lambda: pub.num_sent == 5)
        assert pub.replay_endpoint is not None
        batches = replay(ctx, pub.replay_endpoint, 2)
        assert [seq for seq, _ in batches] == [2, 3, 4]
        assert [events_of(p)[0][3][0] for _, p in batches] == [2, 3, 4]
        assert replay(ctx, pub.replay_endpoint, 5) == []  # nothing newer: only the marker
        await pub.close()

    asyncio.run(go())


def test_replay_keeps_only_the_last_buffer_steps(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async def go() -> None:
        pub = publisher(replay_endpoint=ANY_PORT, buffer_steps=3)
        await started(pub)
        for i in range(5):
            pub.submit([stored(i)], float(i))
        wait_for(lambda: pub.num_sent == 5)
        assert pub.replay_endpoint is not None
        assert [seq for seq, _ in replay(ctx, pub.replay_endpoint, 0)] == [2, 3, 4]
        await pub.close()

    asyncio.run(go())


def test_a_malformed_replay_request_gets_no_answer(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    async def go() -> None:
        pub = publisher(replay_endpoint=ANY_PORT)
        await started(pub)
        pub.submit([stored(0)], 0.0)
        assert pub.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send(bytes(8))  # no empty delimiter frame: vLLM ignores it too
        assert not dealer.poll(300)
        dealer.close(linger=0)
        wait_for(lambda: pub.num_sent == 1)
        assert [seq for seq, _ in replay(ctx, pub.replay_endpoint, 0)] == [0]
        await pub.close()

    asyncio.run(go())


def test_a_subscriber_that_never_reads_does_not_hold_up_publishing(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    async def go() -> None:
        pub = publisher(hwm=1, replay_endpoint=ANY_PORT)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.connect(pub.endpoint)
        sub.subscribe(b"")  # and never reads
        await started(pub)
        await asyncio.sleep(0.2)
        start = time.monotonic()
        accepted = [pub.submit([stored(i, tokens=512)], 0.0) for i in range(3000)]
        submitting = time.monotonic() - start
        assert all(accepted) and submitting < 2.0
        wait_for(lambda: pub.num_sent == 3000)  # the thread was not stuck either
        assert pub.replay_endpoint is not None
        assert [seq for seq, _ in replay(ctx, pub.replay_endpoint, 2999)] == [2999]
        sub.close(linger=0)
        await pub.close()

    asyncio.run(go())


def test_a_full_queue_drops_counts_logs_and_then_clears(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        pub = publisher(max_queue_size=2, replay_endpoint=ANY_PORT)
        with caplog.at_level(logging.WARNING):
            # Not started: nothing empties the queue, and submit must not wait.
            assert [pub.submit([stored(i)], 0.0) for i in range(5)] == [True] * 2 + [False] * 3
        assert pub.queue_drops.count == 3
        assert [r.getMessage() for r in caplog.records] == [
            "KV events: 1 batch(es) dropped so far (the publisher thread is behind: "
            "its queue is full)"
        ]
        await started(pub)
        wait_for(lambda: pub.num_sent == 2)
        pub.submit([stored(5)], 0.0)
        pub.submit([stored(6)], 0.0)
        wait_for(lambda: pub.num_sent == 4)
        assert pub.replay_endpoint is not None
        after = [events_of(p) for _, p in replay(ctx, pub.replay_endpoint, 2)]
        # What was lost is unknown to consumers: they are told to forget, once.
        assert [e[0] for e in after[0]] == ["AllBlocksCleared", "BlockStored"]
        assert [e[0] for e in after[1]] == ["BlockStored"]
        await pub.close()

    asyncio.run(go())


def test_a_taken_port_is_a_listen_error_naming_the_flag(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    holder = ctx.socket(zmq.PUB)
    holder.bind("tcp://*:*")
    address = holder.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(address, bytes)
    port = address.decode().rsplit(":", 1)[1]
    with pytest.raises(ConfigError, match=rf"^--kv-events-endpoint: cannot bind tcp://\*:{port}"):
        ZmqKvEventPublisher(KvEventsConfig(f"tcp://*:{port}"))
    with pytest.raises(ConfigError, match=r"^--kv-events-replay-endpoint: cannot bind"):
        ZmqKvEventPublisher(KvEventsConfig(ANY_PORT, replay_endpoint=f"tcp://127.0.0.1:{port}"))
    holder.close(linger=0)


def test_replay_buffer_since() -> None:
    buffer = ReplayBuffer(3)
    assert list(buffer.since(0)) == []
    for seq in range(6):
        buffer.append(seq, bytes([seq]))
    assert [s for s, _ in buffer.since(0)] == [3, 4, 5]
    assert [s for s, _ in buffer.since(4)] == [4, 5]
    assert list(buffer.since(6)) == []
