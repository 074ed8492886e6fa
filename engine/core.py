"""EngineCore: schedule -> execute -> update_from_output, step after step.

The core owns the scheduler and the worker and knows only token ids. Text
(tokenizing, detokenizing, stop strings) lives in the front end
(``engine.frontend``), which ``engine.llm`` (offline) and
``engine.async_engine`` (the service) share.
"""

from __future__ import annotations

import gc
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TypeVar

from engine.config import EngineConfig
from engine.kv_transfer.base import ConnectorContext, KVConnectorBase, KVConnectorRole, KVLayout
from engine.kv_transfer.registry import check_connector_config, create_connector
from engine.lora.adapter import LoRAAdapter
from engine.lora.request import LoRARequest
from engine.outputs import EngineCoreOutputs
from engine.pod_role import apply_role
from engine.request import Request, RequestStatus
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.scheduler import Scheduler
from engine.step_pipeline import StepPipeline
from engine.structured_output.backend import GrammarBackend
from engine.structured_output.manager import StructuredOutputManager
from engine.worker.worker import Worker, WorkerInfo

logger = logging.getLogger(__name__)


class EngineCore:
    """Not thread-safe: call every method from one thread."""

    # A step with nothing to compute (every request waits on a KV transfer)
    # sleeps this long, so the loop polls transfers instead of spinning.
    IDLE_POLL_SECONDS = 0.002

    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None) -> None:
        """`connector` (scheduler role) overrides the one config.kv_transfer names."""
        # What the pod's role implies (a prefill pod does not speculate).
        config = apply_role(config)
        spec = config.speculative
        kv = config.kv_transfer
        if connector is None and kv is not None:
            # Before the model loads: a misspelled connector option stops
            # the start at once, not after minutes of loading weights.
            check_connector_config(kv)
        # Asynchronous scheduling: the worker is built on, and steps run on,
        # the pipeline's runner thread (engine.step_pipeline).
        self.pipeline: StepPipeline | None = None
        runner_thread = None
        if config.scheduler.async_scheduling:
            runner_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-runner")
            self.pipeline = StepPipeline(runner_thread, self.IDLE_POLL_SECONDS)
        self.worker = _call_on(
            runner_thread,
            lambda: Worker(
                config.model,
                config.cache,
                config.scheduler.max_num_seqs,
                spec,
                config.lora,
                # A connector moves whole blocks: every layer's KV stays.
                free_windowed_kv=kv is None and connector is None,
            ),
        )
        info = self.worker.info
        scheduler_config = replace(config.scheduler, max_model_len=info.max_model_len)
        if spec is not None and spec.method == "draft_model":
            # The draft model writes KV for its own k - 1 drafts past the
            # verified tokens: those slots must be allocated too.
            scheduler_config = replace(
                scheduler_config, num_lookahead_tokens=spec.num_speculative_tokens
            )
        cache_config = replace(
            config.cache, num_blocks=info.num_blocks, group_windows=info.kv_group_windows
        )
        self.config = replace(config, scheduler=scheduler_config, cache=cache_config)
        self.engine_id = uuid.uuid4().hex
        self.worker_connector: KVConnectorBase | None = None
        if connector is None and config.kv_transfer is not None:
            context = self._connector_context()
            connector = create_connector(KVConnectorRole.SCHEDULER, context)
            self.worker_connector = create_connector(KVConnectorRole.WORKER, context)
            self.worker.runner.attach_connector(self.worker_connector)
        self.structured_output = StructuredOutputManager(
            partial(_xgrammar_backend, info.model_path, info.vocab_size)
        )
        scheduler_class = AsyncScheduler if scheduler_config.async_scheduling else Scheduler
        self.scheduler = scheduler_class(
            scheduler_config,
            cache_config,
            connector=connector,
            kv_load_failure_policy=kv.kv_load_failure_policy if kv is not None else "recompute",
            structured_output=self.structured_output,
            num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0,
            max_loras=config.lora.max_loras if config.lora is not None else 0,
        )
        # Unloaded adapters whose requests still run (see remove_lora).
        self._loras_to_remove: set[int] = set()
        _call_on(runner_thread, self.worker.runner.warmup)
        # Everything allocated so far lives as long as the engine: keep it
        # out of the cyclic GC's generations so steps don't pay to scan it.
        # Only the young generations are collected first: a full collection
        # here scanned ~320k objects of the imports for ~1 s of every start
        # and found ~60 objects of garbage (the default model, 2 cores).
        gc.collect(1)
        gc.freeze()

    def _connector_context(self) -> ConnectorContext:
        assert self.config.kv_transfer is not None
        spec = self.worker.loaded.spec
        layout = KVLayout(
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            block_size=self.config.cache.block_size,
            dtype=self.worker.info.kv_cache_dtype,
            weight_format=_kv_weight_format(self.worker.info),
        )
        return ConnectorContext(
            self.config.kv_transfer, self.worker.info.model_name, layout, self.engine_id
        )

    def connector_health(self) -> str | None:
        """Why a KV connector is not working, or None."""
        for connector in (self.scheduler.kv_transfers.connector, self.worker_connector):
            problem = connector.health() if connector is not None else None
            if problem is not None:
                return problem
        return None

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

    def release_held_kv(self, request_ids: Iterable[str]) -> None:
        """Frees KV blocks that finished requests hold for a remote decode
        nobody will run (see Scheduler.release_held_kv)."""
        self.scheduler.release_held_kv(request_ids)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block no request holds (see
        Scheduler.reset_prefix_cache); False if a running request holds any."""
        return self.scheduler.reset_prefix_cache()

    def add_lora(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """An adapter the front door loaded and checked (engine.lora.registry)."""
        slots = self.worker.runner.lora
        if slots is None:
            raise RuntimeError("LoRA is off: the engine has no adapter slots")
        self._runner_idle()
        slots.add(request, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drops an adapter's weights once no request runs under it: the
        front door already refuses new ones, those in flight finish."""
        self._loras_to_remove.add(lora_int_id)
        self._remove_idle_loras()

    def _remove_idle_loras(self) -> None:
        slots = self.worker.runner.lora
        if slots is None:
            return
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        idle = self._loras_to_remove - in_use
        if idle:
            self._runner_idle()  # a step in flight may still run under them
        for lora_int_id in idle:
            slots.remove(lora_int_id)
        self._loras_to_remove &= in_use

    def _runner_idle(self) -> None:
        """Before the engine thread touches the runner's state."""
        if self.pipeline is not None:
            self.pipeline.wait_idle()

    @property
    def idle_poll_seconds(self) -> float | None:
        """How often the KV connector wants ``poll_idle`` while the engine
        has no work (None: never)."""
        connector = self.worker_connector
        return connector.idle_poll_seconds if connector is not None else None

    def poll_idle(self) -> None:
        if self.worker_connector is not None:
            self.worker_connector.poll_idle()

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or (
            self.pipeline is not None and self.pipeline.has_in_flight
        )

    def step(self) -> EngineCoreOutputs:
        """Runs one step; returns its outputs. With
        asynchronous scheduling: submits the next step and returns the
        outputs of the one that was in flight."""
        if self.pipeline is not None:
            outputs = self.pipeline.step(self.scheduler, self.worker)
            if self._loras_to_remove:
                self._remove_idle_loras()
            return outputs
        if not self.scheduler.has_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            time.sleep(self.IDLE_POLL_SECONDS)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        drafts = self.worker.runner.take_draft_token_ids()
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)
        if self._loras_to_remove:
            self._remove_idle_loras()
        return outputs

    def stats_only(self) -> EngineCoreOutputs:
        """A step's worth of stats without a step: what an idle engine
        reports after commands (aborts) changed its state."""
        return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shutdown()
        self.scheduler.shutdown()
        self.structured_output.shutdown()
        if self.worker_connector is not None:
            self.worker_connector.shutdown()


_T = TypeVar("_T")


def _call_on(thread: ThreadPoolExecutor | None, fn: Callable[[], _T]) -> _T:
    """``fn()`` on ``thread`` (None: this one)."""
    return fn() if thread is None else thread.submit(fn).result()


def _xgrammar_backend(model_path: Path, vocab_size: int) -> GrammarBackend:
    """Built in the grammar pool on the first constrained request: xgrammar
    and the tokenizer info load only on a server that sees one."""
    from engine.models.loader import load_tokenizer
    from engine.structured_output.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(load_tokenizer(model_path), vocab_size)


def _kv_weight_format(info: WorkerInfo) -> str:
    """The weights' format as KV blocks are keyed by it (KVLayout.weight_format),
    int8 activations included where on: the K/V projections then round their
    inputs, so their blocks and the exact path's are not interchangeable."""
    if info.numerics.int8_activations:
        return f"{info.weight_format} int8-activations"
    return info.weight_format
