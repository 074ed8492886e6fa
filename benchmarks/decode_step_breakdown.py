"""Where a single-stream decode step's time goes, against one read of the weights.

Per round: the read bandwidth (a sum over 512 MB), then 64 decode steps of
one request (64-token prompt), timing the whole engine step, the model's
forward pass and the logits (lm_head) separately; then, for reference, the
layers' linear layers alone (the same 120 weights, one input row each,
called from Python in layer order) and the lm_head alone. Medians per round.

    .venv/bin/python benchmarks/decode_step_breakdown.py --rounds 3
    .venv/bin/python benchmarks/decode_step_breakdown.py --model gemma-3-270m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from offline_throughput import read_bandwidth  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels.quant import QuantizedWeight  # noqa: E402


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        into.append(time.perf_counter() - start)
        return out

    return wrapper


def _in_features(lin: Any) -> int:
    # A quantized linear's float weight is an [out, 0] placeholder.
    packed = lin.packed
    return int(packed.in_features if isinstance(packed, QuantizedWeight) else lin.weight.shape[1])


def _linears_alone(model: Any) -> tuple[float, float]:
    """Seconds for the layers' linears (one row each, in order) and the lm_head."""
    lops = model.lops
    linears = [
        lin
        for layer in model.model.layers
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    inputs = [torch.randn(1, _in_features(lin)) for lin in linears]
    head = model.lm_head
    head_input = torch.randn(1, _in_features(head))
    layer_times, head_times = [], []
    with torch.inference_mode():
        for _ in range(20):
            start = time.perf_counter()
            for lin, x in zip(linears, inputs, strict=True):
                lops.linear(x, lin.weight, lin.bias, lin.packed)
            layer_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            lops.linear(head_input, head.weight, None, head.packed)
            head_times.append(time.perf_counter() - start)
    return statistics.median(layer_times), statistics.median(head_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="as LLM(model=...); default: Tandem's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="auto", help="as LLM(quantization=...)")
    parser.add_argument("--int8-activations", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        **({"model": args.model} if args.model else {}),
        max_model_len=1024,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
    )
    core = llm.core
    model: Any = core.worker.runner.model
    weight_bytes = model.weight_bytes
    print(f"weights: {model.weight_format}, {weight_bytes / 1e6:.0f} MB")
    forward: list[float] = []
    logits: list[float] = []
    steps: list[float] = []
    model.forward = _timed(model.forward, forward)
    model.compute_logits = _timed(model.compute_logits, logits)
    for r in range(args.rounds):
        params = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
        prompt = llm.inputs.process_prompt([100] * 64)
        core.add_request(llm.inputs.make_request(f"breakdown-{r}", prompt, params))
        core.step()  # the prefill
        for times in (forward, logits, steps):
            times.clear()
        for _ in range(64):
            start = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - start)
        while core.has_work():
            core.step()
        layers_alone, head_alone = _linears_alone(model)
        bandwidth = read_bandwidth()
        read = weight_bytes / bandwidth
        ms = {
            name: statistics.median(v) * 1e3
            for name, v in (("step", steps), ("forward", forward), ("logits", logits))
        }
        print(
            f"round {r + 1}: read {bandwidth / 1e9:.1f} GB/s -> {weight_bytes / 1e6:.0f} MB in "
            f"{read * 1e3:.1f} ms | step {ms['step']:.1f} ms ({ms['step'] / (read * 1e3):.2f}x "
            f"the read), forward {ms['forward']:.1f}, logits {ms['logits']:.1f} | alone: layer "
            f"linears {layers_alone * 1e3:.1f}, lm_head {head_alone * 1e3:.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
