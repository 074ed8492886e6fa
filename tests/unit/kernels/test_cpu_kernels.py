"""The compiled CPU decode kernel against the reference, on the shared shapes
(every sequence's decode row; prefill rows are the torch path's job)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels import cpu_kernels, reference, torch_attention
from tests.unit.kernels.batches import SHAPES, Shape, make_batch, over_bfloat16

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

DEFAULT_MODEL_HEADS = Shape((1,) * 6, (1, 15, 16, 17, 200, 333), 9, 3, 64, 16)
DECODE_SHAPES = [
    *[s for s in SHAPES if max(s.q_lens) == 1],
    DEFAULT_MODEL_HEADS,
    Shape((1,) * 4, (31, 32, 33, 129), 8, 8, 128, 32),
    # Head dim 256 (Gemma 3), two and four query heads a KV head.
    Shape((1,) * 3, (5, 40, 17), 4, 2, 256, 16),
    Shape((1,) * 4, (3, 16, 47, 300), 4, 1, 256, 16),
]


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("no C++ toolchain here: the torch path is used instead")
    return module


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: s.label)
def test_decode_kernel_matches_reference(kernel, shape: Shape) -> None:
    torch.manual_seed(7)
    batch = make_batch(shape)
    scale = shape.head_dim**-0.5
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    got = torch.empty_like(batch.query)
    meta = batch.meta
    kernel.decode_attention(
        got, batch.query, batch.kv_cache, meta.block_table, meta.seq_lens, scale
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: s.label)
def test_decode_kernel_over_a_bfloat16_cache(kernel, shape: Shape) -> None:
    """--kv-cache-dtype bfloat16: float32 queries over bfloat16 K/V rows,
    widened as they are read; the reference attends over the same rows
    widened to float32 first."""
    torch.manual_seed(7)
    batch = make_batch(shape, dtype=torch.bfloat16)
    scale = shape.head_dim**-0.5
    query = batch.query.float()
    want = reference.paged_attention(query, batch.kv_cache.float(), batch.meta, scale)
    got = torch.empty_like(query)
    meta = batch.meta
    kernel.decode_attention(got, query, batch.kv_cache, meta.block_table, meta.seq_lens, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_cache_kv_into_a_bfloat16_cache_rounds_as_torch(kernel) -> None:
    heads, kv_heads, dim, tokens = 3, 1, 64, 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    cache = torch.zeros(2, 4, 16, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, 63, 0, 40])
    want = cache.clone()
    reference.reshape_and_cache(key, value, want, slots)  # index_copy_ of .to(bfloat16)
    kernel.cache_kv(cache, key, value, slots)
    assert torch.equal(cache, want)


def test_strided_query_rows_as_the_model_passes_them(kernel) -> None:
    # The model hands attention a view into the fused qkv output.
    shape = DEFAULT_MODEL_HEADS
    batch = make_batch(shape)
    wide = torch.randn(batch.query.shape[0], shape.num_heads + 2 * shape.num_kv_heads, 64)
    wide[:, : shape.num_heads] = batch.query
    query = wide[:, : shape.num_heads]
    assert not query.is_contiguous()
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.125)
    got = torch_attention.paged_attention(query, batch.kv_cache, batch.meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_disabled_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    assert cpu_kernels.load() is None
    # The torch path still answers, through the gather + SDPA route.
    batch = make_batch(DECODE_SHAPES[0])
    want = reference.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    meta = dataclasses.replace(batch.meta)
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def _rows_with_ties_and_nans() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    plain = torch.randn(5, 1000, generator=gen)
    ties = torch.randint(0, 4, (6, 300), generator=gen).float()  # many equal maxima
    nans = torch.randn(4, 50, generator=gen)
    nans[1, 7] = nans[1, 30] = float("nan")  # the first NaN wins
    nans[2, 0] = float("nan")
    nans[3, 49] = float("nan")
    strided = torch.randn(3, 128, generator=gen)[:, :100]  # rows 128 apart
    # Vectorized builds read 16 at a time: maxima in the last partial vector,
    # and rows of -inf only (the first index), of one element, of 16.
    edges = torch.randn(4, 37, generator=gen)
    edges[0, 36] = edges[1, 33] = 50.0
    edges[2] = edges[3] = float("-inf")
    edges[3, 35] = -1e30
    one, sixteen = torch.randn(3, 1, generator=gen), torch.randn(2, 16, generator=gen)
    big = torch.randn(1, 49152, generator=gen)
    return [plain, ties, nans, strided, big, edges, one, sixteen]


@pytest.mark.parametrize("case", range(8))
def test_argmax_rows_matches_torch(kernel, case: int) -> None:
    x = _rows_with_ties_and_nans()[case]
    assert torch.equal(kernel.argmax_rows(x), x.argmax(dim=-1))


def test_cache_kv_writes_strided_views_of_one_projection(kernel) -> None:
    # The model passes K and V as views into its fused qkv output.
    heads, kv_heads, dim, tokens = 3, 1, 64, 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    cache = torch.zeros(2, 4, 16, kv_heads, dim)
    slots = torch.tensor([3, 17, 63, 0, 40])
    want = cache.clone()
    reference.reshape_and_cache(key, value, want, slots)
    torch_attention.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, want)


def test_cache_kv_refuses_a_slot_outside_the_cache(kernel) -> None:
    key = value = torch.randn(2, 1, 64)
    cache = torch.zeros(2, 4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="slot 64 outside the cache"):
        kernel.cache_kv(cache, key, value, torch.tensor([1, 64]))
    assert not cache.any()  # checked before anything is written


def test_a_lock_left_by_a_killed_build_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch waits forever on its build lock; one a killed build left behind
    must not hang every later start."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "stale_ext" / "lock"
    lock.parent.mkdir()
    lock.touch()
    with cpu_kernels.build_lock("stale_ext"):
        assert not lock.exists()


def test_the_build_lock_excludes_other_processes_until_its_holder_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one process builds, another waits (and leaves torch's lock of
    the running build alone); when the builder is killed, the next one goes
    on."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_LOCK],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[3],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        lock = tmp_path / "busy_ext" / "lock"
        assert lock.exists()  # torch's lock of the "running build"
        waiter = threading.Thread(target=_take_and_release, args=("busy_ext",))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and lock.exists()
        holder.kill()
        waiter.join(timeout=30.0)
        assert not waiter.is_alive() and not lock.exists()
    finally:
        holder.kill()
        holder.wait()


_HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from kernels import cpu_kernels
with cpu_kernels.build_lock("busy_ext"):
    from torch.utils.cpp_extension import _get_build_directory
    (Path(_get_build_directory("busy_ext", verbose=False)) / "lock").touch()
    print("holding", flush=True)
    time.sleep(600)
"""


