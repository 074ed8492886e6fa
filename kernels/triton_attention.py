# Kernel parameters are Triton values; annotating them would change how
# Triton specialises them, so mypy is told not to ask (launchers stay typed).
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Triton paged-attention kernels (same signatures as `kernels.reference`).

`paged_attention` handles a whole mixed batch (prefill chunks over a cached
prefix, fresh prefills and decodes) in one launch. One program owns one
sequence, one KV head and one tile of that sequence's new tokens; it stacks
the tile's tokens for *all* query heads sharing that KV head into one matrix
of `BLOCK_Q * GROUP_PAD` rows, so each K/V block is read once per KV head
rather than once per query head (what makes decode bandwidth-bound instead of
read-amplified under GQA). K/V are gathered `BLOCK_N` positions at a time
through the block table and folded in with an online (flash-attention)
softmax in float32.

Long decodes with few sequences would leave most of a GPU idle with one
program per (sequence, KV head), so the KV range can also be split across
programs whose partial results a second small kernel merges. The host
chooses only how many splits (from the grid size against the SM count and
from `meta.max_seq_len`, the longest range any sequence may have); each
program then divides *its own* sequence's KV range evenly among them, in
whole `BLOCK_N` steps. A split past the end of a short range runs no step
and leaves max -inf / sum 0, which the merge weights as 0.

That is what makes the split launch safe to freeze in a CUDA graph. A decode
graph is captured once per padded batch size with `meta.max_seq_len` set to
the model's limit (`max_model_len`), and replayed with every later step's
real lengths: the grid, the split count and every scalar argument are those
of the capture. Were the split length one batch-wide value derived from
`max_seq_len` (32 splits of a 32768-token limit: 1024 positions each), a
5000-token sequence would keep 5 of its 32 programs busy and leave the rest
idle, a short one all in split 0: correct, but serial. Split per sequence, a
replayed sequence of any length spreads over all the splits, so the
capture's split count (chosen for the longest possible range) stays
efficient for long sequences and costs short ones only a few empty programs
and a small merge. `_choose_splits` looks at the batch's shape alone, never
at device lengths, so capture and replay agree on it.

Under a sliding window (semantics in `kernels.reference`) each program's KV
range starts at the first in-window block of its tile's first token, and
keys before a row's own window are masked within the loop: the blocks
before it are never loaded (reading K/V the mask hides is wasted
bandwidth). Splits then divide that window-sized range, not the context.

The kernels also run under Triton's CPU interpreter (`TRITON_INTERPRET=1`
set before triton is imported), which is how the unit tests check them.

The GPU's quantized cache is fp8 (e4m3, `torch.float8_e4m3fn`): one byte a
value, half of bfloat16's, so a decode step reads half the KV bytes. Values
are stored at scale 1.0, clamped to +-448: vLLM's default where no
calibrated scales come with the checkpoint (a scale per tensor computed at
write time would change the meaning of what is already cached; one from a
calibration pass is not offered). The attention kernel loads the fp8 rows
and widens them to bfloat16 in registers; no dequantized copy of the cache
exists. An int8 KV cache (`kernels.kv_int8`, the CPU's quantized cache) is
refused with a ValueError.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.reference import check_sliding_window

_LOG2E = math.log2(math.e)
# tl.dot needs every matrix dimension to be at least 16.
_MIN_DOT = 16
# Below this many KV positions per split, the merge costs more than it saves.
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 32


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # Triton's CPU interpreter multiplies bfloat16 matrices wrongly; there the
    # (already rounded) operands are widened first, which gives the same result.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 `x` rounded to DTYPE, to nearest even as the GPU (and torch)
    rounds. Triton's CPU interpreter truncates float32 to bfloat16 instead,
    so there the value is first rounded to bfloat16's 7 mantissa bits by
    hand, leaving the conversion nothing to drop."""
    if INTERPRETED and DTYPE == tl.bfloat16:  # noqa: SIM300 (DTYPE is the variable)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def to_cache(x, CACHE_TYPE: tl.constexpr, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x`` as the cache stores it, rounded to nearest even. An fp8 (e4m3)
    cache keeps values at scale 1.0, clamped to its range (+-448); in
    Triton's CPU interpreter, whose float32-to-fp8 conversion drops the
    carry when rounding up crosses a power of two (1.96 becomes 1.0),
    float32 is first rounded to fp8's 3 mantissa bits, so the conversion
    only has exact values to convert (the GPU's conversion rounds the same
    way itself)."""
    x = x.to(tl.float32)
    if FP8:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        if INTERPRETED:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(CACHE_TYPE)
    else:
        return round_to(x, CACHE_TYPE, INTERPRETED)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token with nowhere to go.
    if slot >= 0:
        heads = tl.arange(0, HEADS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        mask = (heads < NUM_KV_HEADS)[:, None]
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = (
            block * stride_cache_block
            + offset * stride_cache_slot
            + heads[:, None] * stride_cache_head
            + dims[None, :]
        )
        key_src = token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :]
        value_src = token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :]
        key = tl.load(key_ptr + key_src, mask=mask)
        value = tl.load(value_ptr + value_src, mask=mask)
        cache_type = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, to_cache(key, cache_type, FP8, INTERPRETED), mask=mask)
        tl.store(v_cache_ptr + dst, to_cache(value, cache_type, FP8, INTERPRETED), mask=mask)


