"""The one KV connector test double of the scheduler's unit tests: the
scheduler role only, configured per test, recording every hook call."""

from __future__ import annotations

from typing import Any

from engine.kv_cache.manager import KVCacheBlocks
from engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.kv_transfer.params import KVTransferParams
from engine.request import Request
from engine.sched.output import SchedulerOutput


class FakeConnector(KVConnectorBase):
    """Offers ``external[req_id]`` tokens per request (less those computed
    locally), to load at once or, with ``load_async``, while the request
    waits; for an id in ``unknown`` it does not know yet (None: ask again).

    At a finish it keeps the blocks: with ``delay_free``, every request's,
    answering params that name them (a P/D producer); else those of the
    requests in ``held``, answering no params (a save still under way).

    Records the hooks: ``allocs`` (id, block ids, external tokens),
    ``finished`` (id, block ids), ``metas`` (metadata built), ``released``
    (ids whose held blocks nobody will fetch).
    """

    def __init__(
        self,
        external: dict[str, int] | None = None,
        load_async: bool = False,
        delay_free: bool = False,
        held: set[str] | None = None,
    ) -> None:
        super().__init__(KVConnectorRole.SCHEDULER)
        self.external = external or {}
        self.load_async = load_async
        self.delay_free = delay_free
        self.held = held or set()
        self.unknown: set[str] = set()
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[tuple[str, list[int]]] = []
        self.metas = 0
        self.released: list[str] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self.unknown:
            return None, False
        ext = self.external.get(request.request_id, 0)
        ext = max(0, ext - num_computed_tokens)
        return ext, self.load_async and ext > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, blocks.get_block_ids()[0], num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.metas += 1
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self.finished.append((request.request_id, block_ids))
        if self.delay_free:
            return True, KVTransferParams(remote_block_ids=tuple(block_ids))
        return request.request_id in self.held, None

    def request_released(self, request: Request) -> None:
        self.released.append(request.request_id)

    def start_load_kv(self, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
