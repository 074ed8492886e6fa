# Kernel parameters are Triton values; annotating them would change how
# Triton specialises them, so mypy is told not to ask (launchers stay typed).
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton versions of the decoder's small per-layer ops (`kernels.layer_ops`).

On a GPU a decode step is launch-bound: its tensors are a few rows, so each
torch kernel costs its launch, not its arithmetic, and torch spells every
small op as a chain of them (RMSNorm ~6 launches, RoPE 3 plus the table
gathers, SiLU-and-mul 2, the K/V cache write 1, the residual add 1). Each
op here is ONE launch with `TORCH_OPS`'s exact recipe, roundings included:

* `rms_norm` / `add_rms_norm`: the residual add, the float32 sum of squares,
  the normalisation (rounded to the model dtype, as transformers rounds)
  and the weight scale, one program per row;
* `silu_mul`: silu(gate) rounded to the dtype, times up;
* `rope_`: rotate-half RoPE in place on a strided view, indexing the float32
  cos/sin caches by position itself, so `rope_tables` gathers nothing;
* `rope_and_cache`: attention's rotation of q and k and the write of the
  rotated K and of V into the paged cache, what the torch path does in
  `rope_` + `reshape_and_cache`.

Results equal torch's up to float32 intermediates that differ in their last
bits (RMSNorm's summation order, exp in SiLU, fused multiply-adds on a GPU):
a few float32 ulps, or an occasional ulp of bfloat16 / float16 where such a
difference crosses a rounding boundary (tests/unit/kernels/
test_triton_layer_ops.py states the tolerances).

Everything runs under Triton's CPU interpreter too (`TRITON_INTERPRET=1` set
before triton is imported), which is how the unit tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layer_ops import LayerOps, RopeTables, _no_packing, _torch_linear
from kernels.triton_attention import _check_cache_dtype, is_fp8_cache, round_to, to_cache

# Rows up to this many elements are normalised from registers in one pass;
# longer ones in chunks of it, over two passes (sum of squares, then scale).
_MAX_BLOCK_H = 8192
# Elements per silu_mul program.
_SILU_BLOCK = 1024
# Elements (heads x half the rotary dims) per RoPE program.
_ROPE_TILE = 4096

# Whether the kernels below were wrapped for Triton's CPU interpreter (decided
# by TRITON_INTERPRET when they were decorated, i.e. now).
_INTERPRETED = bool(triton.knobs.runtime.interpret)


# --- RMSNorm ------------------------------------------------------------------------


