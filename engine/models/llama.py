"""One decoder for the Llama family over a paged KV cache.

Llama, Mistral, Qwen2, Qwen3, Granite, Phi-3 and SmolLM3 differ only in
switches that `ModelSpec` reads from their configs (engine/models/spec.py):
q/k/v bias, sliding window, QK-norm, Granite's multipliers, partial RoPE,
layers without RoPE, and Phi-3's fused checkpoint projections.

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
import math
from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gguf_weights import BlockRows
from engine.models.quantized_weights import Quantize, QuantizedLoad
from engine.models.spec import ModelSpec, RopeScaling
from kernels import cpu_kernels
from kernels.huge_pages import move_to_huge_pages
from kernels.layer_ops import (
    PACKED_LINEAR_MAX_ROWS,
    SMALL_LINEAR_ROWS,
    LayerOps,
    Packed,
    RopeTables,
    select_layer_ops,
)
from kernels.lora import LoRALayer, LoRAState
from kernels.metadata import AttentionMetadata
from kernels.quant import QuantizedWeight, format_summary, quant_linear_silu
from kernels.torch_attention import COMPILED_CACHE_DTYPES

logger = logging.getLogger(__name__)


class ReshapeAndCache(Protocol):
    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        /,
    ) -> None: ...


class PagedAttention(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        /,
    ) -> torch.Tensor: ...


class AttentionOps(Protocol):
    """The two attention kernels a backend provides (see kernels/reference.py).

    Properties rather than plain attributes so a frozen dataclass satisfies it.
    The model passes q, k and v as strided views into one [T, heads, head_dim]
    buffer: kernels must honour strides (or copy) rather than assume contiguity.
    """

    @property
    def reshape_and_cache(self) -> ReshapeAndCache: ...

    @property
    def paged_attention(self) -> PagedAttention: ...


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the model built from its config."""


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Left uninitialised: load_weights overwrites every element and refuses a
    # checkpoint that misses any, so random init would be wasted work.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        lops: LayerOps,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        weight: nn.Parameter | None = None,
    ) -> None:
        """`weight`, when given, is shared rather than allocated (tied embeddings)."""
        super().__init__()
        self.lops = lops
        self.weight = (
            _empty_param(out_features, in_features, dtype=dtype, device=device)
            if weight is None
            else weight
        )
        self.bias: nn.Parameter | None = (
            _empty_param(out_features, dtype=dtype, device=device) if bias else None
        )

        # A faster-layout copy of the weight, made by pack() once it is loaded,
        # or the weight's quantized blocks (set_quantized); not a parameter:
        # opaque to torch's module tools.
        self.packed: Packed = None
        # LoRA adapters' device slots for this projection (engine/lora/slots.py).
        self.lora: LoRALayer | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Multiply by `weight`'s blocks from now on. The float weight becomes
        an [out, 0] placeholder: its shape's first dimension, dtype and device
        stay what callers read, and it holds no memory."""
        self.weight = _placeholder(self.weight)
        self.packed = weight

    def pack(self) -> None:
        if not isinstance(self.packed, QuantizedWeight):
            self.packed = self.lops.pack_linear(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lops.linear(x, self.weight, self.bias, self.packed)
        if self.lora is not None:
            self.lora.add_to(y, x)
        return y

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up = [gate | up]. Where the weight's
        blocks take int8 activations (and no adapter reads the activation),
        the activation is quantized as it is computed, never written out."""
        packed = self.packed
        if (
            isinstance(packed, QuantizedWeight)
            and packed.int8_activations
            and self.lora is None
            and gate_up.device.type == "cpu"
        ):
            return quant_linear_silu(gate_up, packed, self.bias)
        out: torch.Tensor = self(self.lops.silu_mul(gate_up))
        return out


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty_param(num, dim, dtype=dtype, device=device)
        # The table's quantized blocks, when it is kept in them (the rows
        # looked up are expanded each step: one row a token).
        self.quant: QuantizedWeight | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        self.weight = _placeholder(self.weight)
        self.quant = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.dequantize(ids.to(torch.int64).contiguous())
        return F.embedding(ids, self.weight)


