"""Fast pure-torch paged attention: the default backend off GPU.

Same signatures as `kernels.reference`, built from a handful of vectorised
ops per call because it runs for every layer of every step:

* decodes (one new token each) are handled all at once: every sequence's
  blocks are gathered with one `index_select` into a padded
  `[num_seqs, max_len, num_kv_heads, head_dim]` K and V, and a single
  `scaled_dot_product_attention` call masks each sequence to its own length.
  Query heads are viewed as `[num_kv_heads, group]` rows of one KV head, so
  GQA needs no repeated K/V. For float32 queries over float32 or bfloat16
  caches the compiled kernel of `kernels.cpu_kernels` replaces both when it
  builds: it reads each K/V row
  once, in place, instead of gathering first.
* prefill chunks (few per step, many tokens each) go one sequence at a time,
  each over exactly its own context with a causal mask shifted by its cached
  prefix. Where the compiled kernel applies (float32 queries, a float32 or
  bfloat16 cache, AVX-512), all of a batch's chunks go to it in one call
  instead: it reads K/V in place and skips the keys a causal mask hides.
  Both compiled kernels also read an int8 cache (below).

Sliding window (`sliding_window=w`, semantics in `kernels.reference`): a
windowed decode gathers (or the compiled kernel walks) only the blocks from
the first in-window one, block `(p - w + 1) // block_size` for the token at
position p, and a windowed prefill chunk is cut into tiles of query rows,
each over the blocks from its first row's first in-window block: reading KV
that the mask then hides is wasted bandwidth, and a 4k context under a 512
window reads ~512 tokens' K/V per decode instead of 4k. A window at least as
long as every context is no window at all (the unwindowed path, bit for bit).

An int8 cache (`kernels.kv_int8`: int8 rows with their float32 scales) is
written quantized (the compiled writer, else the reference quantizer) and
read in place by the compiled decode and prefill kernels. Elsewhere the
gathers above take its int8 rows, and only those gathered rows are
dequantized, to float32, before SDPA: never a dequantized copy of the cache.

Everything derived from the batch layout alone (gather indices, masks, host
copies of the offsets) is a `_Plan`, built on the first call with a given
`AttentionMetadata` object and reused by the other layers of that forward
pass: at small batches those small ops cost as much as the attention. A
plan is rebuilt when the metadata object changes, so a runner must pass a
new `AttentionMetadata` each forward pass (never edit one in place).

Requirement: the padded gather reads whole blocks, so slots past a
sequence's length are multiplied by an exactly-zero attention weight, and
`0 * nan` is nan. Cache slots that were never written must therefore hold
finite values: allocate the cache with `torch.zeros`, not `torch.empty`.
(Block-table entries past a sequence's last block may hold anything.)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import cpu_kernels, kv_int8, kv_layout
from kernels.metadata import AttentionMetadata
from kernels.reference import check_sliding_window

# Caches the compiled kernels of this module and the compiled decode stack
# (engine/models/llama.py) read and write (queries and keys float32): an
# int8 cache's rows are quantized by its own writer (kv_int8.cpp).
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# Query rows per SDPA call of a windowed prefill chunk (at least; a tile is
# as tall as the window when that is longer). A tile reads its rows' window
# plus itself, so short tiles read less, but each call costs ~tens of us.
_WINDOW_TILE_ROWS = 256


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows `[num_tokens, num_kv_heads, head_dim]` into the paged
    cache `[2, num_blocks, block_size, num_kv_heads, head_dim]` at their slots
    (quantized rows `[..., head_dim + 4]` for an int8 cache)."""
    kernel = _compiled_cache_write(key, value, kv_cache)
    if kernel is not None:
        write = kernel.cache_kv_int8 if kv_int8.is_int8_cache(kv_cache) else kernel.cache_kv
        write(kv_cache, key, value, slot_mapping)
        return
    if not kv_cache.is_contiguous():  # head-major (kernels/kv_layout.py): index by slot
        block_size = kv_cache.shape[2]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[0, blocks, offsets] = kv_int8.cache_rows(key, kv_cache)
        kv_cache[1, blocks, offsets] = kv_int8.cache_rows(value, kv_cache)
        return
    # One row per slot: blocks and offsets flatten into a single slot index.
    slots = kv_cache.view(2, -1, key.shape[1], kv_cache.shape[-1])
    slots[0].index_copy_(0, slot_mapping, kv_int8.cache_rows(key, kv_cache))
    slots[1].index_copy_(0, slot_mapping, kv_int8.cache_rows(value, kv_cache))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of `query` `[num_tokens, num_heads, head_dim]` over each
    sequence's cached context (its last `sliding_window` positions per token
    when given); returns `[num_tokens, num_heads, head_dim]`."""
    check_sliding_window(sliding_window)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    plan = _PLANS.get(meta, kv_cache, query, _effective_window(sliding_window, meta))
    if plan.decode is not None and plan.decode_rows is None:
        return _decode(query, kv_cache, plan.decode, scale)
    out = torch.empty_like(query)
    if plan.decode is not None and plan.decode_rows is not None:
        decoded = _decode(query.index_select(0, plan.decode_rows), kv_cache, plan.decode, scale)
        out.index_copy_(0, plan.decode_rows, decoded)
    if plan.compiled_prefills is not None:
        _prefill_compiled(out, query, kv_cache, plan.compiled_prefills, scale, plan.window)
    for prefill in plan.prefills:
        lo, hi = prefill.rows
        out[lo:hi] = _prefill(query[lo:hi], kv_cache, prefill, scale)
    return out


def _effective_window(sliding_window: int | None, meta: AttentionMetadata) -> int | None:
    """None when the window hides nothing: no context is longer than it."""
    if sliding_window is None or sliding_window >= meta.max_seq_len:
        return None
    return sliding_window


# --- per-batch plans -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    # Rows of the cache viewed as [2 * num_blocks, block_size * heads * dim]:
    # each decode's blocks for K, then the same blocks (offset by num_blocks) for V.
    gather_rows: torch.Tensor
    # [num_decodes, 1, 1, padded_len] additive mask (0 or -inf) in the cache
    # dtype: SDPA would otherwise convert a boolean mask on every call.
    mask: torch.Tensor
    num_seqs: int
    padded_len: int
    # The decodes' own block-table rows and lengths, for the compiled kernel.
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    window: int | None


@dataclass(frozen=True, slots=True)
class _PrefillPlan:
    rows: tuple[int, int]  # query rows (a sequence's chunk, or a tile of it)
    gather_rows: torch.Tensor  # as _DecodePlan's, for the blocks the rows see
    kv_len: int  # gathered positions used (from the first gathered block on)
    # [rows, kv_len] boolean "may attend"; None when there is no cached
    # prefix and plain is_causal is right.
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _CompiledPrefills:
    """Every prefill chunk of a batch, for the compiled kernel (one call)."""

    block_table: torch.Tensor  # int32 [P, max_blocks]
    seq_lens: torch.Tensor  # int32 [P]: context incl. the chunk
    query_starts: torch.Tensor  # int32 [P]: each chunk's first query row
    query_lens: torch.Tensor  # int32 [P]


@dataclass(frozen=True, slots=True)
class _Plan:
    decode: _DecodePlan | None
    # Token rows of the decodes; None when the whole batch is decodes.
    decode_rows: torch.Tensor | None
    # The prefill chunks one way or the other: the compiled kernel's one
    # call, or one torch call each.
    compiled_prefills: _CompiledPrefills | None
    prefills: tuple[_PrefillPlan, ...]
    window: int | None


class _PlanCache:
    """Holds the plans for the last batch seen (one forward pass's metadata is
    shared by every layer), one per sliding window: models that interleave
    local and global layers (Gemma 3) would otherwise rebuild every layer.
    Keeps that metadata alive so its id is not reused."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._key: tuple[object, ...] = ()
        self._plans: dict[int | None, _Plan] = {}

    def get(
        self,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        query: torch.Tensor,
        window: int | None,
    ) -> _Plan:
        # Identity, not contents: AttentionMetadata is frozen and the runner
        # builds a new one per forward pass (inference tensors carry no
        # version counter to detect in-place edits with).
        key = (kv_cache.shape[1:], kv_cache.dtype, kv_cache.device, query.shape[1:], query.dtype)
        if self._meta is not meta or self._key != key:
            self._plans.clear()
            self._meta, self._key = meta, key
        plan = self._plans.get(window)
        if plan is None:
            compiled = _compiled_prefill(query, kv_cache)
            plan = self._plans[window] = _make_plan(meta, kv_cache, compiled, window)
        return plan


