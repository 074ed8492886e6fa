"""The decoder's per-layer ops besides attention, picked once per model.

RMSNorm, SiLU-and-mul, RoPE and the linear layers, in three implementations
with one set of signatures (Triton's, for CUDA, are in
`kernels.triton_layer_ops`: one launch per op, RoPE fused with the K/V
cache write):

* `TORCH_OPS`: transformers' recipes spelled out in torch, for any dtype and
  device. RMSNorm normalises in float32, rounds to the model dtype, then
  scales, so bf16 models round exactly as transformers does.
* the compiled C++ ops of `kernels.cpu_kernels`, for float32 models on CPU:
  each small op is one pass over the activations instead of a chain of 3-8
  torch kernels, which at decode batch sizes cost more in launches than in
  arithmetic (a single-stream decode step ran 30 layers x ~25 small ops).
  Linear layers with at most `SMALL_LINEAR_ROWS` input rows (decode steps
  of a few sequences) use a weight-streaming kernel: BLAS's small-M path
  reads the weights ~10% slower than memory allows, and a decode step is
  one read of all the weights. Larger inputs go to BLAS. Where torch has
  MKL, each weight is also packed once at load (`pack_linear`) into MKL's
  GEMM layout, and inputs of up to `PACKED_LINEAR_MAX_ROWS` rows (decode
  batches) multiply against the packed copy: plain BLAS re-packs the weight
  on every call, which at 16-128 rows costs 20-60% of the matmul.

Quantized weights (`kernels.quant`) ride in the same `packed` slot: a
`QuantizedWeight` there sends every row count to the block-quantized kernel
(the torch ops dequantize it, slowly, for completeness).

The residual add is folded into the following norm (`add_rms_norm`), so the
decoder passes each sublayer's output forward instead of adding it at once.
RoPE tables are built once per forward pass (`rope_tables`) and shared by
every layer; what they hold is up to the implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels.quant import BlockWeight, quant_linear

RopeTables = tuple[torch.Tensor, ...]
RopeAndCache = Callable[
    [torch.Tensor, int, int, int, "RopeTables", torch.Tensor, torch.Tensor], None
]
# What `linear` multiplies by besides the weight itself: MKL's packed copy of
# it, the weight's quantized blocks (the weight is then a [out, 0]
# placeholder), or nothing.
Packed = torch.Tensor | BlockWeight | None

# Up to this many input rows the compiled linear beats BLAS (measured on the
# default model's shapes: see benchmarks/JOURNAL.md, offline_throughput.py).
SMALL_LINEAR_ROWS = 8
# Up to this many rows the MKL-packed weight beats plain BLAS; above it the
# re-pack is amortised and BLAS's own blocking wins (benchmarks/JOURNAL.md).
PACKED_LINEAR_MAX_ROWS = 128
# The row count MKL is told to expect when packing. Its packed layout does
# not depend on it on the MKL torch ships, which `pack_linear` checks.
_PACK_HINT_ROWS = 64


@dataclass(frozen=True)
class LayerOps:
    name: str
    # rms_norm(x [T, H], weight [H], eps) -> normalised x * weight, a new tensor.
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # add_rms_norm(residual, delta, weight, eps): residual += delta in place,
    # then returns rms_norm(residual, weight, eps).
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    # silu_mul(gate_up [T, 2I]) -> silu(gate) * up, [T, I] (may reuse gate_up).
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    # rope_tables(cos_cache, sin_cache [max_pos, D/2], positions [T]) -> tables.
    rope_tables: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], RopeTables]
    # rope_(x [T, heads, D], tables): rotate-half RoPE in place.
    rope_: Callable[[torch.Tensor, RopeTables], None]
    # linear(x [T, in], weight [out, in], bias [out] | None, packed) -> [T, out];
    # packed is what pack_linear(weight) returned, a BlockWeight, or None.
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Packed], torch.Tensor]
    # pack_linear(weight) -> a copy in a faster layout for `linear`, or None.
    # Called once the weights are loaded; a weight changed later must be re-packed.
    pack_linear: Callable[[torch.Tensor], torch.Tensor | None]
    # rope_and_cache(heads [T, h + 2 hkv, D], h, hkv, rotary_dim, tables,
    # kv_cache, slot_mapping): attention's RoPE of q and k and the K/V cache
    # write in one op; None where the ops have no such fusion (the layer
    # then calls rope_ and the attention backend's reshape_and_cache).
    rope_and_cache: RopeAndCache | None = None


# --- torch ----------------------------------------------------------------------


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Spelled out rather than torch.rms_norm: on CPU that op was up to 8x
    # slower for prefill-sized fp32 inputs, and this is HF's exact recipe.
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
    return (xf * inv_rms).to(x.dtype).mul_(weight)


def _torch_add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _torch_rms_norm(residual.add_(delta), weight, eps)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    half = gate_up.shape[-1] // 2
    # Computed into gate's half of the matmul output: no new buffer.
    return F.silu(gate_up[:, :half], inplace=True).mul_(gate_up[:, half:])


def _torch_rope_tables(
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor
) -> RopeTables:
    """(cos, signed sin), each [T, 1, head_dim]: the sign of rotate-half is
    folded into the sin table."""
    cos = cos_cache[positions]
    sin = sin_cache[positions]
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def _torch_rope_(x: torch.Tensor, tables: RopeTables) -> None:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written
    as roll(x) = [x2, x1] times signed_sin = [-sin, sin]: three kernels."""
    cos, signed_sin = tables
    rotated = x.roll(x.shape[-1] // 2, -1)
    x.mul_(cos).addcmul_(rotated, signed_sin)


def _torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: Packed
) -> torch.Tensor:
    if isinstance(packed, BlockWeight):
        weight = packed.dequantize().to(x.dtype)
    return F.linear(x, weight, bias)


