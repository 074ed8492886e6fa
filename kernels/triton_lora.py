# Kernel parameters are Triton values; annotating them would change how
# Triton specialises them, so mypy is told not to ask (launchers stay typed).
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton batched LoRA (SGMV): the contract of `kernels.lora.lora_torch`.

Two kernels, each launched once for the whole step, as Punica and vLLM do:

* shrink: ``scratch[T, R] = x @ A[slot].T`` in float32,
* expand: ``y += scratch @ B[slot].T``.

Both tile the step's token rows (and the expand also its output columns) and
read each row's slot from ``LoRABatch.token_slots`` (-1 = base-model row), so
there is no per-segment launch and no per-step metadata beyond what the batch
already caches on the device. The model runner groups rows by adapter, so a
row tile almost always holds one slot, but a tile can straddle segments
(short decode segments, a segment boundary): a program loops over the
distinct slots present in its tile, largest first, and each pass reads that
slot's weights once and contributes only to that slot's rows. Tiles holding
only base rows return at once, and base rows are never loaded or stored, so
they stay bit-identical.

A decode step has few row tiles, too few programs to stream ``x`` and ``A``
at full bandwidth, so the shrink can split its ``in`` reduction across
programs. Each split writes its own float32 partial and the expand sums
them while loading: deterministic, unlike atomics, and cheap, as the partials
are ``[splits, T, R]`` with R small.

The kernels also run under Triton's CPU interpreter (`TRITON_INTERPRET=1`
set before triton is imported), which is how the unit tests check them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter multiplies bfloat16 matrices wrongly: its _dot
# widens them there (the attention kernels' own helper).
from kernels.triton_attention import _dot

if TYPE_CHECKING:
    # kernels.lora imports this module (on CUDA): annotations only, no cycle.
    from kernels.lora import LoRABatch

