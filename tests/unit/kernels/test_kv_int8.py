"""The int8 KV cache (`kernels.kv_int8`): its writers against the reference
quantizer, bit for bit, and every attention path over it.

Bounds. Each path is compared with the reference attention over the
dequantized cache, i.e. over the very values `q * scale` the kernels read:
the only differences are float32 rounding in another order (the compiled
decode applies a key's scale to its dot product, not to each element), so
the float32 cache's tolerance applies (`_SAME_VALUES`). Where the compiled
decode takes integer scores (AVX-512 VNNI), its decode rows' reference
reads the query as the kernel does (`kv_int8.decode_query`). Against
attention over the unquantized K/V the bound follows from the format: an
element is off by at most half its row's scale, s/2 (plus float32
rounding); a score q.k * c then by at most eps = c * |q|_1 * max(s_k) / 2,
so every probability moves by a factor within [e^-2eps, e^2eps] and their
changes sum to at most e^2eps - 1; the output, a probability-weighted mean
of V rows each off by at most max(s_v) / 2, moves by at most
max(s_v) / 2 + (e^2eps - 1) * max|v| (`_format_bound`). A quantized query
(q * c off by at most s_q / 2 per element, s_q = max|q * c| / 127) adds
s_q / 2 * max|k|_1 to eps, with k the dequantized keys.

The same decode kernel sums V in integers: per group of 16 keys, each
weight w = p * s_v (p <= 1, the softmax's unnormalized probability) is
rounded to int16 against the group's largest, so it is off by at most
w_max / 65534. A group then moves the weighted sum of V's int8 values by at
most w_max / 65534 * 16 * 127, and since w_max <= max(s_v) * (the group's
sum of p), the groups together, divided by the sum of p, move an output
element by at most max(s_v) * 16 * 127 / 65534 (`_int16_weights_bound`),
which the decode rows' tolerance adds.

Caches are head-major in memory as the engine allocates int8 caches
(kernels/kv_layout.py); the writers and the compiled kernels are also run
over token-major ones, which they read through the same strides.

Where the CPU has AMX tiles, the compiled prefill runs on them over an
int8 cache as over a bfloat16 one (bfloat16 products): the int8 values are
exact in bfloat16 and the row scales apply in float32 (K's to the scores,
V's to the probabilities before they are rounded), so those rows'
reference reads the query rounded as the tiles round it, within the
bfloat16 probabilities' bound (`batches.over_bfloat16`).

The sliding-window cases poison the blocks a window hides: an int8 row
cannot hold NaN, but its scale can, and any read of such a row turns the
output to NaN.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

from engine.worker.kv_cache import KVCacheShape, allocate_kv_caches
from kernels import cpu_kernels, kv_int8, kv_layout, reference, torch_attention
from tests.unit.kernels.batches import SHAPES, PagedBatch, Shape, make_batch

_KERNEL = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(_KERNEL is None, reason="compiled CPU kernels unavailable")

# Same values, float32 rounding in another order (see the module docstring).
_SAME_VALUES = 1e-5

INT8_SHAPES = (
    *SHAPES,
    # Head dim 256 (Gemma 3): the compiled kernels' largest head.
    Shape((1, 20, 1), (50, 37, 90), 4, 2, 256, 16),
    # Head dim 32: no compiled kernel; the torch gathers and SDPA.
    Shape((20, 1, 1), (50, 33, 9), 4, 2, 32, 16),
)
WINDOWS = (None, 1, 5, 23)


def _label(shape: Shape) -> str:
    return shape.label


LAYOUTS = ("head-major", "token-major")


def in_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    return kv_layout.as_head_major(cache) if layout == "head-major" else cache.contiguous()


def int8_batch(
    shape: Shape, seed: int = 0, layout: str = "head-major"
) -> tuple[PagedBatch, torch.Tensor]:
    """The batch with its cache quantized (unused slots quantize to zero
    rows of scale 0) in `layout`, and the float32 cache it was quantized from."""
    batch = make_batch(shape, seed=seed)
    quantized = in_layout(kv_int8.quantize_rows(batch.kv_cache), layout)
    return dataclasses.replace(batch, kv_cache=quantized), batch.kv_cache


def quantizes_query(shape: Shape) -> bool:
    """Whether the compiled decode reads this shape's query as int8."""
    group = shape.num_heads // shape.num_kv_heads
    return _KERNEL is not None and bool(_KERNEL.decode_int8_quantizes_query(shape.head_dim, group))


