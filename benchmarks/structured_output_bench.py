"""Structured output: the two grammar libraries, then the engine (issue 19).

Part "libs": xgrammar against llguidance on the default model's tokenizer,
each through its own API, one thread each (the engine's torch threads own
the cores): building the tokenizer info (once), compiling a realistic JSON
schema (a tool call's arguments: nesting, enums, arrays, numbers, required
fields; a fresh compiler per round, so no cache), and filling the next-token
bitmask for a batch of 1 / 16 / 64 matchers advanced through different
prefixes of a valid instance (so their states differ). Rounds alternate
the libraries (xgrammar, llguidance, ...); medians (min-max).

Part "engine": the offline LLM, 64 requests at once (max_num_seqs 64), 64
tokens each, greedy, EOS ignored: run A has all 64 unconstrained, run B
has half constrained by a JSON schema (with a free-text field, so they too
run all 64 tokens), alternating A, B, A, B; output tokens/s per run, and in
B the time per step to fill the bitmask (the scheduler's side) and to
apply it (the runner's side).

    .venv/bin/python benchmarks/structured_output_bench.py [--part libs,engine] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["search_flights", "book_hotel", "get_weather"]},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "minLength": 3, "maxLength": 3},
                "destination": {"type": "string", "minLength": 3, "maxLength": 3},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "passengers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "seat": {"enum": ["window", "aisle", "middle"]},
                        },
                        "required": ["name", "age"],
                    },
                    "minItems": 1,
                    "maxItems": 9,
                },
                "cabin": {"enum": ["economy", "premium", "business", "first"]},
                "max_price": {"type": "number", "minimum": 0},
                "flexible": {"type": "boolean"},
            },
            "required": ["origin", "destination", "date", "passengers"],
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "search_flights",
    "arguments": {
        "origin": "AMS",
        "destination": "LIS",
        "date": "2026-12-01",
        "passengers": [
            {"name": "Ana Lopes", "age": 34, "seat": "window"},
            {"name": "Jo", "age": 7, "seat": "middle"},
        ],
        "cabin": "economy",
        "max_price": 420.5,
        "flexible": True,
    },
}
ENGINE_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["title", "summary"],
    "additionalProperties": False,
}


def _ms(samples: list[float]) -> str:
    return f"{statistics.median(samples):8.3f} ms ({min(samples):.3f}-{max(samples):.3f})"


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled: Any, prefix: list[int]) -> Any:
        m = self.xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(t) for t in prefix)
        return m

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def bitmask(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.vocab = llguidance, vocab
        self.np = llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema,
            # The same output format as xgrammar's (", " and ": ", nothing else).
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        matcher = self.llg.LLMatcher(self.tok, grammar)  # compiles
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar: Any, prefix: list[int]) -> Any:
        m = self.llg.LLMatcher(self.tok, grammar)
        assert m.consume_tokens(prefix), m.get_error()
        return m

    def fill(self, matchers: list[Any], bitmask: Any) -> None:
        self.np.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def bitmask(self, rows: int) -> Any:
        return self.np.allocate_token_bitmask(rows, self.vocab)


def bench_libs(rounds: int) -> None:
    from engine.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    vocab = 49152
    schema = json.dumps(TOOL_SCHEMA)
    # xgrammar and llguidance both write ", " and ": " without free whitespace.
    ids = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    libs: list[Any] = []
    for cls in (XGrammarLib, LLGuidanceLib):
        start = time.perf_counter()
        libs.append(cls(tokenizer, vocab))
        print(f"{cls.name:<11} tokenizer info: {(time.perf_counter() - start) * 1000:8.1f} ms")
    compile_ms: dict[str, list[float]] = {lib.name: [] for lib in libs}
    fill_ms: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for lib in libs:
            compile_ms[lib.name].append(_timed(partial(lib.compile, schema)))
            compiled = lib.compile(schema)
            for batch in (1, 16, 64):
                prefixes = [ids[: (i * 7) % (len(ids) - 1)] for i in range(batch)]
                matchers = [lib.matcher(compiled, p) for p in prefixes]
                mask = lib.bitmask(batch)
                lib.fill(matchers, mask)  # warm
                fill = partial(lib.fill, matchers, mask)
                samples = [_timed(fill) for _ in range(20)]
                fill_ms.setdefault((lib.name, batch), []).append(statistics.median(samples))
    print(f"\nmedians (min-max) over {rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    for lib in libs:
        print(f"{lib.name:<11} compile the tool schema: {_ms(compile_ms[lib.name])}")
    for batch in (1, 16, 64):
        for lib in libs:
            print(
                f"{lib.name:<11} fill a batch of {batch:>2}:     {_ms(fill_ms[(lib.name, batch)])}"
            )


def bench_engine(rounds: int) -> None:
    import engine.structured_output.apply as apply_mod
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.structured_output.manager import StructuredOutputManager
    from engine.structured_output.params import StructuredOutputParams

    fill_ms: list[float] = []
    apply_ms: list[float] = []
    original_fill = StructuredOutputManager.grammar_bitmask
    original_apply = apply_mod.apply_device_bitmask

    def timed_fill(self: StructuredOutputManager, requests: Any, drafts: Any = None) -> Any:
        start = time.perf_counter()
        out = original_fill(self, requests, drafts)
        fill_ms.append((time.perf_counter() - start) * 1000)
        return out

    def timed_apply(*args: Any) -> None:
        start = time.perf_counter()
        original_apply(*args)
        apply_ms.append((time.perf_counter() - start) * 1000)

    StructuredOutputManager.grammar_bitmask = timed_fill  # type: ignore[method-assign]
    setattr(apply_mod, "apply_device_bitmask", timed_apply)  # noqa: B010 (mypy: a wrapper)

    llm = LLM(max_num_seqs=64, max_model_len=512)
    topics = ["a river", "a city", "a song", "a tool", "a garden", "a storm", "a ship", "a bridge"]
    prompts = [
        llm.chat_prompt([{"role": "user", "content": f"Request {i}: describe {topics[i % 8]}."}])
        for i in range(64)
    ]
    free = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    so = StructuredOutputParams(json=ENGINE_SCHEMA)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=so
    )
    runs = {"A unconstrained": [free] * 64, "B half constrained": [free, constrained] * 32}
    llm.generate(prompts[:8], runs["B half constrained"][:8], use_tqdm=False)  # warm, compile
    rates: dict[str, list[float]] = {name: [] for name in runs}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for r in range(rounds):
        for name, params in runs.items():
            fill_ms.clear()
            apply_ms.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            rates[name].append(tokens / seconds)
            extra = ""
            if fill_ms:
                extra = (
                    f"  mask fill p50 {statistics.median(fill_ms):.2f} ms,"
                    f" apply p50 {statistics.median(apply_ms):.2f} ms per step"
                )
            print(f"round {r} {name:<19} {tokens / seconds:7.1f} tok/s{extra}", flush=True)
    a, b = rates["A unconstrained"], rates["B half constrained"]
    print(
        f"\nmedians (min-max) over {rounds} rounds: unconstrained "
        f"{statistics.median(a):.1f} ({min(a):.1f}-{max(a):.1f}) tok/s, half constrained "
        f"{statistics.median(b):.1f} ({min(b):.1f}-{max(b):.1f}) tok/s, ratio "
        f"{statistics.median(b) / statistics.median(a):.3f}; load average after "
        f"{os.getloadavg()[0]:.2f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", default="libs,engine", help="libs, engine or both (default)")
    p.add_argument("--rounds", type=int, default=5, help="per library / run (default: 5)")
    args = p.parse_args()
    parts = args.part.split(",")
    if "libs" in parts:
        bench_libs(args.rounds)
    if "engine" in parts:
        bench_engine(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
