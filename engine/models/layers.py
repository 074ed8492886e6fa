"""The building blocks of the Llama-family decoder (engine/models/llama.py).

Linear (float, MKL-packed or quantized blocks, with LoRA slots), the
embedding, RMSNorm, RoPE frequencies, attention over a paged cache and the
gated MLP. Each takes its switches from `ModelSpec`; the decoder layers that
wire them together, and the model, live in llama.py.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.spec import ModelSpec, RopeScaling
from kernels.backend import PagedAttention, ReshapeAndCache
from kernels.layer_ops import (
    LayerOps,
    Packed,
    RopeTables,
)
from kernels.lora import LoRALayer
from kernels.metadata import AttentionMetadata
from kernels.quant import BlockWeight, QuantizedWeight, amx_mlp, amx_mlp_applies, quant_linear_silu


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

    def set_quantized(self, weight: BlockWeight) -> None:
        """Multiply by `weight`'s blocks from now on. The float weight becomes
        an [out, 0] placeholder: its shape's first dimension, dtype and device
        stay what callers read, and it holds no memory."""
        self.weight = _placeholder(self.weight)
        self.packed = weight

    def pack(self) -> None:
        if not isinstance(self.packed, BlockWeight):
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


def rope_inv_freq(
    theta: float, scaling: RopeScaling | None, dim: int, long: bool = False
) -> torch.Tensor:
    """Per-pair rotation frequencies [dim / 2], float32, as HF computes them
    (longrope: the short factors, or with ``long`` the long ones)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if scaling is not None and scaling.rope_type == "longrope":
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor)
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
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
    @classmethod
    def for_layer(
        cls,
        spec: ModelSpec,
        index: int,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LlamaAttention:
        """The attention of layer `index`: its RoPE (or none) and its window."""
        return cls(
            spec,
            ops,
            lops,
            dtype=dtype,
            device=device,
            use_rope=spec.rope_layers[index],
            window=spec.layer_windows[index],
        )

    def __init__(
        self,
        spec: ModelSpec,
        ops: AttentionOps,
        lops: LayerOps,
        *,
        dtype: torch.dtype,
        device: torch.device,
        use_rope: bool = True,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.window = window
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
        fused = self.lops.rope_and_cache
        if fused is not None and kv_cache.dtype != torch.int8:
            fused(heads, h, hkv, self.rotary_dim, rope, kv_cache, meta.slot_mapping)
        else:
            self._rope_then_cache(heads, rope, kv_cache, meta)
        q = heads[:, :h]
        if self.window is None:
            out = self.ops.paged_attention(q, kv_cache, meta, self.scale)
        else:
            out = self.ops.paged_attention(q, kv_cache, meta, self.scale, self.window)
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, h * self.head_dim))
        return projected

    def _rope_then_cache(
        self, heads: torch.Tensor, rope: RopeTables, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """RoPE on q and k, then the K/V write, as two ops (what
        ``rope_and_cache`` fuses)."""
        h, hkv = self.num_heads, self.num_kv_heads
        # q and k are adjacent heads of the fused output: one rotation covers both.
        if self.rotary_dim == self.head_dim:
            self.lops.rope_(heads[:, : h + hkv], rope)
        elif self.rotary_dim:
            self.lops.rope_(heads[:, : h + hkv, : self.rotary_dim], rope)
        k, v = heads[:, h : h + hkv], heads[:, h + hkv :]
        self.ops.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)


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
        self.hidden_act = spec.hidden_act
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
        adapted = any(
            p.lora is not None and p.lora.state.batch is not None
            for p in (self.gate_up_proj, self.down_proj)
        )
        gate_up, down = self.gate_up_proj.packed, self.down_proj.packed
        if (
            x.device.type == "cpu"
            and not adapted
            and isinstance(gate_up, QuantizedWeight)
            and isinstance(down, QuantizedWeight)
            and amx_mlp_applies(rows, gate_up, down)
        ):
            # One pass a block of rows (kernels/csrc/amx_mlp.cpp): what the
            # chunks below do, without their trips through memory.
            bias1, bias2 = self.gate_up_proj.bias, self.down_proj.bias
            return amx_mlp(x, gate_up, down, bias1, bias2, self.hidden_act)
        if rows <= self.CHUNK_ROWS or x.device.type != "cpu" or adapted:
            return self._forward(x)
        out = x.new_empty(rows, self.down_proj.weight.shape[0])
        for start in range(0, rows, self.CHUNK_ROWS):
            out[start : start + self.CHUNK_ROWS] = self._forward(x[start : start + self.CHUNK_ROWS])
        return out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.hidden_act == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            out: torch.Tensor = self.down_proj(F.gelu(gate, approximate="tanh") * up)
            return out
        return self.down_proj.forward_silu_mul(gate_up)
