"""vLLM 0.12.0's v1 Scheduler built without a model or a GPU, for the
baselines in this directory (run only in an interpreter that has vllm;
Tandem never imports this file or vllm)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch
from vllm.config import SchedulerConfig
from vllm.v1.core.sched import scheduler as vsched
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec


def make_scheduler(
    scheduler_config: SchedulerConfig,
    *,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
    prefix_caching: bool,
    structured_output_manager: object,
    log_stats: bool,
    scheduler_class: type[vsched.Scheduler] = vsched.Scheduler,
) -> vsched.Scheduler:
    """The scheduler over a stand-in VllmConfig (only the fields it reads)
    and one full-attention KV cache group of `num_blocks` blocks.
    `max_model_len`: as given to SchedulerConfig (which does not keep it)."""
    vllm_config = SimpleNamespace(
        scheduler_config=scheduler_config,
        cache_config=SimpleNamespace(
            num_gpu_blocks=num_blocks,
            enable_prefix_caching=prefix_caching,
            block_size=block_size,
        ),
        lora_config=None,
        kv_events_config=None,
        kv_transfer_config=None,  # a caller may set sched.connector itself
        ec_transfer_config=None,
        speculative_config=None,
        parallel_config=SimpleNamespace(
            data_parallel_rank=0,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            pipeline_parallel_size=1,
        ),
        observability_config=SimpleNamespace(kv_cache_metrics=False),
        model_config=SimpleNamespace(is_encoder_decoder=False, max_model_len=max_model_len),
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    # No encoder: its budget would be computed from the (absent) model.
    with mock.patch.object(vsched, "compute_encoder_budget", lambda **kw: (0, 0)):
        return scheduler_class(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=structured_output_manager,
            block_size=block_size,
            log_stats=log_stats,
        )