@triton.jit
def _paged_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,
    num_splits,
    window,
    stride_query_t,
    stride_query_h,
    stride_out_split,
    stride_out_t,
    stride_out_h,
    stride_stats_split,
    stride_stats_t,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOWED: tl.constexpr,
    FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT:
        q_tile = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    else:
        q_tile = tl.program_id(2)
        split = 0

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid is sized for the longest query; shorter ones have spare tiles.
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        # Context position of the sequence's first new token.
        ctx_start = seq_len - q_len

        # Row r of the tile is token r // GROUP_PAD under query head
        # kv_head * GROUP + r % GROUP_PAD: every head of the group at once.
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = q_tile * BLOCK_Q + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        row_valid = (token < q_len) & (head_in_group < GROUP)
        head = kv_head * GROUP + head_in_group
        causal_limit = ctx_start + token
        dims = tl.arange(0, HEAD_DIM)

        q_offsets = (
            (q_start + token).to(tl.int64)[:, None] * stride_query_t
            + head[:, None] * stride_query_h
            + dims[None, :]
        )
        q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None], other=0.0)
        # tl.dot wants both operands in one type; the cache's is the one
        # worth keeping (it is the bigger operand and the tensor-core type).
        # An fp8 cache's K/V are widened to bfloat16 as they load.
        if FP8:  # noqa: SIM108 (a constexpr branch; Triton compiles one side)
            q = q.to(tl.bfloat16)
        else:
            q = q.to(k_cache_ptr.dtype.element_ty)

        # The tile's KV range is [kv_base, kv_end): its last real token sees
        # the most context, and kv_base is 0 or, under a window, the block of
        # the tile's first token's first in-window key.
        kv_end = ctx_start + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
        kv_base = 0
        if WINDOWED:
            first_key = tl.maximum(ctx_start + q_tile * BLOCK_Q - window + 1, 0)
            kv_base = first_key - first_key % BLOCK_SIZE
        if SPLIT:
            # This split owns [kv_lo, kv_hi): this tile's own range divided
            # evenly (whole BLOCK_N steps, so only the last step is ragged),
            # whatever the batch's max_seq_len. A split past a short range
            # runs no step and stores max -inf / sum 0, which merges as weight 0.
            split_len = tl.cdiv(tl.cdiv(kv_end - kv_base, num_splits), BLOCK_N) * BLOCK_N
            kv_lo = kv_base + split * split_len
            kv_hi = tl.minimum(kv_end, kv_lo + split_len)
        else:
            kv_lo = kv_base
            kv_hi = kv_end

        row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        block_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
        for start in range(kv_lo, kv_hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_valid = pos < kv_hi
            # Masked, so block-table entries past the sequence are never read
            # and cache slots past it (possibly uninitialised) load as zero.
            block = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_valid, other=0)
            kv_offsets = (
                block.to(tl.int64) * stride_cache_block
                + (pos % BLOCK_SIZE) * stride_cache_slot
                + kv_head * stride_cache_head
            )
            kv_ptrs = kv_offsets[:, None] + dims[None, :]
            k = tl.load(k_cache_ptr + kv_ptrs, mask=pos_valid[:, None], other=0.0)
            if FP8:
                k = k.to(tl.bfloat16)
            scores = _dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION) * qk_scale
            visible = (pos[None, :] <= causal_limit[:, None]) & pos_valid[None, :]
            if WINDOWED:
                visible = visible & (pos[None, :] > causal_limit[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))

            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # A row that has seen nothing yet (only possible inside a later
            # split) keeps max -inf; pin it to 0 so the rescale is exp2(-inf) = 0,
            # not exp2(nan).
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(row_max - safe_max)
            probs = tl.exp2(scores - safe_max[:, None])
            row_sum = row_sum * rescale + tl.sum(probs, 1)
            v = tl.load(v_cache_ptr + kv_ptrs, mask=pos_valid[:, None], other=0.0)
            if FP8:
                v = v.to(tl.bfloat16)
            acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
            row_max = new_max

        token_row = (q_start + token).to(tl.int64)
        if SPLIT:
            # Unnormalised partials; _merge_splits_kernel rescales and sums them.
            split_row = split.to(tl.int64)
            out_offsets = (
                split_row * stride_out_split
                + token_row[:, None] * stride_out_t
                + head[:, None] * stride_out_h
                + dims[None, :]
            )
            tl.store(out_ptr + out_offsets, acc, mask=row_valid[:, None])
            stats = split_row * stride_stats_split + token_row * stride_stats_t + head
            tl.store(partial_max_ptr + stats, row_max, mask=row_valid)
            tl.store(partial_sum_ptr + stats, row_sum, mask=row_valid)
        else:
            out_offsets = (
                token_row[:, None] * stride_out_t + head[:, None] * stride_out_h + dims[None, :]
            )
            # Padding rows have a zero sum; keep them finite (they are not stored).
            out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
            tl.store(
                out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None]
            )


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    num_splits,
    stride_partial_split,
    stride_partial_t,
    stride_partial_h,
    stride_stats_split,
    stride_stats_t,
    stride_out_t,
    stride_out_h,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)

    stats = splits * stride_stats_split + token * stride_stats_t + head
    split_max = tl.load(partial_max_ptr + stats, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + stats, mask=split_valid, other=0.0)
    # Some split holds the token's own position, so the overall max is
    # finite and empty splits (max -inf) get weight exp2(-inf) = 0.
    weight = tl.exp2(split_max - tl.max(split_max, 0))
    total = tl.sum(split_sum * weight, 0)
    partial = tl.load(
        partial_out_ptr
        + splits[:, None] * stride_partial_split
        + token * stride_partial_t
        + head * stride_partial_h
        + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_out_t + head * stride_out_h + dims,
        out.to(out_ptr.dtype.element_ty),
    )


