"""Block-quantized linear weights on CPU: GGUF's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, int8, bf16.

A CPU decode step reads every weight once, so its time is the weights' bytes.
A quantized weight stays in its blocks (Q4_1: 0.625 bytes a weight against
float32's 4) and is multiplied by Tandem's compiled kernels
(`kernels/csrc/quant_*`). The blocks are repacked once at load into tiles of
8 output rows (same bytes a weight; layout in quant_tiles.h):

* fewer than 128 input rows (32 for bf16; decode, decode batches): each
  vector of 8 outputs' integers is converted to float in registers and
  multiplied with up to 8 float32 input rows held in registers, each
  block's sums scaled once (dw * sum q x + mw * sum x);
* more rows (prefill chunks, big batches): panels of the weight are
  expanded to float32 and multiplied by ATen's GEMM (MKL).

Both compute the float32 model's dot products up to float32 rounding (the
order of the additions differs, as between two BLAS libraries).

Formats (`WEIGHT_FORMATS`):

* ``q4_0``, ``q4_1``, ``q8_0``: a GGUF file's own blocks, bit for bit
  (`from_gguf_rows`); the float values they stand for are exactly those the
  float32 conversion of the same file holds.
* ``q5_0``: GGUF's Q5_0 blocks as Q8 tiles of q - 16 (-16..15) under the
  same float16 d: the same values, 1.0625 bytes a weight against the
  file's 0.6875, and the Q8 kernels (int8 activations included). llama.cpp
  falls back to Q5_0 where a K-quant's rows are not whole super-blocks of
  256 (Gemma 3 270M's 640-wide projections in its Q4_K_M file).
* ``q4_k``, ``q6_k``: GGUF's K-quant super-blocks of 256 k, repacked with
  each sub-block's scales as float32, where they are exact (in float16
  they are not): Q4_K (8 sub-blocks of 32, 6-bit scales and mins under
  float16 d and dmin) as Q4 tiles with dw = d * scale, mw = -dmin * min,
  0.75 bytes a weight against the file's 0.5625; Q6_K (16 sub-blocks of
  16, int8 scales, 6-bit quants) as Q8 tiles of q - 32 with a dw = d *
  scale per half block, 1.25 bytes a weight against 0.82. The same float
  values as gguf's dequantizer. Both take int8 activations: Q4_K as Q4_1
  does (its tiles are Q4's with float32 scales), Q6_K as Q8_0 does with
  each half block's integer sum kept apart for its own scale. Other
  K-quants are expanded to float at load (engine/models/gguf_weights.py).
* ``int8``: any float weight quantized per output channel (`quantize_int8`):
  one scale per row (absmax / 127, rounded up to float16), for HF models.
* ``bf16``: any float weight rounded to bfloat16 (`to_bf16`), expanded to
  float32 in registers (a shift) by the same kernels. On CPUs with
  AVX512_BF16, from `bf16_dot_rows()` input rows on (prefill chunks, big
  batches) the inputs are rounded to bfloat16 too and multiplied by the
  CPU's bfloat16 dot products (float32 sums; quant_linear_bf16.cpp):
  1.6-3.5x float32's GEMM at 32-512 rows (benchmarks/quant_kernel_bench.py),
  each input off by up to 2^-9 of itself.

Opt-in ``int8_activations`` (integer formats only) quantizes each input row
to int8 in blocks of 32 as well and does the dot products in integers, as
llama.cpp does: faster, but each input is off by up to absmax(its block of
32) / 254. With AVX-512 VNNI the integer dot products are vpdpbusd.

On CPUs with AMX-BF16 (Intel Xeons from Sapphire Rapids), int8-activation
calls of `amx_bf16_rows()` rows and more (prefill chunks) round the inputs
to bfloat16 instead and run as one oneDNN bfloat16 GEMM on AMX tiles over
the weight expanded to bfloat16 for the call, outputs rounded to bfloat16
(quant_gemm.cpp amx_bf16_gemm): 1.0-1.5x the int8 kernels at 1,024 rows and
1.5-2.3x from 2,048 on that machine (benchmarks/README.md, "amx_bf16_gemm_bench.py").

Code paths (`ISAS`): "portable" C++, "avx2", "avx512" (AVX2's kernels plus
VNNI dot products and, where present, AVX512_BF16's), "amx" (avx512's, with
the int8 path's calls of 16 rows and more on AMX tiles: Intel Xeons from
Sapphire Rapids, where the OS grants them; quant_linear_amx.cpp). The kernels are built
for the machine they run on (-march=native); `quant_linear(isa=...)` caps
the path, so tests run every one the CPU has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kernels import cpu_kernels

# GGML's type ids for the block formats the kernels take (ggml.h).
GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q6_k": 14}
WEIGHT_FORMATS = ("q4_0", "q4_1", "q5_0", "q4_k", "q6_k", "q8_0", "int8", "bf16")
# The kernels' code paths, plainest first; a build has a prefix of them.
ISAS = ("portable", "avx2", "avx512", "amx")
# The paths float inputs can take ("amx" changes only int8 activations' calls).
FLOAT_ISAS = ISAS[:3]
BLOCK = 32
TILE_ROWS = 8  # output rows per tile (quant_tiles.h's kTile)
_Q8_0_BLOCK_BYTES = 2 + BLOCK


class QuantKernelsUnavailable(RuntimeError):
    """Quantized weights need Tandem's compiled CPU kernels, which did not load."""


