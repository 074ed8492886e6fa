"""MultiConnector: several connectors as tiers, e.g. shared memory, then Redis.

Every tier saves what the engine computes (and what it loaded from another
tier, so a block fetched from Redis is in shared memory next time). For a
new request each tier says how many tokens it holds past the local prefix
hit; the tier holding the most loads them (the earlier tier on a tie).

Extra config (``MultiOptions``): ``{"connectors": [{"kv_connector": "shm",
"kv_connector_extra_config": {...}}, {"kv_connector": "redis", ...}]}``;
each tier takes the multi connector's ``kv_role``, and its extra config is
checked by its own connector.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from engine.config import ConfigError, KVTransferConfig
from engine.kv_transfer.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.kv_transfer.options import ConnectorOptions, option, refuse_unknown_keys
from engine.kv_transfer.params import KVTransferParams
from engine.kv_transfer.registry import connector_class, create_connector

if TYPE_CHECKING:
    from engine.kv_cache.events import KVCacheEvent
    from engine.kv_cache.manager import KVCacheBlocks
    from engine.kv_transfer.base import Claim
    from engine.outputs import KVConnectorOutput
    from engine.request import Request
    from engine.sched.output import SchedulerOutput
    from engine.stats import KVConnectorStats


# The keys of one entry of ``connectors``.
_TIER_KEYS = ("kv_connector", "kv_connector_extra_config")


@dataclass(frozen=True)
class MultiOptions(ConnectorOptions):
    # null is refused by _tier_configs, with what an entry must hold.
    connectors: list[Any] | None = option(
        None, "the tiers, in order: [{kv_connector, kv_connector_extra_config}, ...]"
    )


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    per_tier: list[KVConnectorMetadata]


class MultiConnector(KVConnectorBase):
    options_class: ClassVar[type[MultiOptions]] = MultiOptions

    def __init__(self, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(role, context)
        self.tiers = [
            create_connector(role, replace(context, config=config))
            for config in _tier_configs(context.config)
        ]
        self._chosen: dict[str, int] = {}  # request id -> tier that loads it

    @classmethod
    def check_config(
        cls, config: KVTransferConfig, where: str = "kv_connector_extra_config"
    ) -> None:
        """Its own keys, then each tier's, by that tier's connector."""
        super().check_config(config, where)
        for i, tier in enumerate(_tier_configs(config)):
            tier_where = f"{where}.connectors[{i}].kv_connector_extra_config"
            connector_class(tier.kv_connector).check_config(tier, tier_where)

    # ---- side channel: the tiers' ----------------------------------------

    @classmethod
    def side_channel_connectors(cls, config: KVTransferConfig) -> tuple[str, ...]:
        return tuple(
            name
            for tier in _tier_configs(config)
            for name in connector_class(tier.kv_connector).side_channel_connectors(tier)
        )

    @classmethod
    def with_side_channel(cls, config: KVTransferConfig, host: str, port: int) -> KVTransferConfig:
        """Each tier's entry told as that tier's class would be (a tier is
        built from its own entry's extra config, not from this one's)."""
        tiers = _tier_configs(config)  # checks the entries
        told = []
        for entry, tier in zip(config.kv_connector_extra_config["connectors"], tiers, strict=True):
            tier_told = connector_class(tier.kv_connector).with_side_channel(tier, host, port)
            told.append({**entry, "kv_connector_extra_config": tier_told.kv_connector_extra_config})
        extra = {**config.kv_connector_extra_config, "connectors": told}
        return replace(config, kv_connector_extra_config=extra)

    # ---- scheduler half -------------------------------------------------

    def request_added(self, request: Request) -> None:
        for tier in self.tiers:
            tier.request_added(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answers = [t.get_num_new_matched_tokens(request, num_computed_tokens) for t in self.tiers]
        if any(count is None for count, _ in answers):
            return None, False
        best = max(range(len(answers)), key=lambda i: (answers[i][0] or 0, -i))
        self._chosen[request.request_id] = best
        return answers[best]

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._chosen.pop(request.request_id, 0)
        for i, tier in enumerate(self.tiers):
            tier.update_state_after_alloc(
                request, blocks, num_external_tokens if i == chosen else 0
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return MultiConnectorMetadata(
            [t.build_connector_meta(scheduler_output) for t in self.tiers]
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for tier in self.tiers:
            tier.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._chosen.pop(request.request_id, None)
        delay, params = False, None
        for tier in self.tiers:
            tier_delay, tier_params = tier.request_finished(request, block_ids)
            delay = delay or tier_delay
            params = params if params is not None else tier_params
        return delay, params

    def request_released(self, request: Request) -> None:
        for tier in self.tiers:
            tier.request_released(request)

    def take_events(self) -> list[KVCacheEvent]:
        return [event for tier in self.tiers for event in tier.take_events()]

    # ---- worker half ----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        for tier in self.tiers:
            tier.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if isinstance(metadata, MultiConnectorMetadata):
            for tier, meta in zip(self.tiers, metadata.per_tier, strict=True):
                tier.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for tier in self.tiers:
            tier.clear_connector_metadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        for tier in self.tiers:
            tier.start_load_kv(**kwargs)

    def wait_for_save(self) -> None:
        for tier in self.tiers:
            tier.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for tier in self.tiers:
            s, r = tier.get_finished(finished_req_ids)
            sending |= s or set()
            recving |= r or set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return {b for tier in self.tiers for b in tier.get_block_ids_with_load_errors()}

    def take_stats(self) -> KVConnectorStats | None:
        total: KVConnectorStats | None = None
        for tier in self.tiers:
            stats = tier.take_stats()
            if stats is None:
                continue
            if total is None:
                total = stats
            else:
                total.add(stats)
        return total

    def side_channel_payload(self) -> bytes | None:
        return next((p for t in self.tiers if (p := t.side_channel_payload()) is not None), None)

    @property
    def idle_poll_seconds(self) -> float | None:  # type: ignore[override]
        wanted = [t.idle_poll_seconds for t in self.tiers if t.idle_poll_seconds is not None]
        return min(wanted) if wanted else None

    def poll_idle(self) -> None:
        for tier in self.tiers:
            tier.poll_idle()

    def release_hold(self, claim: bytes) -> Claim | None:
        return next((a for t in self.tiers if (a := t.release_hold(claim)) is not None), None)

    def health(self) -> str | None:
        return next((p for t in self.tiers if (p := t.health()) is not None), None)

    def shutdown(self) -> None:
        for tier in self.tiers:
            tier.shutdown()


def _tier_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    tiers = MultiOptions.of(config).connectors
    if not tiers:
        raise ConfigError(
            "kv_connector_extra_config.connectors is invalid for the multi connector: "
            "expected a non-empty list of {kv_connector, kv_connector_extra_config}"
        )
    return [_tier_config(config, i, tier) for i, tier in enumerate(tiers)]


def _tier_config(config: KVTransferConfig, i: int, tier: object) -> KVTransferConfig:
    where = f"kv_connector_extra_config.connectors[{i}]"
    if isinstance(tier, dict):
        refuse_unknown_keys(f"{where} of the multi connector", tier, _TIER_KEYS)
    if not isinstance(tier, dict) or "kv_connector" not in tier:
        raise ConfigError(f"{where} lacks kv_connector")
    extra = tier.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ConfigError(
            f"{where}.kv_connector_extra_config={extra!r} is invalid: expected an object"
        )
    return replace(config, kv_connector=tier["kv_connector"], kv_connector_extra_config=extra)
