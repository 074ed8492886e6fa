"""A model's decode steps through the compiled decode stack against the
Python layer loop, in one engine (issue 42: Gemma 3's layers in the stack).

The stack (kernels/csrc/decode_stack.cpp) runs the same kernels as the
Python layers, in the same order, bit for bit; what it saves is the
interpreter and dispatch around them. The engine runs both ways, switched
between runs (A, B, A, B): single stream (127 timed decode steps:
tokens/s = 1 / median step) and 64 mixed requests (prompts of 32-512 token
ids, 128 output tokens each, all at once). Medians with min and max; the
load average before and after.

    .venv/bin/python benchmarks/decode_stack_bench.py --rounds 3
    .venv/bin/python benchmarks/decode_stack_bench.py --model <dir or GGUF>
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import make_prompts, switched_engine, switched_runs  # noqa: E402


def main() -> None:
    args, llm = switched_engine(__doc__)
    model = llm.core.worker.loaded.model
    stack = model.decode_stack
    if stack is None:
        raise SystemExit(f"{args.model} builds no decode stack here (see the load's log)")
    layers = len(model.model.layers)

    def use(compiled: bool) -> int:
        model.decode_stack = stack if compiled else None
        return layers

    prompts = make_prompts(64, 32, 512, llm.core.info.vocab_size)
    ways = {"compiled stack": lambda: use(True), "Python layers": lambda: use(False)}
    switched_runs(llm, ways, args.rounds, args.new_tokens, prompts)


if __name__ == "__main__":
    main()