def kernels() -> ModuleType:
    module = cpu_kernels.load()
    if module is None:
        raise QuantKernelsUnavailable(
            "quantized weights need Tandem's compiled CPU kernels, which could not be built "
            "(a C++ compiler and ninja are needed; see the log) or are turned off "
            "(TANDEM_CPU_KERNELS=0): use quantization='none'"
        )
    return module


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [out_features, in_features] weight in `format`'s blocks, repacked
    into the kernels' tiles (`packed`: uint8 [tiles, blocks, bytes])."""

    format: str
    out_features: int
    in_features: int
    packed: torch.Tensor
    # Quantize the inputs to int8 too (llama.cpp's way; quant_linear_int8.cpp):
    # fewer instructions, rounded activations. Off: float32 inputs, exact weights.
    int8_activations: bool = False

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 values the blocks stand for: all rows, or `rows` (int64)."""
        if rows is None:
            rows = torch.arange(self.out_features)
        out: torch.Tensor = kernels().dequantize_rows(self.packed, rows, self.in_features)
        return out


@dataclass(frozen=True, eq=False)
class ShardedWeight:
    """One fused weight (a q/k/v or gate/up) whose row shards are tiles of
    different kinds: a Q4_K_M file's Q4_K q and k with a Q6_K v. Each shard
    multiplies into its own columns of the output (`quant_linear`: one
    kernel call a shard), so every shard stays in its blocks where one tile
    kind would have needed a float32 expansion."""

    shards: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        first = self.shards[0]
        if any(
            w.in_features != first.in_features or w.int8_activations != first.int8_activations
            for w in self.shards
        ):
            raise ValueError("the shards of a weight must share in_features and int8_activations")

    @property
    def format(self) -> str:
        return "|".join(w.format for w in self.shards)

    @property
    def out_features(self) -> int:
        return sum(w.out_features for w in self.shards)

    @property
    def in_features(self) -> int:
        return self.shards[0].in_features

    @property
    def int8_activations(self) -> bool:
        return self.shards[0].int8_activations

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.shards)

    def columns(self) -> list[tuple[QuantizedWeight, int]]:
        """Each shard with its first output column."""
        starts = np.cumsum([0] + [w.out_features for w in self.shards[:-1]])
        return list(zip(self.shards, (int(s) for s in starts), strict=True))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        full = torch.cat([w.dequantize() for w in self.shards])
        return full if rows is None else full[rows]


# A weight in blocks: one tile kind, or shards of several.
BlockWeight = QuantizedWeight | ShardedWeight


def from_gguf_rows(
    rows: torch.Tensor, fmt: str, in_features: int, int8_activations: bool = False
) -> QuantizedWeight:
    """A weight from its GGUF bytes: uint8 [out_features, bytes per row]."""
    if fmt not in GGML_TYPES:
        raise ValueError(f"GGUF format {fmt!r} is not one the kernels take: {sorted(GGML_TYPES)}")
    packed = kernels().pack_gguf_blocks(rows.contiguous(), GGML_TYPES[fmt])
    return QuantizedWeight(fmt, rows.shape[0], in_features, packed, int8_activations)


def concat_rows(weights: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight with `weights`' rows in order (a fused qkv of shards in
    different GGUF formats), or None where their tiles differ in kind (the
    bytes of a tile's block name it: Q5_0 and Q8_0 are both Q8 tiles, Q4_K
    and Q6_K are not) or a shard before the last ends inside a tile."""
    first = weights[0]
    if any(
        w.in_features != first.in_features
        or w.int8_activations != first.int8_activations
        or w.packed.shape[1:] != first.packed.shape[1:]
        for w in weights
    ) or any(w.out_features % TILE_ROWS for w in weights[:-1]):
        return None
    formats = sorted({w.format for w in weights})
    return QuantizedWeight(
        "/".join(formats),
        sum(w.out_features for w in weights),
        first.in_features,
        torch.cat([w.packed for w in weights]),
        first.int8_activations,
    )


