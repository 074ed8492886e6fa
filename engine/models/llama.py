"""One decoder for the Llama family over a paged KV cache.

Llama, Mistral, Qwen2, Qwen3, Granite, Phi-3, SmolLM3 and Gemma 3 differ
only in switches that `ModelSpec` reads from their configs
(engine/models/spec.py): q/k/v bias, sliding windows per layer (with their
own RoPE base in Gemma 3), QK-norm, Granite's multipliers, partial RoPE,
layers without RoPE, Phi-3's fused checkpoint projections, and Gemma's GeGLU,
sandwich norms (`SandwichDecoderLayer`) and scaled embeddings. The building
blocks are in engine/models/layers.py, checkpoint names in weight_names.py.

The forward pass takes a flat batch: the new tokens of every sequence laid end
to end (`AttentionMetadata` says which rows belong to which sequence), their
positions, and one paged cache tensor per layer. Attention itself is two
callables from an attention backend (`AttentionOps`), so the same module runs
on the pure-torch reference kernels, a fast CPU path or Triton. The small
ops (RMSNorm, SiLU-and-mul, RoPE) and the linear layers come from `kernels.layer_ops`: fused C++
for float32 on CPU, torch otherwise.

Written for a memory-bound decode step on a few CPU cores: q/k/v and
gate/up are each one fused matmul, RoPE rotates q and k together in place on
the matmul's output, and the residual stream is one tensor updated in place,
each add fused into the norm that follows it. Decode steps (of at most
PACKED_LINEAR_MAX_ROWS sequences) on the compiled CPU ops skip the Python
layer loop altogether: `DecodeStack` (kernels/csrc/decode_stack.cpp) runs the
same kernels from C++, as CUDA graphs replay a decode step on a GPU, because
at batch 1 the interpreter's ~150 us per layer was a fifth of the step, and
it releases the GIL for the whole pass.

Weights may be quantized (kernels/quant.py, engine/models/weight_plan.py):
a quantized Linear keeps its blocks in ``packed`` and an [out, 0]
placeholder as ``weight``; the same dispatcher (layer_ops.linear, and the
decode stack in C++) multiplies either kind.

LoRA adapters (engine/lora/) live in the projections' ``Linear.lora`` slots
and apply in ``Linear.forward`` for the rows the step's ``lora_state`` names
(kernels/lora.py); a step with adapter rows takes the Python layer loop,
one without costs nothing extra.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from engine.models.gguf_weights import BlockRows
from engine.models.layers import (
    AttentionOps,
    Embedding,
    Linear,
    LlamaAttention,
    LlamaMLP,
    RMSNorm,
    rope_inv_freq,
)
from engine.models.quantized_weights import Quantize, QuantizedLoad
from engine.models.spec import ModelSpec, RopeScaling
from engine.models.weight_names import (
    WeightLoadError,
    check_complete,
    destination,
    hf_parameter_names,
    is_ignored,
)
from kernels import cpu_kernels, kv_layout
from kernels.backend import select_layer_ops
from kernels.huge_pages import move_to_huge_pages
from kernels.layer_ops import (
    PACKED_LINEAR_MAX_ROWS,
    SMALL_LINEAR_ROWS,
    LayerOps,
    Packed,
    RopeTables,
)
from kernels.lora import LoRAState
from kernels.metadata import AttentionMetadata
from kernels.quant import BlockWeight, QuantizedWeight, ShardedWeight, format_summary
from kernels.torch_attention import KERNEL_CACHE_DTYPES

logger = logging.getLogger(__name__)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
        index: int = 0,
    ) -> None:
        """The model's layer number `index` (its RoPE and window)."""
        super().__init__()
        eps, hidden = spec.rms_norm_eps, spec.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, lops, dtype=dtype, device=device)
        self.self_attn = LlamaAttention.for_layer(
            spec, index, ops, lops, dtype=dtype, device=device
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, lops, dtype=dtype, device=device)
        self.mlp = LlamaMLP(spec, lops, dtype=dtype, device=device)
        # Granite scales each sublayer's output before its residual add.
        self.residual_multiplier = spec.residual_multiplier

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Add `delta` (the previous layer's MLP output, None for the first
        layer) to `residual` in place, run this layer, and return its MLP output
        for the next layer to add: each residual add is fused into a norm."""
        norm = self.input_layernorm
        x = norm(residual) if delta is None else norm.add_forward(residual, delta)
        attn = self.self_attn(x, rope, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            attn.mul_(self.residual_multiplier)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm.add_forward(residual, attn))
        if self.residual_multiplier != 1.0:
            mlp_out.mul_(self.residual_multiplier)
        return mlp_out


class SandwichDecoderLayer(nn.Module):
    """Gemma's layer: each sublayer's input *and* output is normed, the
    output before its residual add (post_attention_layernorm here is the
    attention output's norm, where Llama's is the MLP input's)."""

    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
        index: int = 0,
    ) -> None:
        super().__init__()
        eps, hidden = spec.rms_norm_eps, spec.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(hidden, eps, lops, dtype=dtype, device=device)

        self.input_layernorm = norm()
        self.self_attn = LlamaAttention.for_layer(
            spec, index, ops, lops, dtype=dtype, device=device
        )
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = LlamaMLP(spec, lops, dtype=dtype, device=device)
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """As LlamaDecoderLayer.forward: returns the (normed) MLP output for
        the next layer to add to `residual`."""
        norm = self.input_layernorm
        x = norm(residual) if delta is None else norm.add_forward(residual, delta)
        attn = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        mlp_out: torch.Tensor = self.mlp(self.pre_feedforward_layernorm.add_forward(residual, attn))
        out: torch.Tensor = self.post_feedforward_layernorm(mlp_out)
        return out


