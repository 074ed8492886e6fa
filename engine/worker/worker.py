"""Worker: loads the model onto a device, sizes and allocates the KV cache,
and owns the model runner. One worker per device."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from engine.config import CacheConfig, ConfigError, LoRAConfig, ModelConfig, SpeculativeConfig
from engine.kv_cache.groups import KVCacheGroups
from engine.lora.slots import LoRASlots
from engine.models.loader import LoadedModel, gguf_source, load_model, resolve_model
from engine.models.spec import ModelSpec
from engine.models.weight_plan import QuantizationName, WeightPlan, plan_weights
from engine.numerics import EXACT_FLOAT32, Numerics, resolve_numerics
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.spec_decode.adaptive import AdaptiveProposer, measure_step_cost
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.proposer import NgramLookup, Proposer
from engine.worker.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    StaticInputs,
    capture_sizes,
)
from engine.worker.kv_cache import (
    KVCacheShape,
    allocate_kv_caches,
    kv_cache_budget,
    num_blocks_for_budget,
)
from engine.worker.model_runner import ModelRunner, forward_over
from kernels.backend import select_backend

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache's element types: the model's, int8 with a scale per row
# (kernels/kv_int8.py; CPU only) and fp8 (e4m3; kernels/triton_attention.py).
_CACHE_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' is invalid: no CUDA device is available")
    return torch.device(name)


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine core needs to know once the model is up."""

    model_path: Path
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_blocks: int
    eos_token_id: int | None
    spec: ModelSpec | None = None
    # The weights' format in memory, e.g. 'float32' or 'q4_1+q8_0'.
    weight_format: str = "float32"
    # None: LoRA is off.
    lora: LoRAConfig | None = None
    # Int8 or float activations, the KV cache's dtype, exact or fast
    # (engine/numerics.py), as resolved for the weights.
    numerics: Numerics = EXACT_FLOAT32
    # Per KV cache group, its layers' window (None: full attention).
    kv_group_windows: tuple[int | None, ...] = (None,)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type ('float32', 'bfloat16', 'float16')."""
        return self.numerics.kv_cache_dtype


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_num_seqs: int,
        speculative: SpeculativeConfig | None = None,
        lora: LoRAConfig | None = None,
        free_windowed_kv: bool = True,
    ):
        """``free_windowed_kv``: give sliding-window layers their own KV
        cache groups, whose blocks are freed past the window (off when the
        blocks must hold every layer: a KV connector, a draft model)."""
        torch.manual_seed(model_config.seed)
        self.device = resolve_device(model_config.device)
        self.backend = select_backend(self.device, model_config.attention_backend)
        plan, self.numerics = self._plan(model_config.model, model_config)
        logger.info(
            "numerics: %s%s",
            self.numerics.describe(),
            " (--exact: the bit-exact path)" if self.numerics.path == "fast (default)" else "",
        )
        self.loaded: LoadedModel = self._load(model_config.model, model_config, plan)
        spec = self.loaded.spec
        # Before the KV budget is taken: the slots' memory is not the cache's.
        lora_slots = LoRASlots(lora, self.loaded.model) if lora is not None else None
        max_model_len = spec.max_position_embeddings
        if model_config.max_model_len is not None:
            max_model_len = min(max_model_len, model_config.max_model_len)
        cache_dtype = _CACHE_DTYPES[self.numerics.kv_cache_dtype]
        if cache_dtype == torch.int8 and self.backend.name == "triton":
            raise ConfigError(
                "kv_cache_dtype='int8' is not supported by the Triton attention backend "
                "(CUDA): expected 'auto', 'float32', 'bfloat16', 'float16' or 'fp8_e4m3' there"
            )
        if cache_dtype == torch.float8_e4m3fn and self.backend.name != "triton":
            raise ConfigError(
                f"kv_cache_dtype={model_config.kv_cache_dtype!r} needs the Triton attention "
                f"backend (CUDA), not {self.backend.name!r}: on CPU the quantized cache is 'int8'"
            )
        # A draft model reads the target's block table: one group.
        draft_model = speculative is not None and speculative.method == "draft_model"
        self.kv_groups = KVCacheGroups.plan(
            spec.layer_windows, free_windowed_kv and not draft_model
        )
        shape = KVCacheShape(
            self.kv_groups.layers_per_group,
            spec.num_kv_heads,
            spec.head_dim,
            cache_config.block_size,
            cache_dtype,
        )
        # A draft model loads before the budget is taken, and its KV cache
        # shares it: every block has the target's KV and the draft's.
        draft = None
        if speculative is not None and draft_model:
            draft = self._load_draft(speculative, model_config, spec, shape)
        budget = kv_cache_budget(
            self.device, model_config.kv_cache_memory, model_config.gpu_memory_utilization
        )
        graph_sizes = self._graph_sizes(model_config, max_num_seqs, speculative)
        if graph_sizes and model_config.kv_cache_memory is None:
            # The graphs' memory is not the cache's: measured, then left out.
            reserve = self._graph_memory(shape, graph_sizes, cache_config.block_size, max_model_len)
            logger.info("CUDA graphs: %.1f MiB for %d sizes", reserve / 2**20, len(graph_sizes))
            budget -= reserve
        if draft is not None:
            per_block = shape.bytes_per_block
            budget = budget * per_block // (per_block + draft[1].bytes_per_block)
        num_blocks = cache_config.num_blocks_override or num_blocks_for_budget(shape, budget)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s) on %s, attention backend %s%s",
            num_blocks,
            cache_config.block_size,
            num_blocks * shape.bytes_per_block / 2**20,
            self.numerics.kv_cache_dtype,
            self.device,
            self.backend.name,
            _describe_groups(self.kv_groups),
        )
        kv_caches = allocate_kv_caches(shape, num_blocks, self.device, self.kv_groups.layer_slot)
        self.runner = ModelRunner(
            self.loaded.model,
            kv_caches,
            block_size=cache_config.block_size,
            max_num_reqs=max_num_seqs,
            max_model_len=max_model_len,
            device=self.device,
            kv_groups=self.kv_groups,
        )
        if lora_slots is not None:
            self.runner.attach_lora(lora_slots)
        if graph_sizes:
            self.runner.attach_graphs(CudaGraphCapture(), graph_sizes)
            logger.info("CUDA graphs captured for decode steps of %s rows", graph_sizes)
        if speculative is not None:
            proposer = self._proposer(speculative, draft, num_blocks, cache_config.block_size)
            if speculative.adaptive:
                proposer = self._adaptive(proposer, speculative, kv_caches, max_num_seqs)
            self.runner.attach_proposer(proposer, speculative.num_speculative_tokens)
        # Requests stop on the first EOS id; configs listing several are rare.
        eos = spec.eos_token_ids[0] if spec.eos_token_ids else None
        self.info = WorkerInfo(
            model_path=self.loaded.path,
            model_name=self.loaded.name,
            weight_format=self.loaded.weight_format,
            architecture=spec.architecture,
            vocab_size=spec.vocab_size,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            eos_token_id=eos,
            spec=spec,
            lora=lora,
            numerics=self.numerics,
            kv_group_windows=self.kv_groups.windows,
        )

    def _graph_sizes(
        self, config: ModelConfig, max_num_seqs: int, speculative: SpeculativeConfig | None
    ) -> tuple[int, ...]:
        """The decode sizes to capture as CUDA graphs; none off CUDA or with
        ``enforce_eager``. A step verifying k drafts has k + 1 rows a request."""
        if self.device.type != "cuda" or config.enforce_eager:
            return ()
        if self.backend.name != "triton":
            # The torch backend plans each batch on the host (and caches the
            # plan by metadata identity): nothing a graph could replay.
            logger.info("CUDA graphs off: they need the triton attention backend")
            return ()
        k = speculative.num_speculative_tokens if speculative is not None else 0
        return capture_sizes(max_num_seqs * (1 + k), config.cuda_graph_sizes)

    def _graph_memory(
        self, shape: KVCacheShape, sizes: tuple[int, ...], block_size: int, max_model_len: int
    ) -> int:
        """Bytes the decode graphs take: captured once over a two-block KV
        cache (their memory does not depend on the cache's size), measured,
        and released."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._capture_over_tiny_cache(shape, sizes, block_size, max_model_len)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        gc.collect()  # the graphs and the tiny cache, gone with the call above
        torch.cuda.empty_cache()
        return max(0, int(used))

    def _capture_over_tiny_cache(
        self, shape: KVCacheShape, sizes: tuple[int, ...], block_size: int, max_model_len: int
    ) -> None:
        caches = allocate_kv_caches(shape, 2, self.device, self.kv_groups.layer_slot)
        max_blocks = -(-max_model_len // block_size)
        inputs = StaticInputs(max(sizes), self.kv_groups.num_groups, max_blocks, self.device)
        forward = forward_over(self.loaded.model, caches, self.kv_groups.layer_group)
        graphs = DecodeGraphs(forward, sizes, inputs, max_model_len)
        with torch.inference_mode():
            graphs.capture_all(CudaGraphCapture())
        torch.cuda.synchronize(self.device)

    def _proposer(
        self,
        speculative: SpeculativeConfig,
        draft: tuple[LoadedModel, KVCacheShape] | None,
        num_blocks: int,
        block_size: int,
    ) -> Proposer:
        k = speculative.num_speculative_tokens
        if draft is None:
            return NgramLookup(k, speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        model, shape = draft
        caches = allocate_kv_caches(shape, num_blocks, self.device)
        return DraftModelProposer(model.model, caches, block_size, k, self.device)

    def _adaptive(
        self,
        proposer: Proposer,
        speculative: SpeculativeConfig,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
    ) -> AdaptiveProposer:
        """Drafts only where they pay, by this machine's measured cost of a
        step's token rows (a fraction of a second, once)."""
        rows = max_num_seqs * (speculative.num_speculative_tokens + 1)
        cost = measure_step_cost(self.loaded.model, kv_caches, self.device, rows)
        logger.info(
            "adaptive drafts: a decode step costs %s ms at %s token rows",
            ", ".join(f"{s * 1e3:.1f}" for s in cost.seconds),
            ", ".join(str(int(r)) for r in cost.rows),
        )
        return AdaptiveProposer(
            proposer,
            cost,
            cheap=speculative.method == "ngram",
            disable_by_batch_size=speculative.disable_by_batch_size,
        )

    def _plan(self, model: str | None, model_config: ModelConfig) -> tuple[WeightPlan, Numerics]:
        """The weights' plan and the numerics resolved for it: whether the
        weights run as GGUF blocks decides what unset settings mean."""
        quantization = cast(QuantizationName, model_config.quantization)
        where = (gguf_source(model), _DTYPES[model_config.dtype], self.device)
        gguf_blocks = plan_weights(quantization, *where).gguf is not None
        numerics = resolve_numerics(model_config, gguf_blocks)
        plan = plan_weights(quantization, *where, int8_activations=numerics.int8_activations)
        return plan, numerics

    def _load(self, model: str | None, model_config: ModelConfig, plan: WeightPlan) -> LoadedModel:
        dtype = _DTYPES[model_config.dtype]
        return load_model(
            resolve_model(model), dtype=dtype, device=self.device, ops=self.backend, plan=plan
        )

    def _load_draft(
        self,
        speculative: SpeculativeConfig,
        model_config: ModelConfig,
        target: ModelSpec,
        target_shape: KVCacheShape,
    ) -> tuple[LoadedModel, KVCacheShape]:
        """The draft model, its activations resolved for its own weights;
        its KV cache has the target's block size and dtype."""
        assert speculative.model is not None  # checked by SpeculativeConfig
        plan, _ = self._plan(speculative.model, model_config)
        draft = self._load(speculative.model, model_config, plan)
        if draft.spec.vocab_size != target.vocab_size:
            raise ConfigError(
                f"speculative_config.model={speculative.model!r} is invalid: its vocabulary "
                f"has {draft.spec.vocab_size} tokens, the target's {target.vocab_size}"
            )
        d = draft.spec
        shape = KVCacheShape(
            d.num_layers, d.num_kv_heads, d.head_dim, target_shape.block_size, target_shape.dtype
        )
        return draft, shape

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


def _describe_groups(groups: KVCacheGroups) -> str:
    if not groups.frees_windowed:
        return ""
    windowed = sum(w is not None for w in groups.windows)
    return (
        f"; {groups.num_groups} groups of {groups.layers_per_group} layers "
        f"({windowed} windowed: their blocks are freed past the window)"
    )