def join_rows(weights: Sequence[QuantizedWeight]) -> BlockWeight:
    """`weights`' rows in order as one weight: joined tiles where their
    kinds allow (`concat_rows`), shards multiplied apart where not."""
    joined = concat_rows(weights)
    return joined if joined is not None else ShardedWeight(tuple(weights))


def quantize_int8(weight: torch.Tensor, int8_activations: bool = False) -> QuantizedWeight:
    """int8 per output channel: q = round(w / s) with s = absmax(row) / 127
    rounded up to float16 (so |q| <= 127), written as Q8_0 blocks that all
    share their row's scale."""
    w = weight.detach().float().cpu()
    out_features, in_features = w.shape
    padded = -(-in_features // BLOCK) * BLOCK
    w = torch.nn.functional.pad(w, (0, padded - in_features))
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float16).tiny)
    half = scale.half()
    # Round up where float16 rounded down, so no value exceeds 127 steps.
    below = half.float() < scale
    half[below] = torch.nextafter(half[below], torch.tensor(torch.inf, dtype=torch.float16))
    q = torch.round(w / half.float().unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    blocks = padded // BLOCK
    raw = np.empty((out_features, blocks, _Q8_0_BLOCK_BYTES), dtype=np.uint8)
    raw[:, :, :2] = half.numpy().view(np.uint8).reshape(out_features, 1, 2)
    raw[:, :, 2:] = q.numpy().view(np.uint8).reshape(out_features, blocks, BLOCK)
    packed = kernels().pack_gguf_blocks(
        torch.from_numpy(raw.reshape(out_features, -1)), GGML_TYPES["q8_0"]
    )
    return QuantizedWeight("int8", out_features, in_features, packed, int8_activations)


def to_bf16(weight: torch.Tensor) -> QuantizedWeight:
    """`weight` rounded to bfloat16 (nearest even), in the kernels' tiles."""
    w = weight.detach().cpu().to(torch.bfloat16)
    return QuantizedWeight("bf16", w.shape[0], w.shape[1], kernels().pack_bf16(w))


def available_isas() -> tuple[str, ...]:
    """The kernels' code paths this build has, from the plainest (`ISAS`)."""
    return ISAS[: kernels().quant_linear_best_isa() + 1]


def cap_isa(isa: str) -> None:
    """Caps every later call's code path at `isa` (serving's calls too), so a
    benchmark compares paths inside one process; `ISAS[-1]` lifts the cap."""
    kernels().quant_linear_cap_isa(_isa_level(isa))


def bf16_dot_rows() -> int | None:
    """From how many input rows `bf16` weights multiply inputs rounded to
    bfloat16 with AVX512_BF16's dot products (at the "avx512" level); None
    where this build has no such path (float32 inputs at every row count)."""
    rows: int = kernels().quant_linear_bf16_dot_rows()
    return rows if rows >= 0 else None


def amx_bf16_rows() -> int | None:
    """From how many input rows int8-activation calls run as one bfloat16
    GEMM on AMX tiles (oneDNN, through ATen) instead of the int8 kernels;
    None where this build or CPU has no AMX-BF16 (or it is turned off)."""
    rows: int = kernels().quant_linear_amx_bf16_rows()
    return rows if rows > 0 else None


def set_amx_bf16_rows(rows: int) -> int:
    """Sets `amx_bf16_rows`' threshold for every later call (0: off), so a
    benchmark compares the paths in one process; returns the previous one."""
    previous: int = kernels().quant_linear_set_amx_bf16_rows(rows)
    return previous


def _isa_level(isa: str | None) -> int:
    """`isa`'s number for the kernels (None: the best this build has)."""
    if isa is None:
        return len(ISAS) - 1
    if isa not in ISAS:
        raise ValueError(f"isa {isa!r} is not one of {ISAS}")
    return ISAS.index(isa)


def quant_linear(
    x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None, *, isa: str | None = None
) -> torch.Tensor:
    """x [T, in] float32 @ weight.T + bias -> [T, out]. `isa` caps the code
    path (one of `ISAS`; None: the best this build has): "portable" is the
    scalar C++ a CPU without AVX2 runs, "avx2" what one without AVX-512
    VNNI runs. A sharded weight's shards each write their columns."""
    level = _isa_level(isa)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(x.shape[0], weight.out_features)
    if isinstance(weight, QuantizedWeight):
        kernels().quant_linear(out, x, weight.packed, bias, weight.int8_activations, level)
        return out
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"bias must be [{weight.out_features}], got {list(bias.shape)}")
    for part, start in weight.columns():
        n = part.out_features
        part_bias = None if bias is None else bias[start : start + n]
        kernels().quant_linear(
            out[:, start : start + n], x, part.packed, part_bias, part.int8_activations, level
        )
    return out