def _take_and_release(name: str) -> None:
    with cpu_kernels.build_lock(name):
        pass


# --- prefill chunks (prefill_attention.cpp) ----------------------------------

PREFILL_SHAPES = [
    *[s for s in SHAPES if max(s.q_lens) > 1],
    # The default model's heads: a fresh 300-token prompt (19 tiles of 16
    # tokens), a decode, a 49-token chunk over an 11-token prefix, a 2-token
    # prompt.
    Shape((300, 1, 49, 2), (300, 70, 60, 2), 9, 3, 64, 16),
    Shape((100, 7), (130, 7), 8, 1, 128, 32),  # group 8: 6 tokens a tile
    Shape((23, 40), (40, 40), 5, 1, 64, 16),  # group 5: 45 of 48 rows used
    Shape((20,), (50,), 4, 2, 256, 16),
]


@pytest.fixture(scope="module")
def prefill_kernel(kernel):
    if not kernel.prefill_attention_applies(64, 3, 16):
        pytest.skip("no AVX-512 here: prefill chunks take the torch path")
    return kernel


def _prefill_call(
    kernel, batch, query: torch.Tensor, out: torch.Tensor, scale: float
) -> list[tuple[int, int]]:
    """Runs the kernel on the batch's prefill chunks; returns their rows."""
    starts = batch.meta.query_start_loc.tolist()
    chunks = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1]
    rows = [(starts[i], starts[i + 1]) for i in chunks]
    seqs = torch.tensor(chunks)
    kernel.prefill_attention(
        out,
        query,
        batch.kv_cache,
        batch.meta.block_table.index_select(0, seqs),
        batch.meta.seq_lens.index_select(0, seqs),
        torch.tensor([lo for lo, _ in rows], dtype=torch.int32),
        torch.tensor([hi - lo for lo, hi in rows], dtype=torch.int32),
        scale,
    )
    return rows


@pytest.fixture(params=["default", "bf16 products", "bf16 vector products", "float32 arithmetic"])
def products_setting(request: pytest.FixtureRequest, prefill_kernel) -> Iterator[None]:
    """The prefill kernel as this CPU runs it by default, then with bfloat16
    products forced on (on AMX tiles where the CPU has them, and on the
    vector units) and off: each is some CPU's default."""
    if request.param == "default":
        yield
        return
    previous = prefill_kernel.allow_bf16_attention_products(request.param != "float32 arithmetic")
    amx = prefill_kernel.allow_amx_attention(request.param != "bf16 vector products")
    try:
        yield
    finally:
        prefill_kernel.allow_bf16_attention_products(previous)
        prefill_kernel.allow_amx_attention(amx)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: s.label)