_PLANS = _PlanCache()


def _make_plan(
    meta: AttentionMetadata,
    kv_cache: torch.Tensor,
    compiled_prefill: bool = False,
    window: int | None = None,
) -> _Plan:
    if meta.decode_only:
        return _Plan(_all_decodes_plan(meta, kv_cache, window), None, None, (), window)
    # Host copies of the layout: cheap on CPU, where this backend runs.
    starts: list[int] = meta.query_start_loc.tolist()
    seq_lens: list[int] = meta.seq_lens.tolist()
    decodes, chunks = _split_rows(meta, starts, seq_lens)
    if len(decodes) == len(seq_lens) and all(d.row == starts[d.seq] for d in decodes):
        return _Plan(_all_decodes_plan(meta, kv_cache, window), None, None, (), window)

    decode: _DecodePlan | None = None
    decode_rows: torch.Tensor | None = None
    if decodes:
        device = kv_cache.device
        seqs = torch.tensor([d.seq for d in decodes], dtype=torch.int64, device=device)
        decode = _decode_plan(
            meta.block_table.index_select(0, seqs),
            torch.tensor([d.seq_len for d in decodes], dtype=torch.int32, device=device),
            max(d.seq_len for d in decodes),
            kv_cache,
            window,
        )
        decode_rows = torch.tensor([d.row for d in decodes], dtype=torch.int64, device=device)
    if not chunks:
        return _Plan(decode, decode_rows, None, (), window)
    if compiled_prefill:
        return _Plan(decode, decode_rows, _compiled_prefills(meta, chunks), (), window)
    prefills = tuple(
        plan
        for c in chunks
        for plan in _prefill_plans(
            (c.start, c.end), meta.block_table[c.seq], c.seq_len, kv_cache, window
        )
    )
    return _Plan(decode, decode_rows, None, prefills, window)


