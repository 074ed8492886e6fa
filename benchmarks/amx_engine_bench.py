"""A model served with the int8 path's AMX kernels against the same engine on
VNNI only (kernels.quant.cap_isa), in one engine: the end-to-end share of
benchmarks/amx_int8_bench.py's kernel speed-ups.

Switched between runs (A, B, A, B): single stream (127 timed decode steps:
tokens/s = 1 / the median step) and 64 mixed requests (prompts of 32-512
token ids, 128 output tokens each, all at once). Both ways give the same
tokens (the kernels' floats are equal). Medians with min and max; the load
average before and after.

    .venv/bin/python benchmarks/amx_engine_bench.py --rounds 3
    .venv/bin/python benchmarks/amx_engine_bench.py --model <dir or GGUF>
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import make_prompts, switched_engine, switched_runs  # noqa: E402

from kernels.quant import available_isas, cap_isa  # noqa: E402


def main() -> None:
    args, llm = switched_engine(__doc__)
    if "amx" not in available_isas():
        raise SystemExit(f"no amx path here (paths: {', '.join(available_isas())})")

    def use(isa: str) -> int:
        cap_isa(isa)
        return 1

    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    ways = {"amx": lambda: use("amx"), "vnni": lambda: use("avx512")}
    try:
        switched_runs(llm, ways, args.rounds, args.new_tokens, prompts)
    finally:
        cap_isa("amx")


if __name__ == "__main__":
    main()