def _placeholder(weight: torch.Tensor) -> nn.Parameter:
    return _empty_param(weight.shape[0], 0, dtype=weight.dtype, device=weight.device)


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, lops: LayerOps, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = _empty_param(dim, dtype=dtype, device=device)
        self.eps = eps
        self.lops = lops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual += delta in place, then the norm of the sum."""
        return self.lops.add_rms_norm(residual, delta, self.weight, self.eps)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Per-pair rotation frequencies [rotary_dim / 2], float32, as HF computes them."""
    dim = spec.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: stretch long wavelengths by `factor`, keep short ones,
    and blend linearly in between (by where the wavelength falls in the band)."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
        use_rope: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.attention_scale
        # RoPE covers the first rotary_dim dims of each head, or none of them.
        self.rotary_dim = spec.rotary_dim if use_rope else 0
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            eps, dim = spec.rms_norm_eps, spec.head_dim
            self.q_norm = RMSNorm(dim, eps, lops, dtype=dtype, device=device)
            self.k_norm = RMSNorm(dim, eps, lops, dtype=dtype, device=device)
        self.ops = ops
        self.lops = lops
        self.qkv_proj = Linear(
            spec.hidden_size,
            spec.q_size + 2 * spec.kv_size,
            lops,
            bias=spec.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(
            spec.q_size, spec.hidden_size, lops, bias=spec.o_proj_bias, dtype=dtype, device=device
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(num_tokens, h + 2 * hkv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            _norm_heads_(heads[:, :h], self.q_norm)
            _norm_heads_(heads[:, h : h + hkv], self.k_norm)
        # q and k are adjacent heads of the fused output: one rotation covers both.
        if self.rotary_dim == self.head_dim:
            self.lops.rope_(heads[:, : h + hkv], rope)
        elif self.rotary_dim:
            self.lops.rope_(heads[:, : h + hkv, : self.rotary_dim], rope)
        q, k, v = heads[:, :h], heads[:, h : h + hkv], heads[:, h + hkv :]
        self.ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        out = self.ops.paged_attention(q, kv_cache, meta, self.scale)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, h * self.head_dim))
        return projected


def _norm_heads_(heads: torch.Tensor, norm: RMSNorm) -> None:
    """RMSNorm over each [head_dim] row of the strided view `heads`, in place."""
    rows = heads.reshape(-1, heads.shape[-1])
    heads.copy_(norm(rows).view(heads.shape))


class LlamaMLP(nn.Module):
    def __init__(
        self, spec: ModelSpec, lops: LayerOps, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.lops = lops
        self.gate_up_proj = Linear(
            spec.hidden_size,
            2 * spec.intermediate_size,
            lops,
            bias=spec.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = Linear(
            spec.intermediate_size,
            spec.hidden_size,
            lops,
            bias=spec.mlp_bias,
            dtype=dtype,
            device=device,
        )

    # Prefill-sized inputs on CPU go through in chunks of this many rows, so
    # the [rows, 2 * intermediate] gate_up product stays in cache from its
    # matmul through the activation to the down projection, instead of
    # making three trips through memory (at 8192 rows it is 100 MB a layer;
    # chunked, the MLP measured ~15% faster on the default model).
    CHUNK_ROWS = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        # LoRA segments are rows of the whole step: a chunk would misplace them.
        lora = self.down_proj.lora
        adapted = lora is not None and lora.state.batch is not None
        if rows <= self.CHUNK_ROWS or x.device.type != "cpu" or adapted:
            return self._forward(x)
        out = x.new_empty(rows, self.down_proj.weight.shape[0])
        for start in range(0, rows, self.CHUNK_ROWS):
            out[start : start + self.CHUNK_ROWS] = self._forward(x[start : start + self.CHUNK_ROWS])
        return out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
        use_rope: bool = True,
    ) -> None:
        super().__init__()
        eps, hidden = spec.rms_norm_eps, spec.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, lops, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(
            spec, ops, lops, dtype=dtype, device=device, use_rope=use_rope
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
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, ops, lops, dtype=dtype, device=device, use_rope=use_rope)
            for use_rope in spec.rope_layers
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
        angles = torch.outer(
            torch.arange(spec.max_position_embeddings, dtype=torch.float32),
            rope_inv_freq(spec),
        )
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", angles.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", angles.sin().to(device), persistent=False)
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
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the T new tokens.

        input_ids and positions are int64 [T]; kv_caches[i] is layer i's paged
        cache, into which this pass writes the new tokens' K/V at meta.slot_mapping.
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
        stack = self._decode_stack_for(meta, kv_caches)
        if stack is not None:
            hidden: torch.Tensor = stack.forward(
                residual,
                positions,
                self.cos_cache,
                self.sin_cache,
                kv_caches,
                meta.block_table,
                meta.seq_lens,
                meta.slot_mapping,
            )
            return hidden
        rope = self.lops.rope_tables(self.cos_cache, self.sin_cache, positions)
        delta = None
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            delta = layer(residual, delta, rope, kv_cache, meta)
        norm = self.model.norm
        out: torch.Tensor = norm(residual) if delta is None else norm.add_forward(residual, delta)
        return out

    def _decode_stack_for(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Any:
        """The compiled layer loop, when this step is a decode of at most
        ``stack.max_rows`` sequences (PACKED_LINEAR_MAX_ROWS with MKL-packed
        weights, else SMALL_LINEAR_ROWS) over a float32 or bfloat16 cache. It runs the
        kernels the layers below would, in the same order: same result."""
        stack = self.decode_stack
        if stack is None or not meta.decode_only or meta.num_tokens > stack.max_rows:
            return None
        if self.lora_state.batch is not None:
            return None  # adapters apply in Linear.forward, which the stack skips
        cache = kv_caches[0]
        if cache.dtype not in COMPILED_CACHE_DTYPES or not cache.is_contiguous():
            return None
        return stack

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
                if _ignored(name, self.spec):
                    continue
                dest = _destination(name, params, self.spec)
                if dest is None or name not in expected:
                    unexpected.append(name)
                    continue
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise WeightLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}: "
                        f"expected {tuple(dest.shape)}"
                    )
                if not quantized.offer(name, tensor):
                    assert isinstance(tensor, torch.Tensor)  # offer takes every BlockRows
                    dest.copy_(tensor)
                loaded.add(name)
        _check_complete(expected - loaded, unexpected)
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
                if isinstance(packed, QuantizedWeight):
                    found[id(packed)] = packed
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
        seen: dict[int, QuantizedWeight | torch.Tensor] = {}
        for module in self.modules():
            if isinstance(module, Linear):
                weight = (
                    module.packed if isinstance(module.packed, QuantizedWeight) else module.weight
                )
                seen[id(weight)] = weight
        return format_summary(list(seen.values()))