def _no_packing(weight: torch.Tensor) -> torch.Tensor | None:
    return None


TORCH_OPS = LayerOps(
    "torch",
    _torch_rms_norm,
    _torch_add_rms_norm,
    _torch_silu_mul,
    _torch_rope_tables,
    _torch_rope_,
    _torch_linear,
    _no_packing,
)


# --- MKL-packed weights (float32, CPU) --------------------------------------------


def mkl_packing_available() -> bool:
    """Whether this torch carries MKL's packed-GEMM ops."""
    has_mkl: bool = torch.backends.mkl.is_available()  # type: ignore[no-untyped-call]
    return has_mkl and hasattr(torch.ops.mkl, "_mkl_linear")


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # The last argument is the row count the packed weight serves; passing
    # the input's own keeps MKL on the packed path for every row count.
    out: torch.Tensor = torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])
    return out


def mkl_pack_linear(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed copy of a float32 CPU weight, or None where torch lacks
    MKL or the packed copy does not reproduce F.linear on a row count other
    than the hint (the layout would then depend on it, and we'd rather be
    slow than wrong)."""
    if not mkl_packing_available() or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    with torch.no_grad():
        packed: torch.Tensor = torch.ops.mkl._mkl_reorder_linear_weight(
            weight.detach(), _PACK_HINT_ROWS
        )
        probe = torch.randn(13, weight.shape[1], generator=torch.Generator().manual_seed(0))
        if not torch.allclose(
            _packed_linear(probe, packed, weight, None), F.linear(probe, weight), atol=1e-3
        ):
            return None
    return packed


# --- compiled (float32, CPU) --------------------------------------------------------


def compiled_ops(module: ModuleType) -> LayerOps:
    """The compiled C++ ops of ``module`` (kernels.cpu_kernels.load())."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        module.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(
        residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        out = torch.empty_like(residual)
        module.add_rms_norm(out, residual, delta, weight, eps)
        return out

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        module.silu_mul(out, gate_up)
        return out

    def rope_tables(
        cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor
    ) -> RopeTables:
        return positions, cos_cache, sin_cache

    def rope_(x: torch.Tensor, tables: RopeTables) -> None:
        module.rope_(x, *tables)

    def linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: Packed,
    ) -> torch.Tensor:
        if isinstance(packed, BlockWeight):
            return quant_linear(x, packed, bias)
        rows = x.shape[0]
        if rows <= SMALL_LINEAR_ROWS and x.stride(-1) == 1:
            out = x.new_empty(rows, weight.shape[0])
            module.small_linear(out, x, weight, bias)
            return out
        if packed is not None and rows <= PACKED_LINEAR_MAX_ROWS:
            return _packed_linear(x, packed, weight, bias)
        return F.linear(x, weight, bias)

    return LayerOps(
        "compiled", rms_norm, add_rms_norm, silu_mul, rope_tables, rope_, linear, mkl_pack_linear
    )
