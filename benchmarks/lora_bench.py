"""Multi-LoRA serving on the default model (issue 21): output tokens/s of 64
requests spread over 8 rank-16 adapters against the same 64 requests on the
base model, in one engine, interleaved (base, lora, base, lora, ...).

The adapters are written here in PEFT's format (random A and B on all seven
projections, rank 16, like a real fine-tune's shapes), and loaded through the
same path a server uses (``LLM.load_lora``: read, check, host cache). The
engine has ``max_loras = 8``, so the 64 requests (8 per adapter, interleaved
in arrival order) run in one batch; the base run is the same prompts with no
adapter, in the same engine (so its decode steps take the compiled decode
stack, as a base-only server's do). A run's figure is output tokens / wall
seconds; the ratio is taken per round against that round's base run, then
the median (min-max).

Also reported: adapter load time (reading and checking the files, then the
first copy into a device slot), and the per-step LoRA cost at batch 1 and 64:
the mean decode step of a batch all under adapters minus that of the same
batch on the base model. The load average is printed before and after every
run: another process on one of the two cores slows a 2-thread torch run
many times over.

    .venv/bin/python benchmarks/lora_bench.py [--rounds 3] [--requests 64]
        [--adapters 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.models.spec import ModelSpec

MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
TOPICS = ["the sea", "a mountain town", "bread", "a library", "trains", "winter", "bees", "maps"]


def write_adapter(path: Path, spec: ModelSpec, rank: int, seed: int) -> None:
    """A PEFT adapter directory with random A and B on every projection."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (in_f, out_f) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "bias": "none",
        "target_modules": list(MODULES),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def load_average() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def run(llm: LLM, prompts: list[str], loras: list[str | None], max_tokens: int) -> float:
    """Output tokens per second of one generate() over all prompts."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds


def step_ms(llm: LLM, prompts: list[str], loras: list[str | None], steps: int) -> float:
    """Mean decode step (ms) of a batch: the whole run's time, less its
    prefill step, over its decode steps (prompts are short: one step)."""
    from engine.sampling_params import SamplingParams

    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, once, lora=loras, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, many, lora=loras, use_tqdm=False)
    return (time.perf_counter() - start - prefill) / steps * 1e3


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from engine.config import LoRAConfig
    from engine.llm import LLM

    llm = LLM(max_model_len=512, lora=LoRAConfig(max_loras=args.adapters, max_lora_rank=args.rank))
    spec = llm.core.info.spec
    assert spec is not None
    names = [f"tenant{i}" for i in range(args.adapters)]
    load_seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, spec, args.rank, seed=i)
        for name in names:
            start = time.perf_counter()
            llm.load_lora(name, str(Path(tmp) / name))
            load_seconds.append(time.perf_counter() - start)
        slots = llm.core.worker.runner.lora
        assert slots is not None
        prompts = [
            f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(args.requests)
        ]
        loras: list[str | None] = [names[i % len(names)] for i in range(args.requests)]
        base: list[str | None] = [None] * args.requests
        run(llm, prompts[:8], loras[:8], 4)  # warm up both paths, fill the slots
        run(llm, prompts[:8], base[:8], 4)
        megabytes = slots._host[1].num_bytes / 2**20  # a figure, not a use
        print(
            f"adapters: {args.adapters} x rank {args.rank} on all 7 projections, "
            f"{megabytes:.1f} MiB each on the host"
        )
        print(
            "load (read + check + host cache): "
            f"median {statistics.median(load_seconds) * 1e3:.0f} ms"
            f" (min {min(load_seconds) * 1e3:.0f}, max {max(load_seconds) * 1e3:.0f})"
        )
        fills = slots.stats
        print(
            f"slot fill (host -> device slot): {fills.load_seconds / fills.slot_loads * 1e3:.1f} ms"
            f" per adapter ({fills.slot_loads} fills)"
        )

        ratios, base_tps, lora_tps = [], [], []
        for r in range(args.rounds):
            print(f"round {r}: {load_average()}", flush=True)
            b = run(llm, prompts, base, args.max_tokens)
            lo = run(llm, prompts, loras, args.max_tokens)
            base_tps.append(b)
            lora_tps.append(lo)
            ratios.append(lo / b)
            print(
                f"  base {b:.1f} tok/s, lora {lo:.1f} tok/s, ratio {lo / b:.3f}; {load_average()}"
            )
        print(
            f"\n{args.requests} requests, {args.max_tokens} tokens each, {args.adapters} adapters:"
        )
        print(f"  base tok/s {summary(base_tps)}")
        print(f"  lora tok/s {summary(lora_tps)}")
        print(f"  lora / base {summary(ratios)}  (target >= 0.8)")

        for batch in (1, 64):
            deltas, base_ms = [], []
            for _ in range(args.rounds):
                b = step_ms(llm, prompts[:batch], base[:batch], 16)
                lo = step_ms(llm, prompts[:batch], loras[:batch], 16)
                deltas.append(lo - b)
                base_ms.append(b)
            print(
                f"batch {batch}: base decode step {summary(base_ms)} ms; "
                f"LoRA cost per step {summary(deltas)} ms ({min(batch, args.adapters)} adapters)"
            )
        print(load_average())


if __name__ == "__main__":
    main()
