"""What the default (fast) path costs in accuracy against the exact one:
perplexity on the default model over the 4,096 tokens of Newton's *Opticks*
that tests/e2e/test_quantized_weights.py uses (four independent windows of
1,024), through the whole engine (prompt logprobs), for each setting of
``--exact`` / ``--int8-activations`` / ``--kv-cache-dtype``; ``--model``
takes another model (``gemma-3-270m``: Gemma 3 270M's Q4_K_M GGUF, whose
local layers' 512-token window the 1,024-token windows exceed). Prompt
logprobs come from prefill, so the int8 KV row measures the cache's
rounding, not the decode kernel's integer arithmetic.

    .venv/bin/python benchmarks/numerics_perplexity.py
    .venv/bin/python benchmarks/numerics_perplexity.py --model gemma-3-270m
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

TEXT_TOKENS = 4096
WINDOW = 1024
SETTINGS: dict[str, dict[str, Any]] = {
    "exact (--exact)": {"exact": True},
    "default (no flags)": {},
    "int8 activations only": {"kv_cache_dtype": "float32"},
    "bfloat16 KV only": {"int8_activations": False},
    "int8 KV, float act": {"int8_activations": False, "kv_cache_dtype": "int8"},
}


def opticks_windows(llm: LLM) -> list[list[int]]:
    spec = importlib.util.find_spec("tvm_ffi")
    assert spec is not None and spec.origin is not None, "apache-tvm-ffi (xgrammar's) is missing"
    path = Path(spec.origin).parent / "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
    text = path.read_text(encoding="utf-8")
    ids: list[int] = llm.tokenizer.encode(text[text.index("Advertisement I") :])[:TEXT_TOKENS]
    return [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of every token after the
    first of each window."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for out in llm.generate(windows, params, use_tqdm=False):
        assert out.prompt_logprobs is not None
        for entry in out.prompt_logprobs[1:]:
            assert entry is not None
            nll -= entry.logprob
            count += 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model name or path (default: Tandem's)")
    args = parser.parse_args()
    model = {} if args.model is None else {"model": args.model}
    exact = None
    for name, overrides in SETTINGS.items():
        start = time.perf_counter()
        llm = LLM(max_model_len=WINDOW + 8, **model, **overrides)
        got = perplexity(llm, opticks_windows(llm))
        exact = exact or got
        numerics = llm.core.info.numerics.describe()
        print(
            f"{name:24} {got:.3f} ({(got / exact - 1) * 100:+.2f}% against exact)  "
            f"[{numerics}; {time.perf_counter() - start:.0f} s]",
            flush=True,
        )
        llm.core.shutdown()
        del llm


if __name__ == "__main__":
    main()
