"""Kernel launches of one decode step on CUDA's code path, counted on a CPU.

A GPU decode step of a small model is launch-bound, so the number of
kernels it launches is the figure to drive down. This counts them without a
GPU: the step runs CUDA's code path (the Triton kernels, under Triton's CPU
interpreter) and every op that would launch a kernel is counted, torch's
through a dispatch mode (ops that only make views or allocate launch
nothing) and Triton's by wrapping the interpreter's launch. On a GPU,
`benchmarks/gpu_check.py` counts the real launches with the profiler.

    python benchmarks/launch_count.py            # Llama-3.2-1B's layer shape

The model is Llama-3.2-1B's layer (hidden 2048, 32 query / 8 KV heads,
head_dim 64, MLP 8192, tied embeddings) at 1 and 2 layers with a small
vocabulary, random weights: launches per layer are the difference, and a
step of the 16-layer model is the 1-layer count plus 15 layers. Batches of
1 and 8 decodes over 40-token contexts. Rows:

- before: torch's per-layer ops (`TORCH_OPS`) beside the Triton attention,
  what the first H100 run had;
- after: the fused Triton layer ops (`TRITON_LAYER_OPS`: norm + residual,
  SiLU-and-mul, RoPE + K/V write one launch each);
- with a CUDA graph, the whole forward is one launch (`cudaGraphLaunch`) and
  only the logits and the sampler launch on their own.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Before triton is first imported: its kernels then run in the interpreter.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.llama import LlamaForCausalLM
from engine.models.spec import ModelSpec
from kernels.backend import select_backend
from kernels.layer_ops import TORCH_OPS, LayerOps
from kernels.metadata import AttentionMetadata

# Ops that launch no kernel on CUDA: views, allocations, metadata.
_NO_KERNEL = (
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "set_",
    "_local_scalar_dense",
    "lift_fresh",
    "detach",
    "alias",
    "_to_copy_meta",
)


class CountAtenOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten ops that launch a kernel, by name; not those the
    Triton interpreter runs to emulate a kernel (``in_triton``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()
        self.in_triton = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self.in_triton and not func.is_view and name not in _NO_KERNEL:
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_triton(mode: CountAtenOps) -> Iterator[None]:
    """Counts each Triton kernel launched (by kernel name) into ``mode``."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode.ops[f"triton.{self.fn.__name__}"] += 1
        mode.in_triton = True
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.in_triton = False

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


def spec(num_layers: int) -> ModelSpec:
    from transformers import LlamaConfig

    shape: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=512,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    return ModelSpec.from_hf_config(config)


def build(num_layers: int, layer_ops: LayerOps) -> LlamaForCausalLM:
    ops = select_backend(torch.device("cpu"), "triton")
    model = LlamaForCausalLM(spec(num_layers), ops, layer_ops=layer_ops)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
    return model


def decode_batch(batch: int, context: int, block_size: int = 16) -> AttentionMetadata:
    blocks = -(-context // block_size)
    table = torch.arange(1, 1 + batch * blocks, dtype=torch.int32).view(batch, blocks)
    slots = (table[:, -1].long() * block_size + (context - 1) % block_size).contiguous()
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_table=table,
        max_query_len=1,
        max_seq_len=context,
        decode_only=True,
    )


def count_step(model: LlamaForCausalLM, batch: int, context: int = 40) -> Counter[str]:
    """Launches of one decode step: the forward, the logits, greedy sampling."""
    s = model.spec
    meta = decode_batch(batch, context)
    num_blocks = int(meta.block_table.max()) + 1
    caches = [
        torch.zeros(2, num_blocks, 16, s.num_kv_heads, s.head_dim) for _ in range(s.num_layers)
    ]
    ids = torch.zeros(batch, dtype=torch.int64)
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    mode = CountAtenOps()
    with torch.inference_mode(), count_triton(mode), mode:
        hidden = model(ids, positions, caches, meta)
        model.compute_logits(hidden).argmax(dim=-1)
    return mode.ops


def per_step(counts: dict[int, Counter[str]], layers: int) -> tuple[int, int]:
    """(launches per layer, per step of a `layers`-layer model)."""
    one, two = sum(counts[1].values()), sum(counts[2].values())
    return two - one, one + (layers - 1) * (two - one)


def report(name: str, layer_ops: LayerOps, batches: tuple[int, ...]) -> dict[int, int]:
    models = {n: build(n, layer_ops) for n in (1, 2)}
    out = {}
    for batch in batches:
        counts = {n: count_step(m, batch) for n, m in models.items()}
        layer, step = per_step(counts, 16)
        out[batch] = step
        print(f"{name:<8} batch {batch:>2}: {layer:>3} launches a layer, {step:>4} a 16-layer step")
        layer_ops_of_one = counts[2] - counts[1]
        print(
            "          per layer: "
            + ", ".join(f"{k} {v}" for k, v in sorted(layer_ops_of_one.items()))
        )
    return out


def main() -> None:
    from kernels.triton_layer_ops import TRITON_LAYER_OPS

    batches = (1, 8)
    before = report("before", TORCH_OPS, batches)
    after = report("after", TRITON_LAYER_OPS, batches)
    graph = graph_step(TRITON_LAYER_OPS)
    for batch in batches:
        print(
            f"batch {batch:>2}: {before[batch]} -> {after[batch]} launches a step "
            f"({before[batch] / after[batch]:.1f}x fewer); with a CUDA graph {graph}"
        )


def graph_step(layer_ops: LayerOps) -> int:
    """Launches of a step whose forward is a graph: the replay, then the
    logits and greedy sampling on their own."""
    model = build(1, layer_ops)
    hidden = torch.zeros(1, model.spec.hidden_size)
    mode = CountAtenOps()
    with torch.inference_mode(), count_triton(mode), mode:
        model.compute_logits(hidden).argmax(dim=-1)
    return 1 + sum(mode.ops.values())


if __name__ == "__main__":
    main()