@triton.jit
def _load_row(
    x_ptr, delta_ptr, x_offsets, delta_offsets, mask, ADD: tl.constexpr, INTERPRETED: tl.constexpr
):
    """x's chunk in float32; with ADD, x + delta rounded to x's dtype (as
    torch's in-place add rounds) and written back to x first."""
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
    if ADD:
        delta = tl.load(delta_ptr + delta_offsets, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + delta.to(tl.float32), x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(x_ptr + x_offsets, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _scale_row(x, inv_rms, weight_ptr, out_ptr, cols, out_offsets, mask, INTERPRETED: tl.constexpr):
    # transformers' order: normalise in float32, round to the model dtype,
    # then multiply by the weight (rounded again).
    dtype = out_ptr.dtype.element_ty
    normed = round_to(x * inv_rms, dtype, INTERPRETED).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offsets, round_to(normed * weight, dtype, INTERPRETED), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_delta,
    stride_out,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    CHUNKS: tl.constexpr,
    ADD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    x_row, delta_row, out_row = row * stride_x, row * stride_delta, row * stride_out
    if CHUNKS == 1:
        # The whole row stays in registers between the two steps.
        mask = cols < hidden
        x = _load_row(x_ptr, delta_ptr, x_row + cols, delta_row + cols, mask, ADD, INTERPRETED)
        inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
        _scale_row(x, inv_rms, weight_ptr, out_ptr, cols, out_row + cols, mask, INTERPRETED)
    else:
        squares = tl.zeros([BLOCK_H], tl.float32)
        for chunk in range(CHUNKS):
            c = chunk * BLOCK_H + cols
            mask = c < hidden
            x = _load_row(x_ptr, delta_ptr, x_row + c, delta_row + c, mask, ADD, INTERPRETED)
            squares += x * x
        inv_rms = tl.rsqrt(tl.sum(squares, 0) / hidden + eps)
        if ADD:
            # The second pass re-reads the sums the first pass stored. With
            # equal layouts each thread reads back its own stores, but that
            # is the compiler's choice; the barrier makes it not matter.
            tl.debug_barrier()
        for chunk in range(CHUNKS):
            c = chunk * BLOCK_H + cols
            mask = c < hidden
            x = tl.load(x_ptr + x_row + c, mask=mask, other=0.0).to(tl.float32)
            _scale_row(x, inv_rms, weight_ptr, out_ptr, c, out_row + c, mask, INTERPRETED)


def _launch_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    _check_rows(x=x, weight=weight, **({} if delta is None else {"delta": delta}))
    rows, hidden = x.shape
    if weight.shape != (hidden,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(_next_pow2(hidden), _MAX_BLOCK_H)
    src = x if delta is None else delta  # delta's pointer is unused without ADD
    _rms_norm_kernel[(rows,)](
        x,
        src,
        weight,
        out,
        x.stride(0),
        src.stride(0),
        out.stride(0),
        hidden,
        eps,
        BLOCK_H=block,
        CHUNKS=_cdiv(hidden, block),
        ADD=delta is not None,
        INTERPRETED=_INTERPRETED,
        num_warps=_num_warps(block, 16),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of `x` `[T, H]` (last dim contiguous), a new
    contiguous `[T, H]` tensor in x's dtype: `(xf * rsqrt(mean(xf^2) + eps))`
    in float32, rounded to x's dtype, times `weight` `[H]`, rounded again."""
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`residual += delta` in place (rounded to residual's dtype), then
    `rms_norm(residual, weight, eps)`, in one launch."""
    return _launch_rms_norm(residual, delta, weight, eps)


# --- SiLU-and-mul ---------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = gate_up_ptr + row * stride_gate_up + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    # torch's recipe: silu in float32 rounded to the dtype, then the product.
    dtype = out_ptr.dtype.element_ty
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETED).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(silu * up, dtype, INTERPRETED), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up` `[T, 2I]` = [gate | up] (last dim
    contiguous), a new contiguous `[T, I]` tensor."""
    _check_rows(gate_up=gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {width}")
    inter = width // 2
    out = gate_up.new_empty((rows, inter))
    if rows == 0 or inter == 0:
        return out
    block = min(_SILU_BLOCK, _next_pow2(inter))
    _silu_mul_kernel[(rows, _cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        INTERPRETED=_INTERPRETED,
        num_warps=_num_warps(block, 4),
    )
    return out


# --- RoPE -------------------------------------------------------------------------------


@triton.jit
def _load_angles(
    positions_ptr,
    cos_ptr,
    sin_ptr,
    token,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """This token's cos and sin rows `[1, HALF_PAD]`, float32."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    mask = dims < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + dims, mask=mask, other=0.0).to(tl.float32)
    return cos[None, :], sin[None, :]


@triton.jit
def _rotate_heads(
    x_ptr,
    row_base,
    heads,
    head_mask,
    stride_h,
    cos,
    sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Rotate-half RoPE of the first 2 * HALF dims of `heads`, in place;
    returns the two rotated halves (in x's dtype).

    torch's `x.mul_(cos).addcmul_(roll(x), signed_sin)` over float32 tables
    computes each step in float32 and rounds into x's dtype after each:
    `round(round(x1 * cos) - x2 * sin)`, `round(round(x2 * cos) + x1 * sin)`.
    """
    dims = tl.arange(0, HALF_PAD)
    mask = head_mask[:, None] & (dims < HALF)[None, :]
    first = x_ptr + row_base + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    out1 = round_to(
        round_to(x1 * cos, dtype, INTERPRETED).to(tl.float32) - x2 * sin, dtype, INTERPRETED
    )
    out2 = round_to(
        round_to(x2 * cos, dtype, INTERPRETED).to(tl.float32) + x1 * sin, dtype, INTERPRETED
    )
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _rope_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_x_t,
    stride_x_h,
    stride_cos,
    stride_sin,
    num_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    cos, sin = _load_angles(
        positions_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, HALF, HALF_PAD
    )
    _rotate_heads(
        x_ptr,
        token * stride_x_t,
        heads,
        heads < num_heads,
        stride_x_h,
        cos,
        sin,
        HALF,
        HALF_PAD,
        INTERPRETED,
    )


def rope_tables(
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor
) -> RopeTables:
    """`(positions, cos_cache, sin_cache)`: the kernels index the float32
    caches `[max_pos, D/2]` by position themselves, so nothing is gathered."""
    return positions, cos_cache, sin_cache


def _head_block(num_heads: int, half_pad: int) -> int:
    return max(1, min(_next_pow2(num_heads), _ROPE_TILE // half_pad))


def _check_tables(tables: RopeTables, num_tokens: int, rotary_dim: int) -> None:
    positions, cos_cache, sin_cache = tables
    if positions.shape != (num_tokens,):
        raise ValueError(f"{num_tokens} tokens but positions of shape {tuple(positions.shape)}")
    for cache in (cos_cache, sin_cache):
        if cache.dim() != 2 or 2 * cache.shape[1] != rotary_dim:
            raise ValueError(
                f"rotating {rotary_dim} dims needs [max_pos, {rotary_dim // 2}] cos/sin "
                f"caches, got {tuple(cache.shape)}"
            )
    _check_last_dim_contiguous(cos_cache=cos_cache, sin_cache=sin_cache)


def rope_(x: torch.Tensor, tables: RopeTables) -> None:
    """Rotate-half RoPE, in place, of `x` `[T, heads, D]` (any token and head
    strides, last dim contiguous) with `tables` from `rope_tables`."""
    num_tokens, num_heads, dim = x.shape
    if dim % 2:
        raise ValueError(f"RoPE needs an even rotary dimension, got {dim}")
    _check_tables(tables, num_tokens, dim)
    _check_last_dim_contiguous(x=x)
    if num_tokens == 0 or num_heads == 0 or dim == 0:
        return
    positions, cos_cache, sin_cache = tables
    half_pad = _next_pow2(dim // 2)
    block_heads = _head_block(num_heads, half_pad)
    _rope_kernel[(num_tokens, _cdiv(num_heads, block_heads))](
        x,
        positions,
        cos_cache,
        sin_cache,
        x.stride(0),
        x.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_heads,
        HALF=dim // 2,
        HALF_PAD=half_pad,
        BLOCK_HEADS=block_heads,
        INTERPRETED=_INTERPRETED,
        num_warps=_num_warps(block_heads * half_pad, 4),
    )


# --- RoPE + K/V cache write ---------------------------------------------------------------


@triton.jit
def _cache_offsets(
    slot, kv_heads, stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr
):
    return (
        (slot // BLOCK_SIZE) * stride_block
        + (slot % BLOCK_SIZE) * stride_slot
        + kv_heads[:, None] * stride_head
    )


@triton.jit
def _copy_to_cache(
    heads_ptr,
    cache_ptr,
    head_rows,
    cache_rows,
    head_mask,
    START: tl.constexpr,
    DIMS: tl.constexpr,
    PAD: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Dims [START, DIMS) of each head row, from heads to the cache."""
    dims = START + tl.arange(0, PAD)
    mask = head_mask[:, None] & (dims < DIMS)[None, :]
    rows = tl.load(heads_ptr + head_rows + dims[None, :], mask=mask)
    cached = to_cache(rows, cache_ptr.dtype.element_ty, FP8, INTERPRETED)
    tl.store(cache_ptr + cache_rows + dims[None, :], cached, mask=mask)


@triton.jit
def _rope_and_cache_kernel(
    heads_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_heads_t,
    stride_heads_h,
    stride_cos,
    stride_sin,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    Q_PROGRAMS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # Programs (t, 0..Q_PROGRAMS-1) rotate blocks of t's q heads; program
    # (t, Q_PROGRAMS) rotates t's k heads and writes its K and V rows.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row_base = token * stride_heads_t
    if block < Q_PROGRAMS:
        cos, sin = _load_angles(
            positions_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, HALF, HALF_PAD
        )
        q_heads = block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        _rotate_heads(
            heads_ptr,
            row_base,
            q_heads,
            q_heads < NUM_HEADS,
            stride_heads_h,
            cos,
            sin,
            HALF,
            HALF_PAD,
            INTERPRETED,
        )
    else:
        kv = tl.arange(0, KV_PAD)
        kv_mask = kv < NUM_KV_HEADS
        k_rows = row_base + (NUM_HEADS + kv)[:, None] * stride_heads_h
        v_rows = row_base + (NUM_HEADS + NUM_KV_HEADS + kv)[:, None] * stride_heads_h
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        # A negative slot marks a padding token: rotated, but cached nowhere.
        cache_rows = _cache_offsets(
            tl.maximum(slot, 0),
            kv,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            BLOCK_SIZE,
        )
        # (slot broadcast first: the interpreter rejects a mask made with a scalar)
        write = kv_mask & ((kv * 0 + slot) >= 0)
        if HALF > 0:
            cos, sin = _load_angles(
                positions_ptr, cos_ptr, sin_ptr, token, stride_cos, stride_sin, HALF, HALF_PAD
            )
            k1, k2 = _rotate_heads(
                heads_ptr,
                row_base,
                NUM_HEADS + kv,
                kv_mask,
                stride_heads_h,
                cos,
                sin,
                HALF,
                HALF_PAD,
                INTERPRETED,
            )
            # The rotated K goes to the cache from registers, not re-read
            # from heads (other threads of this program stored it).
            dims = tl.arange(0, HALF_PAD)
            mask = write[:, None] & (dims < HALF)[None, :]
            first = k_cache_ptr + cache_rows + dims[None, :]
            cache_type = k_cache_ptr.dtype.element_ty
            tl.store(first, to_cache(k1, cache_type, FP8, INTERPRETED), mask)
            tl.store(first + HALF, to_cache(k2, cache_type, FP8, INTERPRETED), mask)
        if 2 * HALF < HEAD_DIM:
            # K's unrotated dims (partial rotary), copied as they are.
            _copy_to_cache(
                heads_ptr,
                k_cache_ptr,
                k_rows,
                cache_rows,
                write,
                2 * HALF,
                HEAD_DIM,
                TAIL_PAD,
                FP8,
                INTERPRETED,
            )
        _copy_to_cache(
            heads_ptr,
            v_cache_ptr,
            v_rows,
            cache_rows,
            write,
            0,
            HEAD_DIM,
            HEAD_PAD,
            FP8,
            INTERPRETED,
        )


def rope_and_cache(
    heads: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    tables: RopeTables,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Attention's RoPE and cache write in one launch.

    `heads` is the fused QKV output viewed `[T, num_heads + 2 * num_kv_heads,
    head_dim]` (any token and head strides, last dim contiguous). The same as
    `rope_(heads[:, :num_heads + num_kv_heads, :rotary_dim], tables)` (no
    rotation when `rotary_dim` is 0) followed by
    `reference.reshape_and_cache(k, v, kv_cache, slot_mapping)` with k and v
    the K and V heads: the rotated K rows and the V rows are written, cast to
    the cache's dtype, into `kv_cache` `[2, num_blocks, block_size,
    num_kv_heads, head_dim]` at `slot_mapping[t]`; a negative slot writes
    nothing (its q and k are still rotated). An int8 cache is refused; an fp8
    one is written as `triton_attention.reshape_and_cache` writes it.
    """
    num_tokens, total_heads, head_dim = heads.shape
    if total_heads != num_heads + 2 * num_kv_heads:
        raise ValueError(f"{total_heads} heads are not {num_heads} q + 2 x {num_kv_heads} kv heads")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in [0, {head_dim}], got {rotary_dim}")
    _check_cache_dtype(kv_cache)
    if kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache of shape {tuple(kv_cache.shape)} for {num_kv_heads} kv heads")
    if rotary_dim:
        _check_tables(tables, num_tokens, rotary_dim)
    _check_last_dim_contiguous(heads=heads, kv_cache=kv_cache)
    if num_tokens == 0:
        return
    positions, cos_cache, sin_cache = tables
    half = rotary_dim // 2
    half_pad = _next_pow2(max(half, 1))
    block_heads = _head_block(num_heads, half_pad)
    q_programs = _cdiv(num_heads, block_heads) if half else 0
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rope_and_cache_kernel[(num_tokens, q_programs + 1)](
        heads,
        positions,
        cos_cache,
        sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        heads.stride(0),
        heads.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        KV_PAD=_next_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=_next_pow2(head_dim),
        TAIL_PAD=_next_pow2(max(head_dim - rotary_dim, 1)),
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_HEADS=block_heads,
        Q_PROGRAMS=q_programs,
        BLOCK_SIZE=kv_cache.shape[2],
        FP8=is_fp8_cache(kv_cache),
        INTERPRETED=_INTERPRETED,
        num_warps=_num_warps(block_heads * half_pad, 4),
    )


# --- helpers ----------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_warps(elements: int, most: int) -> int:
    """About 16 elements a thread: small tiles waste no warps."""
    return max(1, min(most, elements // 512))


def _check_rows(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dim() != (1 if name == "weight" else 2):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}")
    _check_last_dim_contiguous(**tensors)


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels address the last dimension with unit stride.
    for name, tensor in tensors.items():
        if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


TRITON_LAYER_OPS = LayerOps(
    "triton",
    rms_norm,
    add_rms_norm,
    silu_mul,
    rope_tables,
    rope_,
    _torch_linear,
    _no_packing,
    rope_and_cache,
)