def test_prefill_kernel_matches_reference(
    prefill_kernel, products_setting: None, shape: Shape, cache_dtype: torch.dtype
) -> None:
    """Each chunk attends causally over its cached prefix and itself; rows of
    other sequences (decodes) are left as they were."""
    batch = make_batch(shape, dtype=cache_dtype, seed=5)
    query = batch.query.float()
    scale = shape.head_dim**-0.5
    products = cache_dtype == torch.bfloat16 and prefill_kernel.prefill_attention_bf16_products()
    want, atol = over_bfloat16(products, query, batch.kv_cache, batch.meta, scale)
    got = torch.full_like(query, 7.0)
    rows = _prefill_call(prefill_kernel, batch, query, got, scale)
    chunk_rows = torch.zeros(query.shape[0], dtype=torch.bool)
    for lo, hi in rows:
        chunk_rows[lo:hi] = True
    torch.testing.assert_close(got[chunk_rows], want[chunk_rows], atol=atol, rtol=0)
    assert bool((got[~chunk_rows] == 7.0).all())


def test_prefill_kernel_refuses_what_it_cannot_do(prefill_kernel) -> None:
    batch = make_batch(PREFILL_SHAPES[-4])
    out = torch.zeros_like(batch.query)
    bad = dataclasses.replace(batch.meta, block_table=batch.meta.block_table.clone())
    bad.block_table[0, 0] = batch.kv_cache.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="names block"):
        _prefill_call(prefill_kernel, dataclasses.replace(batch, meta=bad), batch.query, out, 1.0)
    short = dataclasses.replace(batch.meta, seq_lens=batch.meta.seq_lens.clone())
    short.seq_lens[0] = 10  # fewer positions than the chunk's 300 new tokens
    with pytest.raises(RuntimeError, match="does not fit"):
        _prefill_call(prefill_kernel, dataclasses.replace(batch, meta=short), batch.query, out, 1.0)
    assert not out.any()  # checked before anything is written
    assert not prefill_kernel.prefill_attention_applies(80, 1, 16)  # head dim
    assert not prefill_kernel.prefill_attention_applies(64, 1, 8)  # block size
    odd = make_batch(Shape((4,), (4,), 2, 2, 96, 16))
    with pytest.raises(RuntimeError, match="no kernel for head_dim 96"):
        _prefill_call(prefill_kernel, odd, odd.query, torch.zeros_like(odd.query), 1.0)


def test_bfloat16_products_where_the_cpu_has_them(prefill_kernel) -> None:
    """The prefill kernel takes bfloat16 products by default exactly where
    the CPU has AVX512_BF16 and is not Intel's (whose two FMA ports make
    them no faster on the vector units) or has AMX tiles (which make them
    faster: prefill_attention_amx.cpp); allowed, wherever it has
    AVX512_BF16."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    capable, intel = " avx512_bf16" in info, "GenuineIntel" in info
    tiles = " amx_bf16" in info and os.environ.get("TANDEM_AMX") != "0"
    assert prefill_kernel.prefill_attention_bf16_products() == (capable and (tiles or not intel))
    previous = prefill_kernel.allow_bf16_attention_products(True)
    try:
        assert prefill_kernel.prefill_attention_bf16_products() == capable
    finally:
        prefill_kernel.allow_bf16_attention_products(previous)


def test_bfloat16_products_can_be_disallowed(prefill_kernel) -> None:
    """The switch: disallowed, a bfloat16 cache's rows are widened to
    float32 (exact to 2e-5)."""
    batch = make_batch(PREFILL_SHAPES[-4], dtype=torch.bfloat16, seed=5)
    query, scale = batch.query.float(), 0.125
    want = reference.paged_attention(query, batch.kv_cache.float(), batch.meta, scale)
    previous = prefill_kernel.allow_bf16_attention_products(False)
    try:
        assert not prefill_kernel.prefill_attention_bf16_products()
        got = torch.full_like(query, 7.0)
        for lo, hi in _prefill_call(prefill_kernel, batch, query, got, scale):
            torch.testing.assert_close(got[lo:hi], want[lo:hi], atol=2e-5, rtol=0)
    finally:
        prefill_kernel.allow_bf16_attention_products(previous)
