"""llama.cpp baseline for the CPU-formats benchmark, through llama-cpp-python's
low-level ctypes bindings (``llama_cpp``). Runs in its own interpreter
(/work/llamacppenv, see benchmarks/README.md); Tandem never imports it.

Modes (greedy decoding, end-of-sequence ignored, ``--threads`` CPU threads):

``single``
    One stream: a 64-token prompt, then 128 new tokens. Prompt tokens/s is
    the prompt's tokens over its prefill (one ``llama_decode``); decode
    tokens/s is the 127 tokens that take one ``llama_decode`` each (the first
    new token comes from the prefill's logits) over those calls' time.
``batched``
    N sequences (default 64) decoded together in one context, each its own
    ``seq_id`` in a ``llama_batch``, as llama.cpp's ``batched`` example does.
    Prompts are 16-256 tokens of real text (``cpu_workload``, seeded). All
    prompts are prefilled first (logits only at each prompt's last token): one
    ``llama_decode`` per prompt, as each sequence has its own KV stream
    (``--kv-unified``: one shared stream, prompts packed into batches of
    ``--n-batch`` tokens), then every step decodes one token of every
    sequence. Reported: output tokens/s over the whole run, prefill
    included (N x 128 over prefill + decode, the offline-throughput figure),
    and decode-only tokens/s (N x 127 over the decode steps).
``quantize``
    Writes the model in another GGUF type with ``llama_model_quantize``
    (``--ftype f32|f16|q8_0|q4_1``; requantizing is allowed, so from the
    shipped Q4_1 file this dequantizes, which gives exactly the weights of
    Tandem's converted Hugging Face directory for F32).

A warm-up decode (then a cleared KV cache) precedes the timed part. Prints
ONE JSON line on stdout: the figures, the workload's digest, the llama.cpp
version and ``llama_print_system_info()``; llama.cpp's own log goes to stderr
(only errors, unless ``--verbose``).

Usage::

    /work/llamacppenv/bin/python benchmarks/baselines/llamacpp_runner.py \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 single
    /work/llamacppenv/bin/python benchmarks/baselines/llamacpp_runner.py \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 2 batched --n-seqs 64
    /work/llamacppenv/bin/python benchmarks/baselines/llamacpp_runner.py \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf quantize \\
        --ftype q8_0 --out /work/gguf-baselines/SmolLM2-135M-Instruct.Q8_0.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp as lc
from cpu_workload import (
    DEFAULT_HI,
    DEFAULT_LO,
    DEFAULT_N,
    DEFAULT_NEW_TOKENS,
    DEFAULT_SEED,
    SINGLE_PROMPT_LEN,
    cut_prompts,
    digest,
    load_prompts,
    prompt_text,
)

FTYPES = {
    "f32": lc.LLAMA_FTYPE_ALL_F32,
    "f16": lc.LLAMA_FTYPE_MOSTLY_F16,
    "q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_1": lc.LLAMA_FTYPE_MOSTLY_Q4_1,
}
FLASH_ATTN = {
    "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


class Engine:
    """One model; :meth:`open` then makes its context."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = lc.llama_model_load_from_file(
            str(args.model).encode(), lc.llama_model_default_params()
        )
        if not self.model:
            raise SystemExit(f"cannot load {args.model}")
        self.vocab = lc.llama_model_get_vocab(self.model)

    def open(self, prompts: list[list[int]]) -> None:
        """A context with KV room for ``prompts`` plus the new tokens."""
        args = self.args
        n_seqs = len(prompts)
        params = lc.llama_context_default_params()
        if args.kv_unified:
            # One KV stream shared by all sequences.
            params.n_ctx = sum(len(p) for p in prompts) + n_seqs * args.new_tokens + 16
        else:
            # One stream per sequence (llama.cpp pads each to a multiple of 256
            # cells), so a sequence's attention spans only its own cells.
            params.n_ctx = n_seqs * (max(len(p) for p in prompts) + args.new_tokens + 16)
        params.n_seq_max = n_seqs
        params.kv_unified = args.kv_unified
        params.n_batch = args.n_batch
        params.n_ubatch = min(args.n_ubatch, args.n_batch)
        params.n_threads = args.threads
        params.n_threads_batch = args.threads
        params.flash_attn_type = FLASH_ATTN[args.flash_attn]
        params.no_perf = True
        self.per_seq_prefill = args.prefill == "per-seq" or (
            args.prefill == "auto" and not args.kv_unified
        )
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("cannot create the llama.cpp context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_batch = lc.llama_n_batch(self.ctx)  # llama.cpp caps it at n_ctx
        chain = lc.llama_sampler_chain_default_params()
        self.sampler = lc.llama_sampler_chain_init(chain)
        lc.llama_sampler_chain_add(self.sampler, lc.llama_sampler_init_greedy())
        self.batch = lc.llama_batch_init(max(self.n_batch, n_seqs), 0, 1)
        self.config = {
            "n_ctx": lc.llama_n_ctx(self.ctx),
            "n_ctx_seq": lc.llama_n_ctx_seq(self.ctx),
            "n_batch": lc.llama_n_batch(self.ctx),
            "n_ubatch": lc.llama_n_ubatch(self.ctx),
            "n_seq_max": lc.llama_n_seq_max(self.ctx),
            "kv_unified": args.kv_unified,
            "flash_attn": args.flash_attn,
            "prefill": "per-seq" if self.per_seq_prefill else "packed",
            "threads": args.threads,
        }

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_sampler_free(self.sampler)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        cap = len(data) + 16
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, False, False)
        if n < 0:
            raise RuntimeError(f"tokenize: needs {-n} tokens")
        return list(buf[:n])

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, pos, seq_id, want_logits) entries."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        rc = lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def sample(self, index: int) -> int:
        """Greedy token from the logits of entry ``index`` of the last batch."""
        return int(lc.llama_sampler_sample(self.sampler, self.ctx, index))

    def clear(self) -> None:
        lc.llama_memory_clear(self.memory, True)

    def warm_up(self) -> None:
        self.decode([(t, i, 0, i == 15) for i, t in enumerate(range(100, 116))])
        token = self.sample(15)
        for step in range(4):
            self.decode([(token, 16 + step, 0, True)])
            token = self.sample(0)
        self.clear()