@dataclass(frozen=True, slots=True)
class _DecodeRow:
    row: int  # the query row
    seq: int  # its sequence
    seq_len: int  # the context it sees, itself included


@dataclass(frozen=True, slots=True)
class _Chunk:
    seq: int
    start: int  # query rows start..end-1
    end: int
    seq_len: int  # the context its last row sees


def _split_rows(
    meta: AttentionMetadata, starts: list[int], seq_lens: list[int]
) -> tuple[list[_DecodeRow], list[_Chunk]]:
    """Each sequence's query rows as a prefill chunk (its prompt rows) and
    decode rows (its output rows), per ``meta.prompt_rows``; where that is
    not given, a one-row sequence is a decode and a longer one a chunk. An
    output row after prompt rows sees the context up to itself: every row's
    K/V is in the cache before attention reads it."""
    decodes: list[_DecodeRow] = []
    chunks: list[_Chunk] = []
    for i, seq_len in enumerate(seq_lens):
        lo, hi = starts[i], starts[i + 1]
        by_length = 0 if hi - lo == 1 else hi - lo
        prompt = meta.prompt_rows[i] if meta.prompt_rows else by_length
        if prompt:
            chunks.append(_Chunk(i, lo, lo + prompt, seq_len - (hi - lo - prompt)))
        decodes.extend(_DecodeRow(r, i, seq_len - (hi - 1 - r)) for r in range(lo + prompt, hi))
    return decodes, chunks


def _compiled_prefills(meta: AttentionMetadata, chunks: list[_Chunk]) -> _CompiledPrefills:
    seqs = torch.tensor([c.seq for c in chunks], dtype=torch.int64, device=meta.seq_lens.device)
    return _CompiledPrefills(
        meta.block_table.index_select(0, seqs).to(torch.int32),
        torch.tensor([c.seq_len for c in chunks], dtype=torch.int32),
        torch.tensor([c.start for c in chunks], dtype=torch.int32),
        torch.tensor([c.end - c.start for c in chunks], dtype=torch.int32),
    )