# Whether the kernels above were wrapped for Triton's CPU interpreter (decided
# by TRITON_INTERPRET when they were decorated, i.e. now).
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows `[num_tokens, num_kv_heads, head_dim]` into the paged
    cache `[2, num_blocks, block_size, num_kv_heads, head_dim]` at their slots
    (a negative slot is skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache_dtype(kv_cache)
    _check_head_dim(head_dim)
    _check_last_dim_contiguous(key=key, value=value, kv_cache=kv_cache)
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=_next_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        FP8=is_fp8_cache(kv_cache),
        INTERPRETED=_INTERPRETED,
    )


@dataclass(frozen=True, slots=True)
class _TileConfig:
    block_q: int  # new tokens per program (times GROUP_PAD heads = tile rows)
    block_n: int  # KV positions per inner-loop step
    num_warps: int
    num_stages: int


@functools.cache
def _tile_config(
    max_query_len: int, group_pad: int, head_dim: int, exact_fp32: bool
) -> _TileConfig:
    """Tile shapes that ptxas fits in sm_90 registers without spilling
    (checked offline, by compiling every dtype x group x head_dim combination).

    fp32 caches use exact (non-tensor-core) products, which need smaller
    tiles and more warps to stay in registers.
    """
    # tl.dot needs at least 16 rows: decode tiles are padded up to that.
    min_block_q = max(1, _MIN_DOT // group_pad)
    if max_query_len == 1:
        block_q = min_block_q
    else:
        # A fixed row budget for prefill, but no more tokens than the longest
        # query actually has.
        target_rows = max(_MIN_DOT, 2048 // head_dim) if exact_fp32 else 64
        block_q = max(1, target_rows // group_pad)
        block_q = max(min_block_q, min(block_q, _next_pow2(max_query_len)))
    rows = block_q * group_pad
    if exact_fp32:
        block_n = 32
        num_warps = 4 if rows * head_dim <= 16 * 64 else 8
    else:
        block_n = 64 if head_dim <= 128 else 32
        num_warps = 8 if rows * head_dim >= 128 * 128 else 4
    return _TileConfig(block_q=block_q, block_n=block_n, num_warps=num_warps, num_stages=2)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _choose_splits(
    device: torch.device, num_seqs: int, num_kv_heads: int, q_tiles: int, kv_span: int, block_n: int
) -> int:
    """Split the KV range when the grid is too small to fill the GPU and the
    ranges (`kv_span` positions at most) are long enough for the merge to
    pay off.

    A pure function of the batch's shape (sequences, KV heads, query tiles,
    and `kv_span`, itself from `max_seq_len` and the window), never of
    per-sequence lengths on the device: a CUDA graph captured for a shape
    and replayed for another batch of that shape launches the same count.
    """
    if device.type != "cuda":
        return 1
    sm_count = _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    wanted = _cdiv(2 * sm_count, num_seqs * num_kv_heads * q_tiles)
    worthwhile = kv_span // max(_MIN_SPLIT_LEN, block_n)
    return max(1, min(wanted, worthwhile, _MAX_SPLITS))


def _kv_span(meta: AttentionMetadata, window: int | None, block_q: int, block_size: int) -> int:
    """The most KV positions one program's range covers: a context, or under
    a window the tile's first token's window (from its block's start) up to
    the tile's last token."""
    longest = max(meta.max_seq_len, 1)
    if window is None:
        return longest
    return min(longest, window + block_q + block_size)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of `query` `[num_tokens, num_heads, head_dim]` over each
    sequence's cached context (its last `sliding_window` positions per token
    when given); returns `[num_tokens, num_heads, head_dim]`.

    `num_kv_splits` forces the number of KV-range splits (tests and
    benchmarks); by default it is chosen from the batch shape on CUDA and is 1
    elsewhere.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    _check_cache_dtype(kv_cache)
    _check_head_dim(head_dim)
    _check_last_dim_contiguous(query=query, kv_cache=kv_cache)
    check_sliding_window(sliding_window)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    exact_fp32 = kv_cache.dtype == torch.float32
    cfg = _tile_config(meta.max_query_len, group_pad, head_dim, exact_fp32)
    q_tiles = _cdiv(meta.max_query_len, cfg.block_q)
    # A window no context outgrows hides nothing: the unwindowed kernel.
    window = (
        None if sliding_window is None or sliding_window >= meta.max_seq_len else sliding_window
    )
    kv_span = _kv_span(meta, window, cfg.block_q, block_size)
    splits = num_kv_splits or _choose_splits(
        query.device, meta.num_seqs, num_kv_heads, q_tiles, kv_span, cfg.block_n
    )
    # The kernel divides each tile's own KV range among the splits; no range
    # is longer than kv_span, so splits beyond one BLOCK_N step of it would
    # always be empty.
    splits = max(1, min(splits, _cdiv(kv_span, cfg.block_n)))

    if splits > 1:
        target = query.new_empty((splits, num_tokens, num_heads, head_dim), dtype=torch.float32)
        stats = query.new_empty((2, splits, num_tokens, num_heads), dtype=torch.float32)
        partial_max, partial_sum = stats[0], stats[1]
        stride_out = (target.stride(0), target.stride(1), target.stride(2))
        stride_stats = (partial_max.stride(0), partial_max.stride(1))
    else:
        target, partial_max, partial_sum = out, out, out  # stats pointers unused
        stride_out = (0, out.stride(0), out.stride(1))
        stride_stats = (0, 0)

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (meta.num_seqs, num_kv_heads, q_tiles * splits)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        target,
        partial_max,
        partial_sum,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        scale * _LOG2E,
        splits,
        window or 0,
        query.stride(0),
        query.stride(1),
        *stride_out,
        *stride_stats,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SPLIT=splits > 1,
        WINDOWED=window is not None,
        # fp32 caches get exact products; tf32 would cost ~1e-3 relative error.
        DOT_PRECISION="ieee" if exact_fp32 else "tf32",
        FP8=is_fp8_cache(kv_cache),
        UPCAST_DOT=_INTERPRETED,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            target,
            partial_max,
            partial_sum,
            out,
            splits,
            target.stride(0),
            target.stride(1),
            target.stride(2),
            partial_max.stride(0),
            partial_max.stride(1),
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=_next_pow2(splits),
            HEAD_DIM=head_dim,
        )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_head_dim(head_dim: int) -> None:
    # tl.arange needs a power of two and tl.dot at least 16.
    if head_dim < _MIN_DOT or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.float8_e4m3fn


def _check_cache_dtype(kv_cache: torch.Tensor) -> None:
    if kv_cache.dtype == torch.int8:
        raise ValueError(
            "the Triton backend has no int8 KV cache (kv_cache_dtype='int8' is the CPU's "
            "torch backend's); use kv_cache_dtype fp8_e4m3, float32, bfloat16 or float16 "
            "with Triton"
        )


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels address head_dim elements with unit stride.
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