# tl.dot needs every matrix dimension to be at least 16.
_MIN_DOT = 16
# The shrink's `in` range per split is at least this many BLOCK_K steps, so a
# split's loads still pipeline.
_MIN_STEPS_PER_SPLIT = 4
_MAX_SPLITS = 16
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    token_slots_ptr,
    partial_ptr,
    num_tokens,
    in_features,
    rank,
    split_steps,
    stride_x_t,
    stride_x_k,
    stride_a_slot,
    stride_a_r,
    stride_a_k,
    stride_partial_split,
    stride_partial_t,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """partial[split, rows, :rank] = x[rows, split's k range] @ A[slot].T (fp32)."""
    m_tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(token_slots_ptr + rows, mask=rows < num_tokens, other=-1)
    # The tile's slots are visited largest first; a tile of base rows only
    # (max -1) has nothing to do.
    slot = tl.max(slots, 0)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        # A multiple of BLOCK_K (as is each k0 below), so the loads vectorise.
        k_lo = split * split_steps * BLOCK_K
        k_hi = tl.minimum(k_lo + split_steps * BLOCK_K, in_features)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_t
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        remaining = slots
        while slot >= 0:
            # Rows of other slots load as zero, so they gain nothing this pass
            # and one accumulator serves every slot of the tile.
            mine = remaining == slot
            a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks[None, :] * stride_a_r
            for k0 in range(k_lo, k_hi, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_hi
                x = tl.load(
                    x_rows + ks[None, :] * stride_x_k, mask=mine[:, None] & k_ok[None, :], other=0.0
                )
                # A[slot] is [R, in]; read it transposed as [BLOCK_K, BLOCK_R].
                a = tl.load(
                    a_slot + ks[:, None] * stride_a_k,
                    mask=k_ok[:, None] & rank_ok[None, :],
                    other=0.0,
                )
                acc += _dot(x, a, UPCAST_DOT, DOT_PRECISION)
            remaining = tl.where(mine, -1, remaining)
            slot = tl.max(remaining, 0)
        partial = (
            partial_ptr
            + split.to(tl.int64) * stride_partial_split
            + rows.to(tl.int64)[:, None] * stride_partial_t
            + ranks[None, :]
        )
        tl.store(partial, acc, mask=(slots >= 0)[:, None] & rank_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    token_slots_ptr,
    partial_ptr,
    num_tokens,
    out_features,
    rank,
    num_splits,
    stride_y_t,
    stride_y_n,
    stride_b_slot,
    stride_b_n,
    stride_b_r,
    stride_partial_split,
    stride_partial_t,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """y[rows, cols] += sum over splits of partial[split, rows] @ B[slot][cols].T."""
    m_tile = tl.program_id(0)
    n_tile = tl.program_id(1)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(token_slots_ptr + rows, mask=rows < num_tokens, other=-1)
    slot = tl.max(slots, 0)
    if slot >= 0:
        lora_rows = slots >= 0
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < out_features
        rows64 = rows.to(tl.int64)

        # The shrunk rows, loaded once for every slot of the tile (base rows
        # and padded ranks as zero, so they contribute nothing below).
        partial_rows = partial_ptr + rows64[:, None] * stride_partial_t + ranks[None, :]
        partial_mask = lora_rows[:, None] & rank_ok[None, :]
        shrunk = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for split in range(num_splits):
            shrunk += tl.load(
                partial_rows + split * stride_partial_split, mask=partial_mask, other=0.0
            )
        # Rounded to the weights' type, as the reference does before its second
        # matmul (and what tensor cores take).
        shrunk = shrunk.to(b_ptr.dtype.element_ty)

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        remaining = slots
        while slot >= 0:
            mine = remaining == slot
            # B[slot] is [out, R]; read it transposed as [BLOCK_R, BLOCK_N].
            b = tl.load(
                b_ptr
                + slot.to(tl.int64) * stride_b_slot
                + ranks[:, None] * stride_b_r
                + cols[None, :] * stride_b_n,
                mask=rank_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc += _dot(tl.where(mine[:, None], shrunk, 0.0), b, UPCAST_DOT, DOT_PRECISION)
            remaining = tl.where(mine, -1, remaining)
            slot = tl.max(remaining, 0)

        # Base rows are neither loaded nor stored: they stay bit-identical.
        y_offsets = rows64[:, None] * stride_y_t + cols[None, :] * stride_y_n
        y_mask = lora_rows[:, None] & col_ok[None, :]
        y = tl.load(y_ptr + y_offsets, mask=y_mask, other=0.0)
        tl.store(y_ptr + y_offsets, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


# Whether the kernels above were wrapped for Triton's CPU interpreter (decided
# by TRITON_INTERPRET when they were decorated, i.e. now).
_INTERPRETED = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True, slots=True)
class _LoRAConfig:
    block_m: int  # token rows per program (both kernels)
    block_k: int  # shrink: `in` columns per inner-loop step
    block_n: int  # expand: output columns per program
    block_r: int  # the rank padded to a power of two that tl.dot accepts
    num_warps: int


@functools.cache
def _config(num_tokens: int, rank: int, exact_fp32: bool) -> _LoRAConfig:
    """Tile shapes for the step. Rows: the fewest that tl.dot takes for
    decode-sized steps, up to 64 for prefill (larger tiles straddle more
    segments, and the rank keeps the products small anyway)."""
    block_m = min(64, max(_MIN_DOT, _next_pow2(num_tokens)))
    block_r = max(_MIN_DOT, _next_pow2(rank))
    # fp32 products run without tensor cores and hold more registers.
    block_k = 32 if exact_fp32 else 64
    block_n = 64 if exact_fp32 else 128
    num_warps = 8 if exact_fp32 and block_m * block_r >= 64 * 64 else 4
    return _LoRAConfig(
        block_m=block_m, block_k=block_k, block_n=block_n, block_r=block_r, num_warps=num_warps
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _choose_splits(x: torch.Tensor, m_tiles: int, k_steps: int) -> int:
    """Split the shrink's reduction when its row tiles alone cannot fill the
    GPU, keeping a few pipelined steps per split."""
    if x.device.type != "cuda":
        return 1
    index = x.device.index
    sm_count = _sm_count(torch.cuda.current_device() if index is None else index)
    wanted = _cdiv(sm_count, m_tiles)
    worthwhile = k_steps // _MIN_STEPS_PER_SPLIT
    return max(1, min(wanted, worthwhile, _MAX_SPLITS))


def lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoRABatch,
    *,
    num_splits: int | None = None,
) -> None:
    """In place ``y[seg.start:seg.end] += (x[seg] @ a[seg.slot].T) @ b[seg.slot].T``
    for every segment of ``batch``; rows in no segment are left untouched.

    ``y`` [T, out], ``x`` [T, in] (either may be a row-strided view),
    ``a`` [S, R, in], ``b`` [S, out, R] in the dtype of ``x``. ``num_splits``
    forces how many programs share each row tile's ``in`` reduction (tests and
    benchmarks); by default it is chosen from the step's shape on CUDA and is
    1 elsewhere.
    """
    _check_operands(y, x, a, b, batch)
    num_tokens, in_features = x.shape
    out_features = y.shape[1]
    rank = a.shape[1]
    if num_tokens == 0 or rank == 0 or not batch.segments:
        return

    cfg = _config(num_tokens, rank, x.dtype == torch.float32)
    m_tiles = _cdiv(num_tokens, cfg.block_m)
    k_steps = _cdiv(in_features, cfg.block_k)
    splits = min(num_splits or _choose_splits(x, m_tiles, k_steps), k_steps)
    # Whole BLOCK_K steps per split, and no split left empty.
    split_steps = _cdiv(k_steps, splits)
    splits = _cdiv(k_steps, split_steps)

    token_slots = batch.token_slots(y.device)
    # Only the rows of some segment are written, and only those are read.
    partial = torch.empty((splits, num_tokens, rank), dtype=torch.float32, device=x.device)
    # fp32 gets exact products; tf32 would cost ~1e-3 relative error.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"

    _lora_shrink_kernel[(m_tiles, splits)](
        x,
        a,
        token_slots,
        partial,
        num_tokens,
        in_features,
        rank,
        split_steps,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        partial.stride(0),
        partial.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        BLOCK_R=cfg.block_r,
        DOT_PRECISION=precision,
        UPCAST_DOT=_INTERPRETED,
        num_warps=cfg.num_warps,
    )
    _lora_expand_kernel[(m_tiles, _cdiv(out_features, cfg.block_n))](
        y,
        b,
        token_slots,
        partial,
        num_tokens,
        out_features,
        rank,
        splits,
        y.stride(0),
        y.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        partial.stride(0),
        partial.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_R=cfg.block_r,
        DOT_PRECISION=precision,
        UPCAST_DOT=_INTERPRETED,
        num_warps=cfg.num_warps,
    )


def _check_operands(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> None:
    """The kernels index blindly; refuse what they would misread."""
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError("expected y [T, out], x [T, in], a [S, R, in], b [S, out, R]")
    num_tokens, in_features = x.shape
    slots, rank, _ = a.shape
    if (
        y.shape[0] != num_tokens
        or a.shape[2] != in_features
        or b.shape != (slots, y.shape[1], rank)
    ):
        raise ValueError(
            f"shape mismatch: y {tuple(y.shape)}, x {tuple(x.shape)}, "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if batch.num_tokens != num_tokens:
        raise ValueError(f"batch covers {batch.num_tokens} tokens, x has {num_tokens}")
    if x.dtype not in _SUPPORTED_DTYPES or y.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtypes: x {x.dtype}, y {y.dtype}")
    if a.dtype != x.dtype or b.dtype != x.dtype:
        raise ValueError(f"a ({a.dtype}) and b ({b.dtype}) must have x's dtype ({x.dtype})")
    if len({t.device for t in (y, x, a, b)}) != 1:
        raise ValueError("y, x, a and b must be on one device")
    # A slot past the stacked weights would read out of bounds.
    if any(seg.slot < 0 or seg.slot >= slots for seg in batch.segments):
        raise ValueError(f"segment slots must lie in [0, {slots})")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
