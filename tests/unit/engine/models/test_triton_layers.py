"""The decoder on CUDA's per-layer ops (kernels/triton_layer_ops.py: fused
RMSNorm with the residual add, SiLU-and-mul, RoPE fused with the K/V cache
write) against torch's ops, through whole tiny models of each family, in
Triton's CPU interpreter: a prefill chunk, a second chunk over the cached
prefix, then decodes, with logits and KV caches compared at each step.

TRITON_INTERPRET must be set before triton is imported, so the comparisons
run in a child interpreter that prints one JSON report (as the kernel tests
do: tests/unit/kernels/triton_child.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.kernels.triton_child import child_result, start_child

pytestmark = pytest.mark.slow

# (family config, attention backends to run the Triton layer ops beside):
# the reference's everywhere; Triton's attention too where its head_dim
# is a power of two (Qwen3's tiny config has 24).
CASES = {
    "llama": ("reference", "triton"),
    "phi3-longrope-partial-rotary": ("reference", "triton"),
    "qwen3-qk-norm": ("reference",),
    "gemma3-sliding-window": ("reference",),
}
# float32 throughout: the kernels' float32 sums differ from torch's in their
# last bits, which a few layers grow to ~1e-5 (measured: 2e-6 to 9e-6).
TOL = 5e-5


def _config(name: str) -> Any:
    from transformers import LlamaConfig

    from tests.unit.engine.models.families import TINY_SHAPE, architecture_name, family_configs

    config = LlamaConfig(**TINY_SHAPE) if name == "llama" else family_configs(TINY_SHAPE)[name]
    config.architectures = [architecture_name(config)]
    return config


def _load(path: Path, backend: str, triton_layers: bool) -> Any:
    from engine.models.loader import load_model
    from kernels.backend import select_backend
    from kernels.layer_ops import TORCH_OPS
    from kernels.triton_layer_ops import TRITON_LAYER_OPS

    ops = select_backend(torch.device("cpu"), backend)
    layer_ops = TRITON_LAYER_OPS if triton_layers else TORCH_OPS
    return load_model(
        path, dtype=torch.float32, device=torch.device("cpu"), ops=ops, layer_ops=layer_ops
    ).model


def _worst_differences(name: str, backend: str) -> dict[str, float]:
    """Max |logit difference| and max |cache difference| over the steps."""
    from transformers import AutoModelForCausalLM

    from tests.unit.engine.models.families import randomize_weights
    from tests.unit.engine.models.paged import allocate, step

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)  # type: ignore[no-untyped-call]
    randomize_weights(hf)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        want_model = _load(Path(tmp), "reference", triton_layers=False)
        got_model = _load(Path(tmp), backend, triton_layers=True)
    # Fixed tokens (teacher forcing): each step's inputs are the same on both sides.
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 90, (n,), generator=gen).tolist() for n in (24, 12)]
    want = allocate(want_model, tokens, block_size=8)
    got = allocate(got_model, tokens, block_size=8)
    # A chunk, the rest over the cached prefix beside a whole prompt, then decodes.
    steps = [[(0, 0, 13)], [(0, 13, 21), (1, 0, 9)]] + [
        [(0, 21 + k, 22 + k), (1, 9 + k, 10 + k)] for k in range(3)
    ]
    worst = {"logits": 0.0, "cache": 0.0}
    for chunks in steps:
        for a, b in zip(step(want_model, want, chunks), step(got_model, got, chunks), strict=True):
            worst["logits"] = max(worst["logits"], (a - b).abs().max().item())
        for a, b in zip(want.kv_caches, got.kv_caches, strict=True):
            worst["cache"] = max(worst["cache"], (a - b).abs().max().item())
    return worst


def interpreter_report() -> dict[str, Any]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    return {
        f"{name}/{backend}": _worst_differences(name, backend)
        for name, backends in CASES.items()
        for backend in backends
    }


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return dict(child_result(start_child(__name__, "interpreter_report", env)))


@pytest.mark.parametrize("case", [f"{n}/{b}" for n, backends in CASES.items() for b in backends])
def test_triton_layers_match_torchs(report: dict[str, Any], case: str) -> None:
    worst = report[case]
    assert worst["logits"] <= TOL, f"{case}: logits differ by {worst['logits']}"
    assert worst["cache"] <= TOL, f"{case}: KV caches differ by {worst['cache']}"