def decode_rows(shape: Shape) -> list[int]:
    """The query rows of the sequences that decode one token."""
    starts = [sum(shape.q_lens[:i]) for i in range(len(shape.q_lens))]
    return [start for start, q_len in zip(starts, shape.q_lens, strict=True) if q_len == 1]


def _int16_weights_bound(batch: PagedBatch) -> float:
    """The module docstring's bound for the integer V sums."""
    return kv_int8.row_scales(batch.kv_cache)[1].max().item() * 16 * 127 / 65534


def tile_rows(batch: PagedBatch, shape: Shape) -> list[int]:
    """The query rows of the prefill chunks that the compiled prefill runs
    on AMX tiles (bfloat16 products: the query and the probabilities
    rounded, the int8 values exact); none where the CPU has no tiles."""
    if _KERNEL is None or not _KERNEL.prefill_attention_on_tiles(shape.head_dim, batch.kv_cache):
        return []
    if not torch_attention._compiled_prefill(batch.query, batch.kv_cache):
        return []
    decodes = set(decode_rows(shape))
    return [r for r in range(batch.query.shape[0]) if r not in decodes]


def row_tolerance(batch: PagedBatch, shape: Shape, compiled: bool) -> torch.Tensor:
    """Per query row: `_SAME_VALUES`, plus the integer V sums' bound on the
    rows the compiled decode kernel takes with integer arithmetic, and on
    the rows prefilled on AMX tiles the bfloat16 probabilities' bound
    (`batches.over_bfloat16`)."""
    tol = torch.full((batch.query.shape[0], 1, 1), _SAME_VALUES)
    if compiled and quantizes_query(shape):
        tol[decode_rows(shape)] += _int16_weights_bound(batch)
    if compiled:
        v_max = kv_int8.dequantize_cache(batch.kv_cache)[1].abs().max().item()
        tol[tile_rows(batch, shape)] += 2**-8 * v_max
    return tol


def as_decode_reads(batch: PagedBatch, shape: Shape, scale: float) -> PagedBatch:
    """The batch with its decode rows' queries as the compiled kernel reads
    them over an int8 cache (unchanged where it reads floats)."""
    if not quantizes_query(shape):
        return batch
    query = batch.query.clone()
    rows = decode_rows(shape)
    query[rows] = kv_int8.decode_query(query[rows], scale)
    return dataclasses.replace(batch, query=query)


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch path as it runs without the compiled module (fresh batches
    only: a plan made for one metadata object is reused)."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    yield


# --- the format ------------------------------------------------------------------


def test_rows_hold_values_then_their_float32_scale() -> None:
    x = torch.tensor([[127.0, -3.0, 0.25, 64.0], [0.0, 0.0, 0.0, 0.0]])
    rows = kv_int8.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, kv_int8.int8_row_bytes(4))
    assert rows[0, :4].tolist() == [127, -3, 0, 64]
    assert kv_int8.row_scales(rows).flatten().tolist() == [1.0, 0.0]  # 127 * fl(1/127) == 1
    assert rows[0, 4:].contiguous().view(torch.float32).item() == 1.0  # little-endian bytes
    assert torch.equal(kv_int8.dequantize_rows(rows), torch.tensor([[127.0, -3, 0, 64], [0] * 4]))


def test_rounding_is_half_to_even() -> None:
    """Halves land exactly on .5 when the scale is 1 (max 127) or 0.5 (max 63.5)."""
    x = torch.tensor([[127.0, 2.5, 0.5, -1.5, 3.5, -2.5], [63.5, 1.25, 0.25, -0.75, 0, 0]])
    rows = kv_int8.quantize_rows(x)
    assert rows[:, :6].tolist() == [[127, 2, 0, -2, 4, -2], [127, 2, 0, -2, 0, 0]]