class LlamaModel(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        layer = SandwichDecoderLayer if spec.sandwich_norms else LlamaDecoderLayer
        self.layers = nn.ModuleList(
            layer(spec, ops, lops, dtype=dtype, device=device, index=i)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, lops, dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder; parameter names mirror HF's, with q/k/v fused
    into `qkv_proj` and gate/up into `gate_up_proj` (as Phi-3 stores them)."""

    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layer_ops: LayerOps | None = None,
    ) -> None:
        """`layer_ops` defaults to the fastest ops for dtype and device."""
        super().__init__()
        device = torch.device(device)
        self.spec = spec
        self.lops = layer_ops or select_layer_ops(dtype, device)
        self.model = LlamaModel(spec, ops, self.lops, dtype=dtype, device=device)
        self.lm_head = Linear(
            spec.hidden_size,
            spec.vocab_size,
            self.lops,
            bias=False,
            dtype=dtype,
            device=device,
            weight=self.model.embed_tokens.weight if spec.tie_word_embeddings else None,
        )
        # float32 whatever the model dtype: bf16 angles lose the low bits of
        # large positions. Indexed by position each step, never recomputed.
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        cos, sin = rope_cache(spec, spec.rope_theta, spec.rope_scaling, device)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # Gemma 3's windowed layers rotate with their own base.
        self.sliding_rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        if spec.sliding_rope_theta is not None:
            self.sliding_rope_cache = rope_cache(
                spec, spec.sliding_rope_theta, spec.sliding_rope_scaling, device
            )
        # The compiled layer loop for small decode steps, built once the
        # weights are loaded (load_weights); see _decode_stack_for.
        self.decode_stack: Any | None = None
        # Which rows of the step run which LoRA adapter (set by the model
        # runner; engine/lora/slots.py gives the layers their slots).
        self.lora_state = LoRAState()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_metas: Sequence[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the T new tokens.

        input_ids and positions are int64 [T]; kv_caches[i] is layer i's paged
        cache, into which this pass writes the new tokens' K/V at meta.slot_mapping.
        ``layer_metas``: per layer, its KV cache group's metadata (its own
        block table and slots; engine.kv_cache.groups); None: ``meta`` for all.
        """
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(
                f"got {len(kv_caches)} KV cache tensors: expected one per layer ({len(layers)})"
            )
        # The embedding lookup returns a fresh tensor, so the layers may
        # accumulate into it in place.
        residual = self.model.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            residual.mul_(self.spec.embedding_multiplier)
        metas = layer_metas if layer_metas is not None else [meta] * len(layers)
        stack = self._decode_stack_for(meta, kv_caches)
        if stack is not None:
            hidden: torch.Tensor = stack.forward(
                residual,
                positions,
                self._rope_tables,
                kv_caches,
                [m.block_table for m in metas],
                meta.seq_lens,
                [m.slot_mapping for m in metas],
            )
            return hidden
        rope = self.lops.rope_tables(self.cos_cache, self.sin_cache, positions)
        sliding_rope = rope
        if self.sliding_rope_cache is not None:
            sliding_rope = self.lops.rope_tables(*self.sliding_rope_cache, positions)
        delta = None
        windows = self.spec.layer_windows
        for layer, kv_cache, window, layer_meta in zip(
            layers, kv_caches, windows, metas, strict=True
        ):
            layer_rope = rope if window is None else sliding_rope
            delta = layer(residual, delta, layer_rope, kv_cache, layer_meta)
        norm = self.model.norm
        out: torch.Tensor = norm(residual) if delta is None else norm.add_forward(residual, delta)
        return out

    def _decode_stack_for(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Any:
        """The compiled layer loop, when this step is a decode of at most
        ``stack.max_rows`` sequences (PACKED_LINEAR_MAX_ROWS with MKL-packed
        weights, else SMALL_LINEAR_ROWS) over a float32, bfloat16 or int8 cache. It runs the
        kernels the layers below would, in the same order: same result."""
        stack = self.decode_stack
        if stack is None or not meta.decode_only or meta.num_tokens > stack.max_rows:
            return None
        if self.lora_state.batch is not None:
            return None  # adapters apply in Linear.forward, which the stack skips
        cache = kv_caches[0]
        if cache.dtype not in KERNEL_CACHE_DTYPES or not kv_layout.is_kernel_layout(cache):
            return None
        return stack

    @property
    def _rope_tables(self) -> list[torch.Tensor]:
        """(cos, sin) pairs for the decode stack: the global base's, then the
        windowed layers' where they have their own (a layer's rope_table)."""
        tables = [self.cos_cache, self.sin_cache]
        if self.sliding_rope_cache is not None:
            tables.extend(self.sliding_rope_cache)
        return tables

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the N rows the caller samples from."""
        logits: torch.Tensor = self.lm_head(hidden)
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        return logits.float()

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | BlockRows]],
        quantize: Quantize = None,
        *,
        int8_activations: bool = False,
    ) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up into their shards.

        Tensors in GGUF blocks (`BlockRows`) stay in them, and with
        ``quantize="int8"`` the projections and the LM head are quantized as
        they arrive (engine/models/quantized_weights.py); `int8_activations`
        is kernels/quant.py's option for them. Raises
        WeightLoadError naming every missing or unexpected tensor, or the
        first tensor whose shape does not match.
        """
        params = dict(self.named_parameters())
        expected = set(hf_parameter_names(self.spec))
        loaded: set[str] = set()
        unexpected: list[str] = []
        quantized = QuantizedLoad(self, quantize, int8_activations)
        with torch.no_grad():
            for name, tensor in weights:
                if is_ignored(name, self.spec):
                    continue
                dest = destination(name, params, self.spec)
                if dest is None or name not in expected:
                    unexpected.append(name)
                    continue
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise WeightLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}: "
                        f"expected {tuple(dest.shape)}"
                    )
                if self.spec.norm_weight_offset and name.endswith("norm.weight"):
                    assert isinstance(tensor, torch.Tensor)  # norms are never in blocks
                    tensor = tensor.float() + self.spec.norm_weight_offset
                if not quantized.offer(name, tensor):
                    assert isinstance(tensor, torch.Tensor)  # offer takes every BlockRows
                    dest.copy_(tensor)
                loaded.add(name)
        check_complete(expected - loaded, unexpected)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        # One stream of 2 MiB pages for the decode steps to read (kernels/huge_pages.py).
        move_to_huge_pages([w.packed for w in self.quantized_weights()])
        self.decode_stack = build_decode_stack(self)

    def quantized_weights(self) -> list[QuantizedWeight]:
        """The weights kept in quantized blocks (tied ones once)."""
        found: dict[int, QuantizedWeight] = {}
        for module in self.modules():
            for packed in (getattr(module, "packed", None), getattr(module, "quant", None)):
                shards = packed.shards if isinstance(packed, ShardedWeight) else (packed,)
                for shard in shards:
                    if isinstance(shard, QuantizedWeight):
                        found[id(shard)] = shard
        return list(found.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory (quantized ones in their blocks;
        tied weights once): what a single-stream decode step reads."""
        seen = {id(w): w.nbytes for w in self.quantized_weights()}
        for param in self.parameters():
            seen[id(param)] = param.numel() * param.element_size()
        return sum(seen.values())

    @property
    def weight_format(self) -> str:
        """The linear layers' weight formats, most parameters first: e.g.
        'float32' or 'q4_1+q8_0' (see kernels/quant.py)."""
        seen: dict[int, BlockWeight | torch.Tensor] = {}
        for module in self.modules():
            if isinstance(module, Linear):
                weight = module.packed if isinstance(module.packed, BlockWeight) else module.weight
                seen[id(weight)] = weight
        return format_summary(list(seen.values()))


def rope_cache(
    spec: ModelSpec, theta: float, scaling: RopeScaling | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_position_embeddings, rotary_dim / 2] for one RoPE base.

    LongRoPE (Phi-3/4 long context): positions inside the pretraining length
    rotate by the short factors, those past it by the long ones, and cos and
    sin are scaled by the attention factor. transformers instead switches a
    whole sequence to the long factors once it outgrows the pretraining
    length (recomputing its cache): the same for every sequence that fits
    it; a longer one differs at its first positions. A position-indexed
    table keeps a token's rotation independent of its batch and sequence."""
    positions = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(theta, scaling, spec.rotary_dim))
    if scaling is None or scaling.rope_type != "longrope":
        return angles.cos().to(device), angles.sin().to(device)
    start = scaling.original_max_position_embeddings
    long_freq = rope_inv_freq(theta, scaling, spec.rotary_dim, long=True)
    angles[start:] = torch.outer(positions[start:], long_freq)
    scale = scaling.attention_factor
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)


