"""Tandem's inference engine: scheduler, KV cache, model runner. No networking.

What the service uses is exported here. The names are imported on first use
(PEP 562), so importing a torch-free part such as ``engine.sched`` does not
pull in the model runner through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine as AsyncEngine
    from engine.chat_template import ChatMessage as ChatMessage
    from engine.config import ConfigError as ConfigError
    from engine.config import EngineConfig as EngineConfig
    from engine.errors import EngineDeadError as EngineDeadError
    from engine.errors import EngineDrainingError as EngineDrainingError
    from engine.errors import InvalidRequestError as InvalidRequestError
    from engine.errors import QueueFullError as QueueFullError
    from engine.input_processor import InputProcessor as InputProcessor
    from engine.input_processor import ProcessedPrompt as ProcessedPrompt
    from engine.kv_cache.events import AllBlocksCleared as AllBlocksCleared
    from engine.kv_cache.events import BlockRemoved as BlockRemoved
    from engine.kv_cache.events import BlockStored as BlockStored
    from engine.kv_cache.events import KVCacheEvent as KVCacheEvent
    from engine.kv_events import KvEventBatch as KvEventBatch
    from engine.kv_events import KvEventSubscription as KvEventSubscription
    from engine.observer import EngineObserver as EngineObserver
    from engine.output_processor import RequestOutput as RequestOutput
    from engine.output_processor import TokenLogprob as TokenLogprob
    from engine.request import FinishReason as FinishReason
    from engine.request import Request as Request
    from engine.request_options import RequestOptions as RequestOptions
    from engine.sampling_params import SamplingParams as SamplingParams
    from engine.sampling_params import SamplingParamsError as SamplingParamsError
    from engine.stats import SchedulerStats as SchedulerStats
    from engine.stats import TransferFailure as TransferFailure
    from engine.status import EngineStatus as EngineStatus
    from engine.streams import RequestStream as RequestStream
    from engine.worker.worker import WorkerInfo as WorkerInfo

_EXPORTS = {
    "AllBlocksCleared": "engine.kv_cache.events",
    "AsyncEngine": "engine.async_engine",
    "BlockRemoved": "engine.kv_cache.events",
    "BlockStored": "engine.kv_cache.events",
    "ChatMessage": "engine.chat_template",
    "ConfigError": "engine.config",
    "EngineConfig": "engine.config",
    "EngineDeadError": "engine.errors",
    "EngineDrainingError": "engine.errors",
    "EngineObserver": "engine.observer",
    "EngineStatus": "engine.status",
    "FinishReason": "engine.request",
    "InputProcessor": "engine.input_processor",
    "InvalidRequestError": "engine.errors",
    "KVCacheEvent": "engine.kv_cache.events",
    "KvEventBatch": "engine.kv_events",
    "KvEventSubscription": "engine.kv_events",
    "ProcessedPrompt": "engine.input_processor",
    "QueueFullError": "engine.errors",
    "Request": "engine.request",
    "RequestOptions": "engine.request_options",
    "RequestOutput": "engine.output_processor",
    "RequestStream": "engine.streams",
    "SamplingParams": "engine.sampling_params",
    "SamplingParamsError": "engine.sampling_params",
    "SchedulerStats": "engine.stats",
    "TokenLogprob": "engine.output_processor",
    "TransferFailure": "engine.stats",
    "WorkerInfo": "engine.worker.worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
