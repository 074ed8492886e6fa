"""Publishes the engine's KV cache events over ZMQ in vLLM's wire format.

    PUB     multipart [topic, sequence (8 bytes, big-endian), payload]
    ROUTER  request  [identity, b"", start sequence (8 bytes, big-endian)]
            replies  [identity, b"", sequence, payload] for each buffered
                     batch from the start on, then [identity, b"", -1, b""]

One batch per engine step that changed the prefix cache, numbered from 0.
The payload is ``service.kv_events_wire.encode_batch``.

Threads: the event loop only reads the engine's KV event subscription and
hands each batch to a bounded queue without waiting (``submit``). A
dedicated thread owns both sockets: it encodes, sends, keeps the last
``buffer_steps`` payloads and answers replay requests. A replay of ten
thousand batches, or a burst of large batches, therefore costs the loop
nothing, and nothing a subscriber does (slow, absent, gone) can block it:
the PUB socket drops for a subscriber past its high-water mark (the
subscriber sees the gap in the sequence numbers and can replay), and a
full queue drops the batch, counted and logged, and marks the next batch
with AllBlocksCleared so consumers forget rather than trust a stale view.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from engine.kv_cache.events import AllBlocksCleared, KVCacheEvent
from engine.kv_events import KvEventSubscription
from service.grpc_server import ListenError
from service.kv_events_config import ENDPOINT_FLAG, REPLAY_FLAG, KvEventsConfig, binds
from service.kv_events_wire import END_OF_REPLAY, encode_batch, sequence_frame

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05  # how long the thread waits for a batch before it checks replay requests
LINGER_MS = 1000  # on close, how long queued messages may still go out
DROP_LOG_SECONDS = 10.0  # at most one drop warning this often


@dataclass(frozen=True, slots=True)
class _Batch:
    events: list[KVCacheEvent]
    timestamp: float


class ReplayBuffer:
    """The last ``capacity`` payloads by sequence number. Sequences are
    contiguous, so a start sequence maps to an offset without a scan."""

    def __init__(self, capacity: int) -> None:
        self._entries: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    def append(self, sequence: int, payload: bytes) -> None:
        self._entries.append((sequence, payload))

    def since(self, start: int) -> Iterator[tuple[int, bytes]]:
        """The buffered batches numbered ``start`` or later, oldest first."""
        if not self._entries:
            return iter(())
        skip = max(0, start - self._entries[0][0])
        return itertools.islice(self._entries, skip, None)


@dataclass
class DropCounter:
    """Batches lost at one place, warned about at most every DROP_LOG_SECONDS.
    Each counter is touched by one thread only."""

    where: str
    count: int = 0
    _last_log: float = float("-inf")

    def record(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last_log >= DROP_LOG_SECONDS:
            self._last_log = now
            logger.warning("KV events: %d batch(es) dropped so far (%s)", self.count, self.where)


class ZmqKvEventPublisher:
    """Construct (binds or connects; a bad address raises ListenError naming
    the flag), ``start`` on the event loop with the engine's subscription,
    ``close`` on the loop when the engine has stopped."""

    def __init__(
        self, config: KvEventsConfig, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ):
        self.config = config
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._topic = config.topic.encode()
        self._queue: queue.Queue[_Batch] = queue.Queue(config.max_queue_size)
        self._buffer = ReplayBuffer(config.buffer_steps)
        self.num_sent = 0  # the thread's: batches handed to the PUB socket (next sequence)
        self._lost = False  # the loop's: a batch was dropped since the last one queued
        self.queue_drops = DropCounter("the publisher thread is behind: its queue is full")
        self.socket_drops = DropCounter("the PUB socket refused to queue it")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._pump: asyncio.Task[None] | None = None
        self._subscription: KvEventSubscription | None = None
        self._pub, self._replay = self._open_sockets()

    # --- set-up -----------------------------------------------------------------------

    def _open_sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        pub = self._context.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, LINGER_MS)
            _attach(pub, ENDPOINT_FLAG, self.config.endpoint, bind=binds(self.config.endpoint))
            if self.config.replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                # Room for a whole replay: a ROUTER drops silently past its HWM.
                replay.setsockopt(zmq.SNDHWM, self.config.buffer_steps + 1)
                replay.setsockopt(zmq.LINGER, 0)
                _attach(replay, REPLAY_FLAG, self.config.replay_endpoint, bind=True)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    @property
    def endpoint(self) -> str:
        """Where the PUB socket is: the bound address when it binds (the real
        port when the flag said *)."""
        return _last_endpoint(self._pub)

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else _last_endpoint(self._replay)

    def start(self, subscription: KvEventSubscription) -> None:
        """Starts the thread and, on the running loop, the task that feeds
        it ``subscription``'s batches (until the subscription ends)."""
        self._subscription = subscription
        self._thread.start()
        self._pump = asyncio.get_running_loop().create_task(self._feed(subscription))
        logger.info(
            "KV events (vLLM format) on %s%s, topic %r",
            self.endpoint,
            f"; replay on {self.replay_endpoint}" if self._replay is not None else "",
            self.config.topic,
        )

    async def _feed(self, subscription: KvEventSubscription) -> None:
        while (batch := await subscription.next()) is not None:
            self.submit(batch.events, batch.timestamp)

    # --- the loop's side --------------------------------------------------------------

    def submit(self, events: list[KVCacheEvent], timestamp: float) -> bool:
        """Queues one batch for sending; never waits. False when the queue
        was full and the batch was dropped."""
        if self._lost:
            events = [AllBlocksCleared(), *events]
        try:
            self._queue.put_nowait(_Batch(events, timestamp))
        except queue.Full:
            self._lost = True
            self.queue_drops.record()
            return False
        self._lost = False
        return True

    async def close(self) -> None:
        """Sends what is queued (the subscription's last batches included),
        stops the thread and closes the sockets."""
        if self._subscription is not None:
            self._subscription.close()  # the feed ends after what is queued
        if self._pump is not None:
            await self._pump
        self._stopping.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop; sockets left open")
            return
        await asyncio.to_thread(self._close_sockets)
        logger.info(
            "KV events: %d batch(es) published, %d dropped",
            self.num_sent,
            self.queue_drops.count + self.socket_drops.count,
        )

    def _close_sockets(self) -> None:
        self._pub.close()  # lingers LINGER_MS for subscribers to get the last batches
        if self._replay is not None:
            self._replay.close()
        if self._own_context:
            self._context.term()

    # --- the thread's side ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                self._serve_replays(self._replay)
            try:
                batch = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            try:
                self._send(batch)
            except Exception:
                # Keep the thread: one bad batch must not end the stream.
                logger.exception("KV events: sending a batch failed")

    def _send(self, batch: _Batch) -> None:
        sequence = self.num_sent
        payload = encode_batch(batch.events, batch.timestamp)
        # Buffered even if the socket drops it: replay can still give it.
        self._buffer.append(sequence, payload)
        try:
            self._pub.send_multipart(
                [self._topic, sequence_frame(sequence), payload], flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.socket_drops.record()
        self.num_sent = sequence + 1

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV events: replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            for sequence, payload in self._buffer.since(int.from_bytes(start, "big")):
                replay.send_multipart([client, b"", sequence_frame(sequence), payload])
            replay.send_multipart([client, b"", END_OF_REPLAY, b""])


def _attach(socket: zmq.Socket[bytes], flag: str, endpoint: str, *, bind: bool) -> None:
    try:
        if bind:
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect to"
        raise ListenError(f"{flag}: cannot {verb} {endpoint}: {exc}") from None


def _last_endpoint(socket: zmq.Socket[bytes]) -> str:
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()