def build_decode_stack(model: LlamaForCausalLM) -> Any | None:
    """kernels/csrc/decode_stack.cpp's DecodeStack over the model's weights
    (shared, not copied), or None where the model does not run the compiled
    CPU ops and the torch attention backend, whose kernels it calls."""
    spec = model.spec
    module = cpu_kernels.load() if model.lops.name == "compiled" else None
    layers = [cast(LlamaDecoderLayer | SandwichDecoderLayer, layer) for layer in model.model.layers]
    if module is None or not layers or getattr(layers[0].self_attn.ops, "name", None) != "torch":
        return None
    if spec.head_dim not in cpu_kernels.HEAD_DIMS:
        logger.info(
            "%s decodes without the compiled decode stack: its attention kernels take "
            "head dims %s, this model's is %d",
            spec.architecture,
            cpu_kernels.HEAD_DIMS,
            spec.head_dim,
        )
        return None
    options = module.StackOptions()
    options.eps = spec.rms_norm_eps
    options.num_heads, options.num_kv_heads = spec.num_heads, spec.num_kv_heads
    options.head_dim, options.scale = spec.head_dim, spec.attention_scale
    options.residual_multiplier = spec.residual_multiplier
    options.gelu_tanh = spec.hidden_act == "gelu_tanh"
    options.small_rows, options.packed_rows = SMALL_LINEAR_ROWS, PACKED_LINEAR_MAX_ROWS
    options.int8_activations = any(
        isinstance(p, BlockWeight) and p.int8_activations for p in _linears(model)
    )
    stack_layers = [_stack_layer(module, layer, spec, i) for i, layer in enumerate(layers)]
    return module.DecodeStack(stack_layers, model.model.norm.weight, options)


