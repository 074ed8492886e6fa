"""RedisConnector: KV blocks in Redis, shared by every pod of a model.

Each block is one Redis string under ``{key_prefix}kv:{namespace}:{block
hash}`` (``connectors.block_codec``): a pod with the same model, weight
format and layout reuses any other pod's prefix; a frame found under another
block's key is refused (counted ``corrupt``) and the block recomputed. One
pipeline per batch: a lookup is one round trip of EXISTS for a request's
blocks, a load one MGET, a save one pipeline of SETs.

Extra config (``kv_connector_extra_config``; ``RedisOptions`` below, plus
``StoreOptions``'s ``load_async`` and ``load_wait_seconds``):

* ``url``: ``redis://[user:password@]host:port/db`` or ``rediss://...`` for
  TLS (redis-py's URL options, e.g. ``?ssl_ca_certs=/path/ca.pem``). Default
  ``redis://127.0.0.1:6379/0``.
* ``key_prefix``: prepended to every key (default ``"tandem:"``).
* ``ttl_seconds``: expiry of a saved block (default none: blocks stay until
  Redis evicts them).
* ``socket_timeout``: seconds before a Redis call counts as failed (default 2).

Memory: run Redis with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
(or ``volatile-lru`` with ``ttl_seconds``), so old blocks make room for new
ones. Under ``noeviction`` a full Redis refuses saves: they are logged and
dropped, and later requests recompute what was not saved.

A Redis that is down or restarting costs only speed: lookups report no hit,
loads fail (the scheduler recomputes those blocks) and saves are dropped,
each logged at most every 30 s; redis-py reconnects on the next call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import redis

from connectors.block_codec import BlockCodec
from connectors.kv_blocks import Frames
from connectors.store import BlockStore
from connectors.store_connector import StoreConnector, StoreOptions
from engine.kv_transfer.base import ConnectorContext
from engine.kv_transfer.options import option

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
_LOG_EVERY_SECONDS = 30.0


class RedisBlockStore:
    local_lookups = False

    def __init__(
        self,
        codec: BlockCodec,
        url: str = DEFAULT_URL,
        *,
        key_prefix: str = "tandem:",
        ttl_seconds: float | None = None,
        socket_timeout: float = 2.0,
    ) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url={url!r} is invalid: expected redis://, rediss:// or unix://")
        self.codec = codec
        self.key_prefix = key_prefix
        self.ttl_ms = None if ttl_seconds is None else max(1, int(ttl_seconds * 1000))
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self.last_error: str | None = None
        self._last_logged = 0.0

    def _key(self, block_hash: bytes) -> str:
        return self.codec.text_key(block_hash, self.key_prefix)

    def _failed(self, what: str, error: Exception) -> None:
        self.last_error = f"{what}: {type(error).__name__}: {error}"
        now = time.monotonic()
        if now - self._last_logged > _LOG_EVERY_SECONDS:
            self._last_logged = now
            logger.warning("Redis KV store %s (recomputing instead)", self.last_error)

    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]:
        if not hashes:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self._key(h))
            found = [bool(n) for n in pipe.execute()]
        except redis.RedisError as e:
            self._failed("lookup failed", e)
            return [False] * len(hashes)
        self.last_error = None
        return found

    def read_into(self, hashes: Sequence[bytes], frames: Frames) -> list[int]:
        if not hashes:
            return []
        try:
            values: list[Any] = self.client.mget([self._key(h) for h in hashes])
        except redis.RedisError as e:
            self._failed("load failed", e)
            return [-1] * len(hashes)
        self.last_error = None
        lengths = []
        for row, value in zip(frames, values, strict=True):
            if value is None:
                lengths.append(-1)
                continue
            if len(value) == len(row):
                row[:] = np.frombuffer(value, np.uint8)
            lengths.append(len(value))
        return lengths

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> bool:
        if not items:
            return True
        try:
            pipe = self.client.pipeline(transaction=False)
            for h, frame in items:
                pipe.set(self._key(h), frame, px=self.ttl_ms)
            pipe.execute()
        except redis.RedisError as e:
            self._failed("save failed", e)
            return False
        self.last_error = None
        return True

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True)
class RedisOptions(StoreOptions):
    url: str = option(DEFAULT_URL, "redis:// or rediss:// URL, with redis-py's URL options")
    key_prefix: str = option("tandem:", "prepended to every key")
    ttl_seconds: float | None = option(None, "expiry of a saved block (null: none)")
    socket_timeout: float = option(2.0, "seconds before a Redis call counts as failed")


class RedisConnector(StoreConnector):
    """Loads hits asynchronously by default: a load is a network transfer."""

    default_load_async = True
    options_class: ClassVar[type[StoreOptions]] = RedisOptions

    def make_store(self, context: ConnectorContext) -> BlockStore:
        options = RedisOptions.of(context.config)
        return RedisBlockStore(
            BlockCodec(context.model_name, context.layout),
            options.url,
            key_prefix=options.key_prefix,
            ttl_seconds=options.ttl_seconds,
            socket_timeout=options.socket_timeout,
        )