def _all_decodes_plan(
    meta: AttentionMetadata, kv_cache: torch.Tensor, window: int | None
) -> _DecodePlan:
    return _decode_plan(meta.block_table, meta.seq_lens, meta.max_seq_len, kv_cache, window)


def _decode_plan(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_cache: torch.Tensor,
    window: int | None = None,
) -> _DecodePlan:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    num_cols = _decode_columns(max_seq_len, block_size, window)
    padded_len = num_cols * block_size
    if window is None:
        first_block = torch.zeros_like(seq_lens)
        columns = block_table[:, :num_cols]
    else:
        # Each sequence's gather starts at its first in-window block (the
        # token at p = len - 1 sees len - window .. p).
        first_block = (seq_lens - window).clamp(min=0) // block_size
        wanted = first_block[:, None].long() + torch.arange(num_cols, device=seq_lens.device)
        columns = block_table.gather(1, wanted.clamp(max=block_table.shape[1] - 1))
    # Entries past a sequence's last block are unspecified (maybe -1, maybe
    # stale); any real block will do since those positions are masked.
    blocks = columns.clamp(0, num_blocks - 1)
    gather_rows = torch.cat((blocks, blocks + num_blocks)).view(-1)
    mask = _decode_mask(first_block * block_size, seq_lens, padded_len, window, kv_cache)
    return _DecodePlan(
        gather_rows,
        mask[:, None, None, :],
        int(block_table.shape[0]),
        padded_len,
        block_table.to(torch.int32),
        seq_lens.to(torch.int32).contiguous(),
        window,
    )