def _stack_layer(
    module: Any, layer: LlamaDecoderLayer | SandwichDecoderLayer, spec: ModelSpec, index: int
) -> Any:
    """One layer as the C++ stack takes it (kernels/csrc/decode_stack.h)."""
    none = torch.empty(0)
    attn, mlp = layer.self_attn, layer.mlp
    out = module.StackLayer()
    out.input_norm = layer.input_layernorm.weight
    if attn.q_norm is not None and attn.k_norm is not None:
        out.q_norm, out.k_norm = attn.q_norm.weight, attn.k_norm.weight
    if isinstance(layer, SandwichDecoderLayer):
        out.attn_out_norm = layer.post_attention_layernorm.weight
        out.mlp_in_norm = layer.pre_feedforward_layernorm.weight
        out.mlp_out_norm = layer.post_feedforward_layernorm.weight
    else:
        out.mlp_in_norm = layer.post_attention_layernorm.weight
    linears: tuple[tuple[str, Linear], ...] = (
        ("qkv", attn.qkv_proj),
        ("o", attn.o_proj),
        ("gate_up", mlp.gate_up_proj),
        ("down", mlp.down_proj),
    )
    for name, lin in linears:
        setattr(out, name, _stack_linear(module, lin, none))
    window = spec.layer_windows[index]
    out.rotary_dim = attn.rotary_dim
    out.rope_table = int(window is not None and spec.sliding_rope_theta is not None)
    out.window = window or 0
    return out


def _linears(model: LlamaForCausalLM) -> list[Packed]:
    return [m.packed for m in model.modules() if isinstance(m, Linear)]


def _stack_linear(module: Any, lin: Linear, none: torch.Tensor) -> Any:
    """A linear as DecodeStack takes it: its float weight and bias, and its
    packed form (MKL's float copy or the quantized tiles, uint8), or its
    shards' tiles with their row counts; empty where there is none."""
    bias = lin.bias if lin.bias is not None else none
    packed = lin.packed
    if isinstance(packed, ShardedWeight):
        tiles = [w.packed for w in packed.shards]
        rows = [w.out_features for w in packed.shards]
        return module.StackLinear(lin.weight, bias, none, tiles, rows)
    if isinstance(packed, QuantizedWeight):
        packed = packed.packed
    return module.StackLinear(lin.weight, bias, packed if packed is not None else none, [], [])
