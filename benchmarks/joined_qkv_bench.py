"""Gemma 3 270M (Q4_K_M) on the default path: its fused qkv weights of mixed
GGUF formats kept in their blocks against expanded to float32.

Nine of the file's 18 layers have Q5_0 q/k and a Q8_0 v. Both are Q8 tiles,
so since 2026-11-29 the loader joins them (`kernels.quant.concat_rows`);
before, a fused weight of mixed formats was expanded to float32 (with MKL's
packed copy), 3.9 MB a layer read each step against 1.0 MB. One engine (the
default settings) runs both ways, the nine weights switched between runs
(A, B, A, B): single stream (127 timed decode steps: tokens/s = 1 / median
step) and 64 mixed requests (prompts of 32-512 token ids, 128 output tokens
each, all at once). Medians with min and max; the load average before and
after (2 cores: a foreign busy process slows both alike).

    .venv/bin/python benchmarks/joined_qkv_bench.py --rounds 3
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import make_prompts, switched_engine, switched_runs  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.models.layers import Linear  # noqa: E402
from kernels.quant import QuantizedWeight  # noqa: E402


class JoinedWeights:
    """The model's joined weights (formats like 'q5_0/q8_0'), switchable to
    float32 copies and back."""

    def __init__(self, llm: LLM) -> None:
        self.modules = [
            (m, m.weight, m.packed)
            for m in llm.core.worker.loaded.model.modules()
            if isinstance(m, Linear)
            and isinstance(m.packed, QuantizedWeight)
            and "/" in m.packed.format
        ]
        self.floats = [
            nn.Parameter(packed.dequantize(), requires_grad=False) for _, _, packed in self.modules
        ]

    def use(self, blocks: bool) -> int:
        for (module, placeholder, packed), weight in zip(self.modules, self.floats, strict=True):
            if blocks:
                module.weight, module.packed = placeholder, packed
            else:
                module.weight, module.packed = weight, None
                module.pack()  # MKL's packed copy, as a float32 weight gets at load
        return len(self.modules)


def main() -> None:
    args, llm = switched_engine(__doc__)
    joined = JoinedWeights(llm)
    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    ways = {"joined blocks": True, "float32": False}
    switches = {name: functools.partial(joined.use, blocks) for name, blocks in ways.items()}
    switched_runs(llm, switches, args.rounds, args.new_tokens, prompts)


if __name__ == "__main__":
    main()