def test_dequantized_values_are_within_half_a_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, 64, generator=gen) * torch.randn(300, 4, 1, generator=gen).exp()
    rows = kv_int8.quantize_rows(x)
    scales = kv_int8.row_scales(rows)
    assert torch.equal(scales, x.abs().amax(-1, keepdim=True) * (1 / torch.tensor(127.0)))
    error = (kv_int8.dequantize_rows(rows) - x).abs()
    assert (error <= scales * (0.5 + 2**-16)).all()
    assert rows[..., :64].abs().max().item() == 127


def test_head_dim_is_recovered_from_the_cache() -> None:
    assert kv_int8.head_dim_of(torch.zeros(2, 3, 16, 2, 68, dtype=torch.int8)) == 64
    assert kv_int8.head_dim_of(torch.zeros(2, 3, 16, 2, 64)) == 64
    with pytest.raises(ValueError, match="int8"):
        kv_int8.dequantize_cache(torch.zeros(2, 1, 1, 1, 8))


# --- writing ---------------------------------------------------------------------


def _ragged_write(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv buffer's K and V views, slots, an empty int8 cache): 37 tokens
    into 6 blocks of 16, partly filled, out of order, rows of magnitudes
    spread over orders of magnitude, one all zero."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, tokens = 4, 2, 64, 37
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)
    qkv *= (2 * torch.randn(tokens, heads + 2 * kv_heads, 1, generator=gen)).exp()
    qkv[5, heads] = 0.0
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.randperm(6 * 16, generator=gen)[:tokens]
    shape = (2, 6, 16, kv_heads, kv_int8.int8_row_bytes(dim))
    return key, value, slots, kv_layout.new_cache(shape, torch.int8, "cpu")


def _written_by_reference(
    key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor
) -> torch.Tensor:
    want = torch.zeros_like(cache)
    reference.reshape_and_cache(key, value, want, slots)
    return want


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_writer_matches_the_reference_bit_for_bit(layout: str) -> None:
    key, value, slots, cache = _ragged_write(seed=1)
    cache = in_layout(cache, layout)
    assert torch_attention._compiled_cache_write(key, value, cache) is not None
    torch_attention.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, _written_by_reference(key, value, slots, cache))


@needs_kernel
def test_compiled_writer_rounds_halves_to_even() -> None:
    row = torch.tensor([127.0, 2.5, 0.5, -1.5, 3.5, -2.5] + [0.0] * 58)
    key = row.expand(1, 1, 64).contiguous()
    cache = torch.zeros(2, 1, 16, 1, 68, dtype=torch.int8)
    torch_attention.reshape_and_cache(key, key, cache, torch.tensor([3]))
    assert cache[0, 0, 3, 0, :6].tolist() == [127, 2, 0, -2, 4, -2]


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_fallback_writer_matches_the_reference_bit_for_bit(layout: str) -> None:
    key, value, slots, cache = _ragged_write(seed=2)
    cache = in_layout(cache, layout)
    torch_attention.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, _written_by_reference(key, value, slots, cache))


def test_write_then_read_round_trip() -> None:
    """Each written slot reads back within half its row's scale; every
    other slot stays zero."""
    key, value, slots, cache = _ragged_write(seed=3)
    torch_attention.reshape_and_cache(key, value, cache, slots)
    values = kv_int8.dequantize_cache(cache).reshape(2, -1, *key.shape[1:])
    scales = kv_int8.row_scales(cache).reshape(2, -1, key.shape[1], 1)
    for half, rows in enumerate((key, value)):
        error = (values[half, slots] - rows).abs()
        assert (error <= scales[half, slots] * (0.5 + 2**-16)).all()
    untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert not cache.reshape(2, -1, *cache.shape[3:])[:, untouched].any()


# --- reading ---------------------------------------------------------------------