def build_decode_stack(model: LlamaForCausalLM) -> Any | None:
    """kernels/csrc/decode_stack.cpp's DecodeStack over the model's weights
    (shared, not copied), or None where the model does not run the compiled
    CPU ops and the torch attention backend, whose kernels it calls."""
    spec = model.spec
    decoder = [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]
    module = cpu_kernels.load() if model.lops.name == "compiled" else None
    if (
        module is None
        or not decoder
        or getattr(decoder[0].self_attn.ops, "name", None) != "torch"
        or spec.head_dim not in cpu_kernels.HEAD_DIMS
    ):
        return None
    if not spec.plain_llama_layers:
        # The C++ layer loop has no QK-norm, partial or skipped RoPE, or
        # residual multiplier: such models decode through the Python loop.
        logger.info(
            "%s decodes without the compiled decode stack, which runs plain Llama "
            "layers only (this model: qk_norm=%s, rotary_dim=%d of head_dim=%d, "
            "RoPE in %d of %d layers, residual_multiplier=%s)",
            spec.architecture,
            spec.qk_norm,
            spec.rotary_dim,
            spec.head_dim,
            sum(spec.rope_layers),
            spec.num_layers,
            spec.residual_multiplier,
        )
        return None
    none = torch.empty(0)
    layers = []
    for layer in decoder:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qkv, o, gate_up, down = (
            (lin.weight, lin.bias if lin.bias is not None else none) for lin in linears
        )
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        packed = [_packed_tensor(lin.packed, none) for lin in linears]
        layers.append([norms[0], *qkv, *o, norms[1], *gate_up, *down, *packed])
    return module.DecodeStack(
        layers,
        model.model.norm.weight,
        spec.rms_norm_eps,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.attention_scale,
        SMALL_LINEAR_ROWS,
        PACKED_LINEAR_MAX_ROWS,
        any(isinstance(p, QuantizedWeight) and p.int8_activations for p in _linears(model)),
    )


