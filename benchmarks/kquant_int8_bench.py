"""Gemma 3 270M (Q4_K_M) on the default path: its K-quant weights (Q4_K,
Q6_K) with int8 activations against float32 activations (issue 42's K-quant
int8 kernels).

The default path runs GGUF blocks with int8 activations. K-quant weights took
float32 inputs until they had int8 kernels; the Q5_0/Q8_0 ones had int8
inputs all along. One engine (the default settings, a bfloat16 KV cache)
runs both ways, its K-quant weights switched between runs (A, B, A, B):
single stream (a 64-token prompt, then 127 timed decode steps: tokens/s =
1 / median step) and 64 mixed requests (prompts of 32-512 token ids, 128
output tokens each, all at once: output tokens/s). Medians with min and max;
the load average before and after (2 cores: a foreign busy process slows
both alike).

    .venv/bin/python benchmarks/kquant_int8_bench.py --rounds 3
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import make_prompts, switched_engine, switched_runs  # noqa: E402

from engine.llm import LLM  # noqa: E402
from kernels.quant import QuantizedWeight  # noqa: E402


def set_k_quant_int8(llm: LLM, on: bool) -> int:
    """Switch every K-quant weight's int8 activations; returns how many."""
    count = 0
    for module in llm.core.worker.loaded.model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, QuantizedWeight) and packed.format in ("q4_k", "q6_k"):
            setattr(module, "packed", dataclasses.replace(packed, int8_activations=on))  # noqa: B010
            count += 1
    return count


def main() -> None:
    args, llm = switched_engine(__doc__)
    numerics = llm.core.info.numerics
    print(f"numerics: {numerics.path}, {numerics.activations}, KV {numerics.kv_cache_dtype}")
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    ways = {"K-quant int8 act": True, "K-quant float act": False}
    switches = {name: functools.partial(set_k_quant_int8, llm, on) for name, on in ways.items()}
    switched_runs(llm, switches, args.rounds, args.new_tokens, prompts)


if __name__ == "__main__":
    main()
