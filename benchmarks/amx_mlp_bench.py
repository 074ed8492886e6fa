"""The gated MLP in one pass on AMX tiles (kernels/csrc/amx_mlp.cpp) against
the chunked path it replaces, interleaved A, B, A, B in one process.

* kernels: the default model's MLP (576 -> 2 x 1,536 -> 576, Q4_1) and
  Gemma 3 270M's (640 -> 2 x 2,048 -> 640, Q8_0 / Q4_1 here), at 1,024-8,192
  rows: milliseconds per call, fused (`kernels.quant.amx_mlp`) against the
  chunks of 1,024 rows the model ran before (gate_up by quant_linear, then
  quant_linear_silu or GELU and quant_linear, each on AMX tiles);
* the engine: the default model (or ``--model``), single stream and the
  64 mixed requests (prompts of 32-512 tokens, 128 output tokens), whose
  prefill chunks of up to 8,192 tokens take the fused path, switched off by
  pointing the model's `amx_mlp_applies` at a function that says no.

Medians with min and max; the load average before and after. Nothing is
asserted.

    .venv/bin/python benchmarks/amx_mlp_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import make_prompts, median_ms, switched_runs  # noqa: E402

import engine.models.layers as layers  # noqa: E402
from engine.llm import LLM  # noqa: E402
from kernels import quant  # noqa: E402

# name: (hidden, intermediate, gate_up format, down format, activation)
MLPS = {
    "SmolLM2-135M": (576, 1536, "Q4_1", "Q4_1", "silu"),
    "Gemma 3 270M": (640, 2048, "Q8_0", "Q4_1", "gelu_tanh"),
}
CHUNK = 1024


def _weight(out: int, width: int, fmt: str) -> quant.QuantizedWeight:
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(out, width) * 0.02
    raw = quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    return quant.from_gguf_rows(torch.from_numpy(raw), fmt.lower(), width, True)


def _chunked(
    x: torch.Tensor, gate_up: quant.QuantizedWeight, down: quant.QuantizedWeight, act: str
) -> torch.Tensor:
    out = x.new_empty(x.shape[0], down.out_features)
    for start in range(0, x.shape[0], CHUNK):
        product = quant.quant_linear(x[start : start + CHUNK], gate_up, None)
        if act == "silu":
            out[start : start + CHUNK] = quant.quant_linear_silu(product, down, None)
        else:
            gate, up = product.chunk(2, dim=-1)
            out[start : start + CHUNK] = quant.quant_linear(
                F.gelu(gate, approximate="tanh") * up, down, None
            )
    return out


def kernels(rounds: int, rows: list[int]) -> None:
    for name, (hidden, inter, f1, f2, act) in MLPS.items():
        gate_up, down = _weight(2 * inter, hidden, f1), _weight(hidden, inter, f2)
        for m in rows:
            x = torch.randn(m, hidden)
            ways: dict[str, Callable[[], object]] = {
                "chunked": partial(_chunked, x, gate_up, down, act),
                "fused": partial(quant.amx_mlp, x, gate_up, down, None, None, act),
            }
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(rounds):
                for way, fn in ways.items():
                    times[way].append(median_ms(fn))
            a, b = (statistics.median(times[w]) for w in ("chunked", "fused"))
            ratios = [c / f for c, f in zip(times["chunked"], times["fused"], strict=True)]
            print(
                f"{name:13s} {m:5d} rows: chunked {a:7.2f} ms  fused {b:7.2f} ms  "
                f"chunked / fused {statistics.median(ratios):.2f} "
                f"(min {min(ratios):.2f}, max {max(ratios):.2f})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1024,2048,8192")
    parser.add_argument("--model", default=None, help="the engine part's (default model)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if quant.amx_bf16_rows() is None:
        raise SystemExit("no AMX-BF16 here (or turned off): nothing to compare")
    print(f"load before: {os.getloadavg()[0]:.2f}")
    if not args.skip_kernels:
        kernels(args.rounds, [int(r) for r in args.rows.split(",")])
    if args.skip_engine:
        return
    llm = LLM(model=args.model, max_model_len=1024)
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    # The model module's own name for the check (it imports it by name).
    applies = vars(layers)["amx_mlp_applies"]

    def use(fused: bool) -> int:
        setattr(layers, "amx_mlp_applies", applies if fused else (lambda *_: False))  # noqa: B010
        return 1

    ways = {"fused": lambda: use(True), "chunked": lambda: use(False)}
    try:
        switched_runs(llm, ways, args.rounds, args.new_tokens, prompts)
    finally:
        setattr(layers, "amx_mlp_applies", applies)  # noqa: B010
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
