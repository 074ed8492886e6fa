"""The int8 KV cache's format: int8 values and a float32 scale per row.

Layout. Still one tensor per layer, of dtype int8, of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim + 4]``, head-major in
memory (a KV head's rows of a block in one run: ``kernels/kv_layout.py``
says why). Each (token, head) row holds its ``head_dim`` int8 values
followed by that row's float32 scale in the last 4 bytes (little-endian,
i.e. ``row[head_dim:]`` viewed as ``torch.float32``). Why inside the rows
and not a side tensor of scales:

* a block stays one contiguous unit with its scales in it, so the KV budget
  (``engine.worker.kv_cache.KVCacheShape.bytes_per_block``) counts them, and
  every connector that copies whole blocks (shared memory, Redis, NIXL,
  offload: ``kernels/csrc/kv_copy.cpp`` and its Python peers copy bytes)
  moves them with no change;
* a kernel reading a head's rows of a block reads one run of bytes, scales
  included, with no second stream of addresses to walk.

Where the CPU has AVX-512 VNNI, the compiled decode kernel also rounds each
query head to int8 (``decode_query`` gives the values it reads) and sums V
with int16 weights; tests/unit/kernels/test_kv_int8.py derives the bounds.

The head size is recovered from the tensor as ``shape[-1] - 4``
(``head_dim_of``); ``head_dim + 4`` stays a multiple of 4, so every scale is
4-byte aligned.

Quantization: symmetric, per (token, head) row, as llama.cpp's q8_0 keeps a
scale per block of values. ``scale = max|x| * fl(1/127)`` (float32 product),
``q = round(x * fl(1/scale))`` clamped to [-127, 127], where ``fl`` is
float32 rounding and ``round`` is round-half-to-even (``torch.round``, the
CPU's default conversion mode, and what the C++ writer uses). A zero row
gets scale 0 and zeros. Products, not divisions by the scale: the C++ is
built with -ffast-math, which may turn ``x / scale`` into ``x * (1/scale)``
anyway; written as products, this module and ``kernels/csrc/kv_int8.cpp``
agree bit for bit. A value dequantizes to ``q * scale`` (float32), within
``scale / 2`` of x (plus float32 rounding).

``quantize_rows`` is the reference quantizer (the torch path's and the
reference backend's cache write); ``dequantize_cache`` is for tests and
the reference attention, never a serving path: kernels read int8 in place.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 scale after each row's values
# float32(1 / 127), as the C++ writer's `1.0f / 127.0f` folds it.
_INV_127 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)
Q_MAX = 127  # symmetric: -128 is never written


def int8_row_bytes(head_dim: int) -> int:
    """Bytes (int8 elements) of one (token, head) row: values then scale."""
    return head_dim + SCALE_BYTES


def is_int8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The model's head size for a cache of any supported dtype."""
    last = int(kv_cache.shape[-1])
    return last - SCALE_BYTES if is_int8_cache(kv_cache) else last


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) -> int8 ``[..., head_dim + 4]``
    in the cache's row format."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax * _INV_127.to(x.device)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inv).clamp_(-Q_MAX, Q_MAX).to(torch.int8)
    scale_bytes = scale.contiguous().view(torch.int8)  # [..., 4], little-endian
    return torch.cat((q, scale_bytes), dim=-1)


def decode_query(query: torch.Tensor, scale: float) -> torch.Tensor:
    """The query ``[..., head_dim]`` as the compiled decode kernel reads it
    over an int8 cache where it takes integer scores (AVX-512 VNNI:
    ``cpu_kernels.load().decode_int8_quantizes_query``): each head's
    ``query * scale`` rounded to int8 with its own scale ``max|x| / 127``,
    as llama.cpp quantizes the query for a q8_0 cache. Returned in float32
    and divided by ``scale`` again, so attention over it (with ``scale``)
    gives the kernel's scores: for tests, never a serving path."""
    x = query.float() * scale
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-128, 127)
    return q * (amax / 127.0) / scale


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 1]``: each int8 row's scale."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., head_dim + 4]`` -> ``[..., head_dim]`` of ``dtype``
    (computed in float32: ``q * scale``)."""
    values = rows[..., :-SCALE_BYTES].float() * row_scales(rows)
    return values.to(dtype)


def dequantize_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """A float32 copy ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    of an int8 cache (tests and the reference only)."""
    if not is_int8_cache(kv_cache):
        raise ValueError(f"expected an int8 KV cache, got {kv_cache.dtype}")
    return dequantize_rows(kv_cache)


def cache_rows(rows: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """K or V rows ``[..., head_dim]`` in ``kv_cache``'s element format:
    quantized for an int8 cache, else converted to its dtype."""
    if is_int8_cache(kv_cache):
        return quantize_rows(rows)
    return rows.to(kv_cache.dtype)