def quant_linear_silu(
    gate_up: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    *,
    isa: str | None = None,
) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T + bias for gate_up = [gate | up] [T, 2 * in],
    for a weight that takes int8 activations: each row's activation is
    computed a block at a time as it is quantized, never written out (the
    MLP's down projection; the same values as quant_linear(silu_mul(...)))."""
    if not weight.int8_activations:
        raise ValueError(
            f"quant_linear_silu needs a weight with int8 activations ({weight.format} has none)"
        )
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * weight.in_features:
        raise ValueError(
            f"gate_up must be [rows, {2 * weight.in_features}] (gate, then up), "
            f"got {list(gate_up.shape)}"
        )
    level = _isa_level(isa)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = gate_up.new_empty(gate_up.shape[0], weight.out_features)
    kernels().quant_linear_silu(out, gate_up, weight.packed, bias, level)
    return out


MLP_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def amx_mlp_applies(rows: int, gate_up: BlockWeight, down: BlockWeight) -> bool:
    """Whether `amx_mlp` takes a call of `rows` rows with these weights: a
    CPU with AMX-BF16 (not turned off), rows at least `amx_bf16_rows()`,
    both weights whole (not sharded) integer blocks with int8 activations."""
    threshold = amx_bf16_rows()
    return (
        threshold is not None
        and rows >= threshold
        and all(
            isinstance(w, QuantizedWeight) and w.int8_activations and w.format != "bf16"
            for w in (gate_up, down)
        )
    )


def amx_mlp(
    x: torch.Tensor,
    gate_up: QuantizedWeight,
    down: QuantizedWeight,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """A gated MLP, act(gate) * up @ down.T (+ biases), in one pass on AMX
    tiles for prefill-sized calls (`amx_mlp_applies`): each block of rows goes
    through gate_up, the activation and down while in cache, and each weight
    is expanded to bfloat16 once a call. x and the activation are rounded to
    bfloat16 (as the int8 path's AMX GEMMs round them); sums in float32.
    `activation`: "silu" or "gelu_tanh" (torch's approximate="tanh")."""
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(MLP_ACTIVATIONS)}, got {activation!r}")
    if gate_up.out_features != 2 * down.in_features or x.shape[-1] != gate_up.in_features:
        raise ValueError(
            f"x [rows, {x.shape[-1]}], gate_up [{gate_up.out_features}, {gate_up.in_features}] "
            f"and down [{down.out_features}, {down.in_features}] do not chain"
        )
    if not amx_mlp_applies(x.shape[0], gate_up, down):
        raise ValueError(f"amx_mlp does not take {x.shape[0]} rows of these weights here")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(x.shape[0], down.out_features)
    kernels().quant_mlp_amx(
        out,
        x,
        gate_up.packed,
        down.packed,
        down.in_features,
        gate_up_bias,
        down_bias,
        MLP_ACTIVATIONS[activation],
    )
    return out


def format_summary(weights: Sequence[BlockWeight | torch.Tensor]) -> str:
    """The formats of a model's weights, largest share of parameters first,
    e.g. 'q4_1+q8_0' or 'float32' (a sharded weight's shards count apart)."""
    counts: dict[str, int] = {}
    flat = [s for w in weights for s in (w.shards if isinstance(w, ShardedWeight) else (w,))]
    for w in flat:
        if isinstance(w, QuantizedWeight):
            name, n = w.format, w.out_features * w.in_features
        else:
            name, n = str(w.dtype).removeprefix("torch."), w.numel()
        counts[name] = counts.get(name, 0) + n
    return "+".join(sorted(counts, key=lambda k: -counts[k]))
