"""EngineCore: schedule -> execute -> update_from_output, step after step.

The core owns the scheduler and the worker and knows only token ids. Text
(tokenizing, detokenizing, stop strings) lives in the front ends
(``engine.llm`` offline, ``engine.async_engine`` for the service).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable
from dataclasses import replace

from connectors.base import KVConnectorBase
from engine.config import EngineConfig
from engine.outputs import EngineCoreOutputs
from engine.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from engine.worker.worker import Worker, WorkerInfo

logger = logging.getLogger(__name__)


class EngineCore:
    """Not thread-safe: call every method from one thread."""

    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None) -> None:
        self.worker = Worker(config.model, config.cache, config.scheduler.max_num_seqs)
        info = self.worker.info
        scheduler_config = replace(config.scheduler, max_model_len=info.max_model_len)
        cache_config = replace(config.cache, num_blocks=info.num_blocks)
        self.config = replace(config, scheduler=scheduler_config, cache=cache_config)
        self.scheduler = Scheduler(scheduler_config, cache_config, connector=connector)
        self.worker.runner.warmup()
        # Everything allocated so far lives as long as the engine: keep it
        # out of the cyclic GC's generations so steps don't pay to scan it.
        gc.collect()
        gc.freeze()

    @property
    def info(self) -> WorkerInfo:
        return self.worker.info

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Runs one step; returns outputs grouped by client index."""
        if not self.scheduler.has_requests():
            return {}
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def stats_only(self) -> dict[int, EngineCoreOutputs]:
        """A step's worth of stats without a step: what an idle engine
        reports after commands (aborts) changed its state."""
        return {0: EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())}

    def shutdown(self) -> None:
        self.scheduler.shutdown()
