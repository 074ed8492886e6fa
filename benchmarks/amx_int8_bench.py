"""The int8-activation kernels on AMX tiles against the same kernels on VNNI.

Gemma 3 270M's linear shapes with its Q4_K_M file's formats (q8_0 for the
fused QKV and gate_up, as its Q5_0 rows run; q6_k for down; q4_k for o; a
32k-row slice of the q8_0 lm_head), random weights, per row count:
`quant_linear(isa="avx512")` (VNNI) and `isa="amx"`, interleaved (A, B, A,
B) over rounds; medians with min/max of the per-round ratios, and the
1-minute load average before and after (2 cores: one busy foreign process
halves everything). Both give the same floats (tests/unit/kernels/test_amx.py);
q4_k (nibbles) stays on VNNI at every level, so its ratio shows ~1.0.

    .venv/bin/python benchmarks/amx_int8_bench.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.quant import QuantizedWeight, available_isas, from_gguf_rows, quant_linear
from tests.unit.kernels.kquant_blocks import Q4_K, Q6_K, random_rows

# (name, out, in, format)
SHAPES = (
    ("qkv", 1536, 640, "q8_0"),
    ("o", 640, 1024, "q4_k"),
    ("gate_up", 4096, 640, "q8_0"),
    ("down", 640, 2048, "q6_k"),
    ("lm_head/8", 32768, 640, "q8_0"),
)


def weight(out: int, width: int, fmt: str) -> QuantizedWeight:
    if fmt == "q8_0":
        w = np.random.default_rng(out).standard_normal((out, width)).astype(np.float32) * 0.05
        raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    else:
        raw = random_rows(Q4_K if fmt == "q4_k" else Q6_K, out, width, seed=out)
    qw = from_gguf_rows(torch.from_numpy(raw), fmt, width)
    return QuantizedWeight(fmt, out, width, qw.packed, int8_activations=True)


def seconds(x: torch.Tensor, qw: QuantizedWeight, isa: str, repeats: int) -> float:
    quant_linear(x, qw, None, isa=isa)
    start = time.perf_counter()
    for _ in range(repeats):
        quant_linear(x, qw, None, isa=isa)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,32,64,256,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if "amx" not in available_isas():
        sys.exit(f"this build has no amx path (paths: {', '.join(available_isas())})")
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}; threads {args.threads}")
    weights = {name: weight(out, width, fmt) for name, out, width, fmt in SHAPES}
    print(f"{'shape':>22} {'rows':>5} {'vnni ms':>9} {'amx ms':>9} {'amx/vnni speed':>22}")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, out, width, fmt in SHAPES:
            x = torch.randn(rows, width)
            qw = weights[name]
            repeats = max(1, int(2e8 / (rows * out * width)))
            vnni, amx, ratios = [], [], []
            for _ in range(args.rounds):
                a = seconds(x, qw, "avx512", repeats)
                b = seconds(x, qw, "amx", repeats)
                vnni.append(a)
                amx.append(b)
                ratios.append(a / b)
            label = f"{name} {out}x{width} {fmt}"
            print(
                f"{label:>22} {rows:5d} {statistics.median(vnni) * 1e3:9.3f} "
                f"{statistics.median(amx) * 1e3:9.3f} {statistics.median(ratios):6.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f})",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