def _check_paths(
    batch: PagedBatch,
    window: int | None,
    reads: PagedBatch,
    tol: torch.Tensor,
    tiles: list[int] | None = None,
) -> None:
    """``reads``: the batch as the path under test reads its queries; `tol`
    per query row; `tiles`: the rows prefilled on AMX tiles, whose
    reference reads the scaled query rounded to bfloat16, as the tiles do."""
    scale = batch.query.shape[-1] ** -0.5
    dequantized = kv_int8.dequantize_cache(batch.kv_cache)
    want = reference.paged_attention(reads.query, dequantized, batch.meta, scale, window)
    ref = reference.paged_attention(reads.query, batch.kv_cache, batch.meta, scale, window)
    assert torch.equal(ref, want)
    if tiles:
        rounded = (reads.query * scale).to(torch.bfloat16).float()
        on_tiles = reference.paged_attention(rounded, dequantized, batch.meta, 1.0, window)
        want[tiles] = on_tiles[tiles]
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, window)
    assert got.dtype == torch.float32 and got.isfinite().all()
    error = (got - want).abs()
    assert (error <= tol).all(), (window, (error - tol).max().item())


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=_label)
def test_compiled_kernels_over_an_int8_cache(shape: Shape, layout: str) -> None:
    for window in WINDOWS:
        batch, _ = int8_batch(shape, seed=5, layout=layout)
        kernel = torch_attention._compiled_decode(batch.query, batch.kv_cache)
        assert (kernel is not None) == (shape.head_dim in cpu_kernels.HEAD_DIMS)
        reads = as_decode_reads(batch, shape, shape.head_dim**-0.5)
        tol = row_tolerance(batch, shape, compiled=True)
        _check_paths(batch, window, reads, tol, tile_rows(batch, shape))


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("shape", INT8_SHAPES, ids=_label)
def test_torch_fallback_over_an_int8_cache(shape: Shape) -> None:
    for window in WINDOWS:
        batch, _ = int8_batch(shape, seed=6)
        _check_paths(batch, window, batch, row_tolerance(batch, shape, compiled=False))


@needs_kernel
def test_compiled_prefill_takes_an_int8_cache() -> None:
    batch, _ = int8_batch(SHAPES[3])
    assert torch_attention._compiled_prefill(batch.query, batch.kv_cache)


def _format_bound(
    batch: PagedBatch, float_cache: torch.Tensor, scale: float, integer_decode: bool
) -> float:
    """The module docstring's bound, with maxima over the whole cache
    (`integer_decode`: with the compiled decode's quantized query and
    integer V sums)."""
    scales = kv_int8.row_scales(batch.kv_cache)
    eps = scale * batch.query.abs().sum(-1).max().item() * scales[0].max().item() / 2
    bound = 1e-5
    if integer_decode:
        bound += _int16_weights_bound(batch)
        s_q = (batch.query * scale).abs().amax().item() / 127
        k_l1 = kv_int8.dequantize_cache(batch.kv_cache)[0].abs().sum(-1).max().item()
        eps += s_q / 2 * k_l1
    v_max = float_cache[1].abs().max().item()
    return scales[1].max().item() / 2 + math.expm1(2 * eps) * v_max + bound


@pytest.mark.parametrize("shape", SHAPES[:4], ids=_label)
def test_attention_over_int8_is_within_the_format_bound(shape: Shape) -> None:
    batch, float_cache = int8_batch(shape, seed=7)
    scale = shape.head_dim**-0.5
    exact = reference.paged_attention(batch.query, float_cache, batch.meta, scale)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    error = (got - exact).abs().max().item()
    assert error <= _format_bound(batch, float_cache, scale, quantizes_query(shape))
    # Far inside it in practice: the rounding errors mostly cancel.
    assert error <= 0.05 * exact.abs().max().item()


# --- sliding windows: the blocks before a window are never read -----------------


