"""Settings of the ZMQ KV-event publisher (`tandem serve --kv-events-*`).

The names, defaults and the bind-or-connect rule are vLLM's (its
``KVEventsConfig`` and ``ZmqEventPublisher``), so a deployment written for
vLLM's ``--kv-events-config`` moves over flag for flag.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

from engine.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)

ENDPOINT_FLAG = "--kv-events-endpoint"
REPLAY_FLAG = "--kv-events-replay-endpoint"
BUFFER_FLAG = "--kv-events-buffer-steps"

DEFAULT_BUFFER_STEPS = 10_000  # vLLM's

_TCP = re.compile(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\*|\d{1,5})")


@dataclass(frozen=True)
class KvEventsConfig:
    """``endpoint``: where the PUB socket sends (bound or connected, see
    ``binds``). ``replay_endpoint``: the ROUTER socket that answers replay
    requests, always bound; None: no replay. ``buffer_steps``: how many of
    the last batches replay can return. ``hwm``: the PUB socket's send
    high-water mark per subscriber (past it ZMQ drops for that subscriber,
    which sees a gap in the sequence numbers). ``max_queue_size``: batches
    waiting for the publisher thread (past it the batch is dropped, counted,
    logged, and the next batch starts with AllBlocksCleared)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = 100_000
    max_queue_size: int = 100_000

    def __post_init__(self) -> None:
        check_endpoint(ENDPOINT_FLAG, self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint(REPLAY_FLAG, self.replay_endpoint)
        if self.buffer_steps < 1:
            raise ConfigError(f"{BUFFER_FLAG}: must be >= 1, got {self.buffer_steps}")
        if self.hwm < 0:
            raise ConfigError(f"hwm: must be >= 0 (0: no limit), got {self.hwm}")
        if self.max_queue_size < 1:
            raise ConfigError(f"max_queue_size: must be >= 1, got {self.max_queue_size}")


def check_endpoint(flag: str, endpoint: str) -> None:
    """Raises ConfigError naming ``flag`` unless ``endpoint`` is a ZMQ
    address Tandem can use: tcp://HOST:PORT (PORT may be * for any free
    one), ipc://PATH or inproc://NAME."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        match = _TCP.fullmatch(endpoint)
        ok = match is not None and (match[2] == "*" or 1 <= int(match[2]) <= 65535)
    else:
        ok = scheme in ("ipc", "inproc") and bool(rest)
    if not ok:
        raise ConfigError(
            f"{flag}: {endpoint!r} is not a ZMQ endpoint: expected tcp://HOST:PORT "
            "(tcp://*:5557 listens on every interface), ipc://PATH or inproc://NAME"
        )


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard address (``*`` or
    ``::``), an ipc or an inproc one; connect to anything else, so that a
    pod can push its events to a subscriber that listens (llm-d's indexer
    binds ``tcp://*:5557`` and the pods connect to it)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def recording_events(config: EngineConfig) -> EngineConfig:
    """``config`` with the engine's KV cache events on: the block pool
    records them only when asked (``CacheConfig.enable_kv_events``), and
    the publisher has nothing to send without them."""
    if not config.cache.enable_prefix_caching:
        logger.warning(
            "%s with prefix caching off: no block is ever cached, so no event is sent",
            ENDPOINT_FLAG,
        )
    return replace(config, cache=replace(config.cache, enable_kv_events=True))
