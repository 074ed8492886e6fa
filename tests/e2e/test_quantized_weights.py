"""Quantized weights on CPU against float32, on real text.

* The default model in its native Q4_1 (+ Q8_0 embedding) blocks generates
  what the float32 expansion of the same file generates, greedily, on the
  exact path (float activations, float32 KV cache).
* int8 per channel on an HF model directory (the default model's float32
  conversion) keeps logits and perplexity close to float32, and bf16
  weights keep perplexity close. The text is
  Newton's *Opticks* as shipped by the apache-tvm-ffi package (a dependency
  of xgrammar): `tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.llm import LLM
from engine.models.loader import LoadedModel, load_model
from engine.models.weight_plan import FLOAT_WEIGHTS, WeightPlan
from engine.sampling_params import SamplingParams
from kernels import cpu_kernels
from kernels.backend import select_backend
from tests.e2e.opticks import opticks_text
from tests.unit.engine.models.paged import allocate, step

MUST_MATCH = 32  # tokens every prompt must share with float32
GENERATED = 36
TEXT_TOKENS = 4096
WINDOW = 1024  # perplexity over four independent windows of the text

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="no C++ toolchain: quantized weights are unavailable"
)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def test_native_q4_1_generates_what_float32_generates(chat_prompts) -> None:
    runs = {}
    for quantization in ("none", "auto"):
        llm = LLM(quantization=quantization, kv_cache_memory=2**26, max_model_len=512, exact=True)
        runs[quantization] = (llm.core.info.weight_format, _greedy(llm, chat_prompts))
        del llm
    assert runs["none"][0] == "float32"
    assert runs["auto"][0] == "q4_1+q8_0"  # the GGUF's own blocks, no float copy
    float32, native = runs["none"][1], runs["auto"][1]
    for i, (want, got) in enumerate(zip(float32, native, strict=True)):
        assert got[:MUST_MATCH] == want[:MUST_MATCH], f"prompt {i} diverges before {MUST_MATCH}"
    later = [
        next((k for k, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        for w, g in zip(float32, native, strict=True)
    ]
    print(f"first divergence past {MUST_MATCH} tokens (None: none in {GENERATED}): {later}")


@pytest.fixture(scope="module")
def models(default_model_path: Path) -> dict[str, LoadedModel]:
    cpu = torch.device("cpu")
    ops = select_backend(cpu, "torch")
    plans = {
        "float32": FLOAT_WEIGHTS,
        "int8": WeightPlan(gguf=None, quantize="int8"),
        "bf16": WeightPlan(gguf=None, quantize="bf16"),
    }
    return {
        name: load_model(default_model_path, dtype=torch.float32, device=cpu, ops=ops, plan=plan)
        for name, plan in plans.items()
    }


def _logits(
    loaded: LoadedModel, tokens: list[list[int]], cache: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Full-sequence logits [len, vocab] of each token list, prefilled in one
    step over a KV cache of `cache`'s dtype."""
    seqs = allocate(loaded.model, tokens, dtype=cache)
    with torch.inference_mode():
        return list(step(loaded.model, seqs, [(i, 0, len(t)) for i, t in enumerate(tokens)]))


def test_int8_logits_stay_close_to_float32(models, chat_prompts) -> None:
    """Each prompt's logits (all positions, all the vocabulary, as one vector)."""
    assert models["int8"].weight_format == "int8"
    float32 = _logits(models["float32"], chat_prompts)
    int8 = _logits(models["int8"], chat_prompts)
    cosines = [
        F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        for a, b in zip(int8, float32, strict=True)
    ]
    print(f"int8 logits' cosine with float32, per prompt: {[round(c, 5) for c in cosines]}")
    assert min(cosines) >= 0.999


def _opticks(tokenizer) -> list[int]:
    ids: list[int] = tokenizer.encode(opticks_text())
    assert len(ids) >= TEXT_TOKENS
    return ids[:TEXT_TOKENS]


def _window_nll(
    loaded: LoadedModel, ids: list[int], cache: torch.dtype = torch.float32
) -> list[tuple[float, int]]:
    """(summed negative log-likelihood, tokens scored) of each window."""
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    out = []
    for window, logits in zip(windows, _logits(loaded, windows, cache), strict=True):
        targets = torch.tensor(window[1:])
        nll = F.cross_entropy(logits[:-1].float(), targets, reduction="sum").item()
        out.append((nll, len(targets)))
    return out


def _perplexity(windows: list[tuple[float, int]]) -> float:
    nll = sum(n for n, _ in windows)
    count = sum(c for _, c in windows)
    return float(torch.exp(torch.tensor(nll / count)))


@pytest.fixture(scope="module")
def float32_windows(models, tokenizer) -> list[tuple[float, int]]:
    return _window_nll(models["float32"], _opticks(tokenizer))


# The weight formats are scored on the text's first half (2,048 tokens: two
# windows), as issue 22 set them; the int8 KV cache on all 4,096, as issue
# 44 asks. Measured against float32 on the first half (2026-11-28): int8
# weights -0.05%, bf16 -0.02% (on 4,096: +0.09%, -0.01%).
WEIGHT_WINDOWS = 2


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_perplexity_within_two_percent(models, tokenizer, float32_windows, fmt: str) -> None:
    """bf16: where the CPU has AVX512_BF16 these 1,024-token windows also
    round the inputs to bfloat16 (kernels/quant.py)."""
    assert models[fmt].weight_format == fmt
    ids = _opticks(tokenizer)[: WEIGHT_WINDOWS * WINDOW]
    got = _perplexity(_window_nll(models[fmt], ids))
    want = _perplexity(float32_windows[:WEIGHT_WINDOWS])
    print(f"perplexity on {len(ids)} tokens: float32 {want:.3f}, {fmt} {got:.3f}")
    assert abs(got - want) / want <= 0.02


def test_an_int8_kv_cache_keeps_perplexity_within_one_percent(
    models, tokenizer, float32_windows
) -> None:
    """Issue 44: the float32 weights over an int8 KV cache (a float32 scale
    per token and head: kernels/kv_int8.py), read in place by the compiled
    prefill kernel, against the same weights over a float32 cache."""
    ids = _opticks(tokenizer)
    got = _perplexity(_window_nll(models["float32"], ids, torch.int8))
    want = _perplexity(float32_windows)
    print(f"perplexity on {len(ids)} tokens: float32 cache {want:.3f}, int8 {got:.3f}")
    assert abs(got - want) / want <= 0.01