def _decode_columns(max_seq_len: int, block_size: int, window: int | None) -> int:
    """Blocks gathered per decode: every block of the longest context, or
    under a window the most that `window` consecutive positions can touch."""
    whole = -(-max_seq_len // block_size)
    if window is None:
        return whole
    return min(whole, (window + block_size - 2) // block_size + 1)


def _decode_mask(
    gather_start: torch.Tensor,
    seq_lens: torch.Tensor,
    padded_len: int,
    window: int | None,
    kv_cache: torch.Tensor,
) -> torch.Tensor:
    """[num_decodes, padded_len] additive mask hiding the gathered slots past
    each context's end and, under a window, before its first visible key."""
    positions = torch.arange(padded_len, device=kv_cache.device) + gather_start[:, None]
    hidden = positions >= seq_lens[:, None]
    if window is not None:
        hidden |= positions < seq_lens[:, None] - window
    mask = torch.zeros(hidden.shape, dtype=_values_dtype(kv_cache), device=kv_cache.device)
    return mask.masked_fill_(hidden, float("-inf"))


def _prefill_plans(
    rows: tuple[int, int],
    block_row: torch.Tensor,
    seq_len: int,
    kv_cache: torch.Tensor,
    window: int | None,
) -> list[_PrefillPlan]:
    """One chunk's plans: the whole chunk over its whole context, or under a
    window tiles of query rows, each over the blocks its rows can see."""
    if window is None:
        return [_prefill_plan(rows, block_row, seq_len, kv_cache)]
    lo, hi = rows
    tile = max(window, _WINDOW_TILE_ROWS)
    return [
        _window_tile_plan((t, min(t + tile, hi)), seq_len - (hi - t), block_row, kv_cache, window)
        for t in range(lo, hi, tile)
    ]


def _prefill_plan(
    rows: tuple[int, int], block_row: torch.Tensor, seq_len: int, kv_cache: torch.Tensor
) -> _PrefillPlan:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    q_len = rows[1] - rows[0]
    blocks = block_row[: -(-seq_len // block_size)]
    mask = None
    if q_len != seq_len:
        # is_causal aligns the diagonal top-left; new token j sits at context
        # position seq_len - q_len + j, so the diagonal is shifted by the prefix.
        positions = torch.arange(seq_len, device=block_row.device)
        mask = positions <= positions[seq_len - q_len :, None]
    return _PrefillPlan(rows, torch.cat((blocks, blocks + num_blocks)), seq_len, mask)


def _window_tile_plan(
    rows: tuple[int, int],
    first_pos: int,
    block_row: torch.Tensor,
    kv_cache: torch.Tensor,
    window: int,
) -> _PrefillPlan:
    """Query rows `rows` at context positions `first_pos ..` under a window:
    the blocks from the first row's first in-window block to the last row's
    own block, with a banded mask."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    end = first_pos + rows[1] - rows[0]  # one past the last row's position
    first_block = max(0, first_pos - window + 1) // block_size
    blocks = block_row[first_block : -(-end // block_size)]
    device = block_row.device
    keys = torch.arange(first_block * block_size, end, device=device)
    queries = torch.arange(first_pos, end, device=device)[:, None]
    mask = (keys <= queries) & (keys > queries - window)
    gather_rows = torch.cat((blocks, blocks + num_blocks))
    return _PrefillPlan(rows, gather_rows, int(keys.shape[0]), mask)


# --- the attention itself ------------------------------------------------------


class _Workspace:
    """One reusable CPU buffer per dtype for gathered K/V (it only lives for
    one call). Fresh CPU tensors above glibc's mmap threshold (at most 32 MiB)
    are page-faulted in on every call, which measured 3-4x the copy itself
    (a 75 MiB gather: 65 ms fresh, 18 ms into a reused buffer). It keeps the
    largest size seen; GPU allocations are cached by torch already.
    Buffers made under inference mode cannot be written outside it, so each
    mode has its own."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, bool], torch.Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        numel = rows * cols
        key = (dtype, torch.is_inference_mode_enabled())
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # Some headroom so a slowly growing batch does not reallocate each step.
            size = numel if buffer is None else max(numel, buffer.numel() * 5 // 4)
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype)
        return buffer[:numel].view(rows, cols)


_WORKSPACE = _Workspace()


def _gather_blocks(kv_cache: torch.Tensor, gather_rows: torch.Tensor) -> torch.Tensor:
    """Rows of the cache's memory viewed as `[2 * num_blocks, block elements]`:
    K and V blocks in one dim-0 `index_select` (the contiguous row-copy path).
    `_token_rows` reads them back as tokens."""
    flat = kv_layout.in_memory_order(kv_cache).view(2 * kv_cache.shape[1], -1)
    if kv_cache.device.type != "cpu":
        return flat.index_select(0, gather_rows)
    out = _WORKSPACE.take(gather_rows.shape[0], flat.shape[1], flat.dtype)
    return torch.index_select(flat, 0, gather_rows, out=out)


def _token_rows(kv: torch.Tensor, kv_cache: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Gathered blocks (each sequence's in order) as `[2, num_seqs, tokens,
    heads, row]`: a view for a token-major cache, a copy for a head-major one
    (kernels/kv_layout.py)."""
    _, _, block_size, heads, row = kv_cache.shape
    if kv_cache.is_contiguous():
        return kv.view(2, num_seqs, -1, heads, row)
    blocks = kv.view(2, num_seqs, -1, heads, block_size, row).transpose(3, 4)
    return blocks.reshape(2, num_seqs, -1, heads, row)


def _decode(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float
) -> torch.Tensor:
    """One new token per sequence: the compiled kernel when it applies, else
    a padded gather and one masked SDPA call."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    kernel = _compiled_decode(query, kv_cache)
    if kernel is not None:
        out = torch.empty_like(query)
        kernel.decode_attention(
            out, query, kv_cache, plan.block_table, plan.seq_lens, scale, plan.window or 0
        )
        return out
    kv = _token_rows(_gather_blocks(kv_cache, plan.gather_rows), kv_cache, plan.num_seqs)
    # [seqs, kv_heads, group, dim]: a KV head's query heads become its rows.
    dtype = torch.promote_types(query.dtype, _values_dtype(kv_cache))
    kv = _as_values(kv, kv_cache, dtype)
    q = query.to(dtype).reshape(plan.num_seqs, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(
        q,
        kv[0].transpose(1, 2),
        kv[1].transpose(1, 2),
        attn_mask=_mask_as(plan.mask, dtype),
        scale=scale,
    )
    return out.reshape(plan.num_seqs, num_heads, head_dim).to(query.dtype)


def _values_dtype(kv_cache: torch.Tensor) -> torch.dtype:
    """The dtype of the cache's values once read: an int8 cache's dequantize
    to float32."""
    return torch.float32 if kv_int8.is_int8_cache(kv_cache) else kv_cache.dtype


def _as_values(kv: torch.Tensor, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as `dtype` values: int8 rows dequantized (only
    these rows, never the whole cache), others converted."""
    if kv_int8.is_int8_cache(kv_cache):
        return kv_int8.dequantize_rows(kv, dtype)
    return kv.to(dtype)


def _mask_as(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A plan's additive mask (built in the cache's dtype) in the dtype
    attention computes in: they differ when the cache is narrower than the
    model (--kv-cache-dtype). Boolean masks pass as they are."""
    if mask is None or mask.dtype in (dtype, torch.bool):
        return mask
    return mask.to(dtype)


def _compiled_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor
) -> ModuleType | None:
    """The compiled module when its cache write applies: float32 rows into a
    float32 or bfloat16 CPU cache, each token's heads adjacent in key and
    value (views of one qkv buffer), or into an int8 CPU cache (rows
    contiguous, any layout of them)."""
    if not (
        kv_cache.device.type == "cpu"
        and key.dtype == value.dtype == torch.float32
        and kv_cache.dtype in KERNEL_CACHE_DTYPES
        and (kv_cache.is_contiguous() or kv_int8.is_int8_cache(kv_cache))
        and kv_layout.is_kernel_layout(kv_cache)
        and key.stride(-1) == value.stride(-1) == 1
        and key.shape == value.shape
    ):
        return None
    adjacent_heads = key.stride(1) == key.shape[2] and key.stride() == value.stride()
    if not (adjacent_heads or kv_int8.is_int8_cache(kv_cache)):
        return None
    return cpu_kernels.load()


def _compiled_decode(query: torch.Tensor, kv_cache: torch.Tensor) -> ModuleType | None:
    if not (
        kv_cache.device.type == "cpu"
        and query.dtype == torch.float32
        and kv_cache.dtype in KERNEL_CACHE_DTYPES
        and kv_layout.is_kernel_layout(kv_cache)
        and query.stride(-1) == 1
        and query.shape[-1] in cpu_kernels.HEAD_DIMS
        and kv_int8.head_dim_of(kv_cache) == query.shape[-1]
    ):
        return None
    return cpu_kernels.load()


def _compiled_prefill(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the compiled kernel takes this model's prefill chunks: float32
    queries over a float32, bfloat16 or int8 CPU cache, at a head size, GQA group
    and block size it has code for (AVX-512 builds)."""
    if _compiled_decode(query, kv_cache) is None:
        return False
    kernel = cpu_kernels.load()
    group = query.shape[1] // kv_cache.shape[3]
    return kernel is not None and bool(
        kernel.prefill_attention_applies(query.shape[-1], group, kv_cache.shape[2])
    )


def _prefill_compiled(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: _CompiledPrefills,
    scale: float,
    window: int | None,
) -> None:
    kernel = cpu_kernels.load()
    assert kernel is not None  # the plan was made for it
    kernel.prefill_attention(
        out,
        query,
        kv_cache,
        plan.block_table,
        plan.seq_lens,
        plan.query_starts,
        plan.query_lens,
        scale,
        window or 0,  # the kernel's "no window"
    )


def _prefill(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: _PrefillPlan, scale: float
) -> torch.Tensor:
    """One sequence's chunk of new tokens (or a tile of it) over the context
    positions it can see."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    kv = _token_rows(_gather_blocks(kv_cache, plan.gather_rows), kv_cache, 1)[:, 0]
    kv = kv[:, : plan.kv_len]
    # 4-d [1, heads, len, dim]: 3-d inputs miss the CPU flash kernel and fall
    # back to materialising the whole score matrix. A cache narrower than the
    # model (--kv-cache-dtype) is widened: attention runs in the model's dtype
    # (float32 at least over an int8 cache).
    dtype = torch.promote_types(query.dtype, _values_dtype(kv_cache))
    kv = _as_values(kv, kv_cache, dtype)
    q = query.to(dtype).transpose(0, 1)[None]
    k, v = kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None]
    gqa = num_heads != num_kv_heads
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=_mask_as(plan.mask, dtype),
        is_causal=plan.mask is None,
        scale=scale,
        enable_gqa=gqa,
    )
    return out[0].transpose(0, 1).to(query.dtype)
