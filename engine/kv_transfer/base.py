"""The KV connector API: one class, two roles (as vLLM's KVConnectorBase_V1).

The engine owns this API and calls it; the implementations (Redis, shm,
NIXL, multi, ...) live in ``connectors/`` above the engine, and the engine
finds them by name (``engine.kv_transfer.registry``), never by import.

The scheduler creates the connector with role SCHEDULER and calls the
scheduler-side hooks from its single thread; each worker creates it with role
WORKER and calls the worker-side hooks around the forward pass. The two
halves talk only through the ``KVConnectorMetadata`` the scheduler builds each
step and the ``KVConnectorOutput`` the worker returns.

Contract for every hook: it must not block on network or disk I/O (the step
loop waits on it); a failure to load is reported as invalid block ids, never
raised into the step; a failure to save is logged and dropped.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from engine.kv_transfer.params import KVTransferParams

if TYPE_CHECKING:
    from engine.config import KVTransferConfig
    from engine.kv_cache.events import KVCacheEvent
    from engine.kv_cache.manager import KVCacheBlocks
    from engine.kv_transfer.options import ConnectorOptions
    from engine.outputs import KVConnectorOutput
    from engine.request import Request
    from engine.sched.output import SchedulerOutput
    from engine.stats import KVConnectorStats


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """Opaque per-step instructions from the scheduler half to the workers."""


class Claim(enum.Enum):
    """A producer's answer to a peer claiming the blocks it held for it
    (``KVConnectorBase.release_hold``; connectors/nixl_holds.py says what
    each answer proves)."""

    HELD = "held"  # the hold was live: the bytes read are its blocks; now released
    GONE = "gone"  # it ended (or never matched): the bytes read are not to be used
    UNKNOWN = "unknown"  # no such hold yet: it may be registered at the next step


@dataclass(frozen=True)
class KVLayout:
    """The shape of one KV block in every layer: what a stored block must
    match to be loaded into this engine's cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "int8" | "fp8_e4m3"
    # The weights' format in memory (``WorkerInfo.weight_format``, e.g.
    # "float32", "q4_1+q8_0"): the same tokens give different KV under
    # different weights, so blocks are shared only within one format. ""
    # (unknown) for contexts built before it was a fact; such a pod shares
    # only with other "" pods.
    weight_format: str = ""

    @property
    def elements_per_layer_half(self) -> int:
        """Elements of K (or of V) of one block in one layer: an int8
        cache's rows carry their float32 scale as 4 more (kernels/kv_int8.py)."""
        row = self.head_dim + 4 if self.dtype == "int8" else self.head_dim
        return self.block_size * self.num_kv_heads * row


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector is built from (``cls(role, context)``)."""

    config: KVTransferConfig
    model_name: str
    layout: KVLayout
    # Names this engine to its peers (unique per process).
    engine_id: str


class KVConnectorBase(ABC):
    """Base class of every KV connector."""

    # Whether peers fetch this connector's ``side_channel_payload`` over the
    # pod's gRPC port (``tandem.v1.KVTransfer``): the service then tells it
    # where that port is, as ``side_channel_host``/``side_channel_port`` in
    # its extra config, and serves the payload.
    needs_side_channel: ClassVar[bool] = False

    # The keys this connector takes in ``kv_connector_extra_config``, typed
    # (engine/kv_transfer/options.py): the engine refuses any other key at start,
    # so a misspelled option fails there instead of being silently ignored.
    # None: the connector reads the raw dict itself (third-party connectors
    # that declare none keep working as before).
    options_class: ClassVar[type[ConnectorOptions] | None] = None

    @classmethod
    def check_config(
        cls, config: KVTransferConfig, where: str = "kv_connector_extra_config"
    ) -> None:
        """Raise ConfigError if ``config``'s extra config is not what this
        class takes (``where`` names the dict in the error). The engine calls
        it before it loads the model; a composite checks its parts."""
        if cls.options_class is not None:
            cls.options_class.parse(config.kv_connector_extra_config, config.kv_connector, where)

    @classmethod
    def side_channel_connectors(cls, config: KVTransferConfig) -> tuple[str, ...]:
        """The names of the connectors that publish a side channel when this
        class is built from ``config``: its own if it needs one (a composite
        answers for its parts). Peers ask the side channel by that name."""
        return (config.kv_connector,) if cls.needs_side_channel else ()

    @classmethod
    def with_side_channel(cls, config: KVTransferConfig, host: str, port: int) -> KVTransferConfig:
        """``config`` telling a connector that needs a side channel where it
        is (unless its extra config already says); else ``config`` as is."""
        if not cls.needs_side_channel:
            return config
        extra = {"side_channel_host": host, "side_channel_port": port}
        extra.update(config.kv_connector_extra_config)
        return replace(config, kv_connector_extra_config=extra)

    def __init__(self, role: KVConnectorRole, context: ConnectorContext | None = None) -> None:
        self.role = role
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    # ---- scheduler role -------------------------------------------------

    def request_added(self, request: Request) -> None:  # noqa: B027
        """A request entered the scheduler (optional): e.g. a pull connector
        starts its handshake and heartbeats for a remote prefill at once,
        not when the request reaches the head of the queue. Must not block."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (the local prefix hit) that
        the connector can supply.

        Returns ``(count, load_async)``. ``count`` None means "not known yet,
        ask again next step" (the request is skipped this step). With
        ``load_async`` the request waits in WAITING_FOR_REMOTE_KVS while the
        load runs. The count must leave at least one prompt token to compute.
        Must not block.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Called once blocks are allocated for a request it matched; the
        last ``num_external_tokens`` worth of those blocks are to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Package this step's loads and saves for the workers and reset the
        per-step state. Called once per schedule()."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """See what the workers reported this step (optional)."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """A request finished. Return ``(delay_free, kv_transfer_params)``:
        with ``delay_free`` the scheduler keeps the blocks until the worker
        reports the request in ``finished_sending``. The params travel back
        to the client (P/D: where the decode side finds the KV)."""
        return False, None

    def request_released(self, request: Request) -> None:  # noqa: B027
        """Nobody will fetch the blocks held for ``request``, finished with
        ``delay_free`` (its decode side refused it, or a client aborted it
        after its prefill): stop holding them once nothing reads them, and
        report the request in ``finished_sending`` as usual. Optional: a
        hold that ends on its own (a save under way) needs no word."""

    def take_events(self) -> list[KVCacheEvent]:
        """KV events from the connector's own tiers (optional)."""
        return []

    # ---- worker role ----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: B027
        """Called once with the layer name -> KV tensor map."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's KV (before the forward pass)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the KV buffers
        (after the forward pass)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous (sending, receiving) transfers are done."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        return set()

    def take_stats(self) -> KVConnectorStats | None:
        """Failures (by kind) and lapsed leases since the last call, or None
        if there were none (optional). The scheduler sums them for metrics
        and ``GetServerStatus``."""
        return None

    def side_channel_payload(self) -> bytes | None:
        """What peers fetch over this pod's gRPC side channel
        (``tandem.v1.KVTransfer/GetHandshake``), or None without one.
        Called from the service's threads: must be thread-safe."""
        return None

    # Seconds between ``poll_idle`` calls while the engine has no work;
    # None: the connector needs none (nothing progresses without a step).
    idle_poll_seconds: float | None = None

    def poll_idle(self) -> None:
        """Worker role, engine thread, while the engine is idle: progress
        transfers that peers run against this pod (NIXL READs of our blocks
        need our side polled). Changes nothing the scheduler reads."""
        return None

    def release_hold(self, claim: bytes) -> Claim | None:
        """A peer that read blocks this pod held claims them
        (``tandem.v1.KVTransfer/ReleaseHold``); see connectors/nixl_holds.py
        for what the answer proves. None: this connector keeps no holds.
        Raises ValueError for a malformed claim. Called from the service's
        threads: must be thread-safe."""
        return None

    def health(self) -> str | None:
        """None while the connector works; otherwise why it does not (a
        wedged or dead transfer thread). The service reports NOT_SERVING."""
        return None

    def shutdown(self) -> None:  # noqa: B027
        """Release resources; called once."""