def _linears(model: LlamaForCausalLM) -> list[Packed]:
    return [m.packed for m in model.modules() if isinstance(m, Linear)]


def _packed_tensor(packed: Packed, none: torch.Tensor) -> torch.Tensor:
    """What DecodeStack takes for a linear's packed form: MKL's float copy,
    the quantized tiles (uint8), or an empty tensor."""
    if isinstance(packed, QuantizedWeight):
        return packed.packed
    return packed if packed is not None else none


# HF projection name -> (fused parameter name, which shard of it).
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


def _shard_rows(shard: str, spec: ModelSpec) -> tuple[int, int]:
    """(first row, row count) of a shard inside its fused weight."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    return {
        "q": (0, q),
        "k": (q, kv),
        "v": (q + kv, kv),
        "gate": (0, inter),
        "up": (inter, inter),
    }[shard]


def _destination(
    name: str, params: dict[str, nn.Parameter], spec: ModelSpec
) -> torch.Tensor | None:
    """The parameter (or the rows of a fused one) that HF tensor `name` fills."""
    for piece, (fused, shard) in _FUSED.items():
        if piece in name:
            param = params.get(name.replace(piece, fused))
            if param is None:
                return None
            start, length = _shard_rows(shard, spec)
            return param.narrow(0, start, length)
    return params.get(name)


def _ignored(name: str, spec: ModelSpec) -> bool:
    # inv_freq is recomputed from the config; a tied checkpoint that still
    # stores lm_head holds a copy of the embedding we already load.
    return name.endswith("rotary_emb.inv_freq") or (
        spec.tie_word_embeddings and name == "lm_head.weight"
    )


def _check_complete(missing: set[str], unexpected: list[str]) -> None:
    problems = []
    if missing:
        problems.append(f"missing tensors {sorted(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {sorted(unexpected)}")
    if problems:
        raise WeightLoadError("checkpoint does not match the model config: " + "; ".join(problems))


def hf_parameter_names(spec: ModelSpec) -> list[str]:
    """The HF checkpoint tensor names a model of this spec needs (lm_head only if untied)."""
    fused = spec.fused_checkpoint_projections
    attention = ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj")
    mlp = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        for proj in attention:
            names += _linear_names(f"{prefix}self_attn.{proj}", spec.attention_bias)
        names += _linear_names(f"{prefix}self_attn.o_proj", spec.o_proj_bias)
        if spec.qk_norm:
            names += [f"{prefix}self_attn.q_norm.weight", f"{prefix}self_attn.k_norm.weight"]
        for proj in mlp:
            names += _linear_names(f"{prefix}mlp.{proj}", spec.mlp_bias)
        names += [f"{prefix}input_layernorm.weight", f"{prefix}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _linear_names(prefix: str, bias: bool) -> list[str]:
    return [f"{prefix}.weight", f"{prefix}.bias"] if bias else [f"{prefix}.weight"]