def _spare_padded(batch: PagedBatch) -> PagedBatch:
    """Block-table padding pointed at a block no sequence owns: the torch
    gathers read padding columns (masked), which must stay finite."""
    bs = batch.kv_cache.shape[2]
    owned = {
        int(block)
        for i, seq_len in enumerate(batch.meta.seq_lens.tolist())
        for block in batch.meta.block_table[i, : -(-seq_len // bs)]
    }
    spare = min(set(range(batch.kv_cache.shape[1])) - owned)
    table = batch.meta.block_table.masked_fill(batch.meta.block_table < 0, spare)
    return dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, block_table=table))


def _poison_unread_blocks(batch: PagedBatch, window: int) -> bool:
    """NaN scales in each sequence's blocks wholly before its first new
    token's first in-window block; whether any block was poisoned."""
    bs, dim = batch.kv_cache.shape[2], kv_int8.head_dim_of(batch.kv_cache)
    nan_bytes = torch.tensor([float("nan")]).view(torch.int8)  # [4]
    starts = batch.meta.query_start_loc.tolist()
    poisoned = False
    for i, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        first_pos = seq_len - (starts[i + 1] - starts[i])
        blocks = batch.meta.block_table[i, : max(0, first_pos - window + 1) // bs].long()
        batch.kv_cache[:, blocks, :, :, dim:] = nan_bytes
        poisoned |= blocks.numel() > 0
    return poisoned


POISON_CASES = (
    (Shape((1, 1, 1, 1), (1, 40, 77, 130), 6, 2, 64, 16), 5),
    (Shape((30, 1, 45, 1), (100, 60, 45, 20), 8, 2, 64, 16), 16),
    (Shape((17, 1, 40), (64, 90, 40), 8, 1, 128, 32), 23),
    (Shape((1, 20, 1), (50, 37, 90), 4, 2, 256, 16), 5),
    (Shape((20, 1, 1), (50, 33, 9), 4, 2, 32, 16), 5),
)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "fallback"])
@pytest.mark.parametrize(("shape", "window"), POISON_CASES, ids=str)
def test_no_path_reads_blocks_before_the_window(
    shape: Shape, window: int, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled and _KERNEL is None:
        pytest.skip("compiled CPU kernels unavailable")
    if not compiled:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    batch = _spare_padded(int8_batch(shape, seed=8)[0])
    scale = shape.head_dim**-0.5
    reads = as_decode_reads(batch, shape, scale) if compiled else batch
    want = reference.paged_attention(reads.query, batch.kv_cache, batch.meta, scale, window)
    tol = row_tolerance(batch, shape, compiled)  # before the NaN scales
    assert _poison_unread_blocks(batch, window)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale, window)
    assert ((got - want).abs() <= tol).all()


# --- allocation ------------------------------------------------------------------


def test_kv_cache_shape_counts_the_scales() -> None:
    shape = KVCacheShape(3, 2, 64, 16, torch.int8)
    assert shape.bytes_per_block == 3 * 2 * 16 * 2 * (64 + 4)
    bf16 = KVCacheShape(3, 2, 64, 16, torch.bfloat16)
    assert shape.bytes_per_block / bf16.bytes_per_block == (64 + 4) / 128
    caches = allocate_kv_caches(shape, 5, torch.device("cpu"))
    assert len(caches) == 3
    assert caches[0].shape == (2, 5, 16, 2, 68) and caches[0].dtype == torch.int8
    # Head-major memory: a KV head's 16 rows of a block are one run of bytes.
    assert caches[0].stride() == (5 * 16 * 2 * 68, 16 * 2 * 68, 68, 16 * 68, 1)
    assert kv_int8.head_dim_of(caches[0]) == 64
    assert sum(c.numel() for c in caches) == 5 * shape.bytes_per_block


def test_triton_backend_refuses_an_int8_cache() -> None:
    triton_attention = pytest.importorskip("kernels.triton_attention")
    batch, _ = int8_batch(SHAPES[0])
    with pytest.raises(ValueError, match="int8"):
        triton_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    key = torch.zeros(batch.meta.num_tokens, 2, 64)
    with pytest.raises(ValueError, match="int8"):
        triton_attention.reshape_and_cache(key, key, batch.kv_cache, batch.meta.slot_mapping)
