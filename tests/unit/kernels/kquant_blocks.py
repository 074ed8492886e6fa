"""Random GGUF K-quant rows, built as raw bytes (the gguf package's
`quants.quantize` has no Q4_K or Q6_K quantizer), for the kernels' and the
reader's tests."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q4_K = GGMLQuantizationType.Q4_K
Q6_K = GGMLQuantizationType.Q6_K


def random_rows(
    qtype: GGMLQuantizationType, rows: int, width: int, seed: int = 0, std: float = 0.05
) -> np.ndarray:
    """uint8 [rows, bytes per row] of random super-blocks whose values are
    about `std` in size: every scale, minimum and quant is random; the
    float16 d (and Q4_K's dmin) are chosen so the values stay finite."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if width % block:
        raise ValueError(f"width {width} is not whole super-blocks of {block}")
    rng = np.random.default_rng(seed)
    n = rows * (width // block)
    raw = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    if qtype == Q4_K:
        # value = d * scale * q - dmin * min: scale, min < 64, q < 16.
        d = rng.uniform(0.5, 1.5, n) * std / (31 * 7.5)
        dmin = rng.uniform(0.5, 1.5, n) * std * 7.5 / 31 / 7.5
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(n, 2)
    elif qtype == Q6_K:
        # value = d * scale * q: int8 scale, q in [-32, 31]; d last.
        d = rng.uniform(0.5, 1.5, n) * std / (64 * 16)
        raw[:, -2:] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    else:
        raise ValueError(f"{qtype.name} is not a K-quant these tests build")
    return raw.reshape(rows, -1)


def q4_k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d * scale, dmin * min) of each sub-block of 32 of Q4_K rows, float32
    [rows, sub-blocks] (llama.cpp's get_scale_min_k4)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sm = blocks[:, 4:16].astype(np.int32)
    scale = np.concatenate([sm[:, 0:4] & 63, (sm[:, 8:12] & 15) | ((sm[:, 0:4] >> 6) << 4)], 1)
    low = (sm[:, 8:12] >> 4) | ((sm[:, 4:8] >> 6) << 4)
    mins = np.concatenate([sm[:, 4:8] & 63, low], 1)
    return (d * scale).reshape(rows, -1), (dmin * mins).reshape(rows, -1)


def q6_k_scales(raw: np.ndarray) -> np.ndarray:
    """d * scale of each sub-block of 16 of Q6_K rows, float32 [rows, sub-blocks]."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scale = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return (d * scale).reshape(rows, -1)