def run_single(engine: Engine, prompt: list[int], new_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    engine.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    token = engine.sample(len(prompt) - 1)
    prefilled = time.perf_counter()
    for step in range(new_tokens - 1):
        engine.decode([(token, len(prompt) + step, 0, True)])
        token = engine.sample(0)
    end = time.perf_counter()
    engine.clear()
    return {
        "prompt_tokens_per_s": len(prompt) / (prefilled - start),
        "decode_tokens_per_s": (new_tokens - 1) / (end - prefilled),
        "prefill_s": prefilled - start,
        "decode_s": end - prefilled,
    }


def run_batched(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    n = len(prompts)
    last: list[int] = [0] * n
    flat = [
        (token, pos, seq, pos == len(prompt) - 1)
        for seq, prompt in enumerate(prompts)
        for pos, token in enumerate(prompt)
    ]
    if engine.per_seq_prefill:
        # One llama_decode per prompt: with a KV stream per sequence, llama.cpp
        # splits a batch of several sequences into ubatches of equal length per
        # sequence, which for prompts of mixed lengths makes many small ones.
        runs = [[e for e in flat if e[2] == seq] for seq in range(n)]
    else:
        runs = [flat]
    size = engine.n_batch
    chunks = [run[lo : lo + size] for run in runs for lo in range(0, len(run), size)]
    start = time.perf_counter()
    for chunk in chunks:
        engine.decode(chunk)
        for index, (_, _, seq, logits) in enumerate(chunk):
            if logits:
                last[seq] = engine.sample(index)
    prefilled = time.perf_counter()
    for step in range(new_tokens - 1):
        engine.decode([(last[s], len(prompts[s]) + step, s, True) for s in range(n)])
        last = [engine.sample(s) for s in range(n)]
    end = time.perf_counter()
    engine.clear()
    return {
        "output_tokens_per_s": n * new_tokens / (end - start),
        "decode_tokens_per_s": n * (new_tokens - 1) / (end - prefilled),
        "prefill_tokens_per_s": len(flat) / (prefilled - start),
        "prefill_s": prefilled - start,
        "decode_s": end - prefilled,
        "total_s": end - start,
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if len(runs) > 1:
        out["runs"] = runs
    return out


def quantize(args: argparse.Namespace) -> dict[str, Any]:
    params = lc.llama_model_quantize_default_params()
    params.ftype = FTYPES[args.ftype]
    params.nthread = args.threads
    params.allow_requantize = True
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rc = lc.llama_model_quantize(
        str(args.model).encode(), str(args.out).encode(), ctypes.byref(params)
    )
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    return {
        "out": str(args.out),
        "ftype": args.ftype,
        "bytes": args.out.stat().st_size,
        "seconds": time.perf_counter() - start,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-batch", type=int, default=2048, help="tokens per llama_decode")
    parser.add_argument("--n-ubatch", type=int, default=512)
    parser.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="auto")
    parser.add_argument("--kv-unified", action="store_true", help="one KV stream for all sequences")
    parser.add_argument(
        "--prefill",
        choices=["auto", "per-seq", "packed"],
        default="auto",
        help="batched: one llama_decode per prompt, or prompts packed into --n-batch "
        "batches (auto: per-seq without --kv-unified, packed with it)",
    )
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs; medians reported")
    parser.add_argument("--verbose", action="store_true", help="llama.cpp's log on stderr")
    sub = parser.add_subparsers(dest="mode", required=True)
    single = sub.add_parser("single", help="one stream")
    single.add_argument("--prompt-len", type=int, default=SINGLE_PROMPT_LEN)
    batched = sub.add_parser("batched", help="N sequences in one batch")
    batched.add_argument("--n-seqs", type=int, default=DEFAULT_N)
    batched.add_argument("--min-prompt", type=int, default=DEFAULT_LO)
    batched.add_argument("--max-prompt", type=int, default=DEFAULT_HI)
    batched.add_argument("--seed", type=int, default=DEFAULT_SEED)
    batched.add_argument(
        "--prompts-file", type=Path, help="JSON list of token-id lists, instead of the text"
    )
    quant = sub.add_parser("quantize", help="write the model in another GGUF type")
    quant.add_argument("--ftype", choices=sorted(FTYPES), required=True)
    quant.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    lc.llama_backend_init()
    result: dict[str, Any] = {
        "engine": "llama.cpp",
        "mode": args.mode,
        "model": str(args.model),
        "llama_cpp_python": lc.__version__,
        "llama_cpp_version": lc.llama_version().decode(),
        "system_info": lc.llama_print_system_info().decode().strip(),
        "pid_cpus": len(os.sched_getaffinity(0)),
    }
    if args.mode == "quantize":
        result.update(quantize(args))
    else:
        engine = Engine(args)
        if args.mode == "batched" and args.prompts_file is not None:
            prompts = load_prompts(args.prompts_file)
        elif args.mode == "batched":
            text_ids = engine.tokenize(prompt_text())
            prompts = cut_prompts(
                text_ids, args.n_seqs, args.min_prompt, args.max_prompt, args.seed
            )
        else:
            text_ids = engine.tokenize(prompt_text())
            prompts = cut_prompts(text_ids, 1, args.prompt_len, args.prompt_len, DEFAULT_SEED)
        engine.open(prompts)
        engine.warm_up()
        runs: list[dict[str, float]] = []
        for _ in range(args.repeats):
            if args.mode == "single":
                runs.append(run_single(engine, prompts[0], args.new_tokens))
            else:
                runs.append(run_batched(engine, prompts, args.new_tokens))
        result.update(
            {
                "n_seqs": len(prompts),
                "prompt_tokens": sum(len(p) for p in prompts),
                "new_tokens": args.new_tokens,
                "prompts_digest": digest(prompts),
                "context": engine.config,
                **median_of(runs),
            }
        )
        engine.close()
    lc.llama_backend_free()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
