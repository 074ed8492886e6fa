"""Quantized weights loaded into a small random model: GGUF blocks and int8.

The reference for GGUF blocks is the float model holding the `gguf`
package's dequantization of the same blocks; the quantized model must give
its logits up to float32 rounding. The compiled decode stack must agree
with the Python layers bit for bit, as it does for float weights.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.config import ConfigError
from engine.models.gguf_weights import BlockRows
from engine.models.layers import Linear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.loader import LoadedModel, load_model
from engine.models.weight_plan import FLOAT_WEIGHTS, QuantizationName, WeightPlan, plan_weights
from kernels import cpu_kernels
from kernels.backend import select_backend
from kernels.quant import QuantizedWeight, ShardedWeight, bf16_dot_rows
from tests.unit.engine.models.paged import PagedSequences, allocate, step

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels did not build")

VOCAB = 256
CPU = torch.device("cpu")
_GGML = {
    "q4_1": GGMLQuantizationType.Q4_1,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q8_0": GGMLQuantizationType.Q8_0,
}


def _save(path: Path, tie: bool) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=192,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3 if param.ndim == 1 else param.shape[-1] ** -0.5)
    hf.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("untied"), tie=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("tied"), tie=True)


def _load(path: Path, plan: WeightPlan = FLOAT_WEIGHTS) -> LoadedModel:
    return load_model(
        path, dtype=torch.float32, device=CPU, ops=select_backend(CPU, "torch"), plan=plan
    )


def _as_blocks(
    path: Path, formats: dict[str, str]
) -> tuple[list[tuple[str, torch.Tensor | BlockRows]], dict[str, torch.Tensor]]:
    """The checkpoint with its 2-d weights in GGUF blocks (formats: name piece
    -> format, else q4_1), and the float values those blocks stand for."""
    blocks: list[tuple[str, torch.Tensor | BlockRows]] = []
    floats = {}
    for name, tensor in load_file(str(path / "model.safetensors")).items():
        if tensor.ndim != 2:
            blocks.append((name, tensor))
            floats[name] = tensor
            continue
        fmt = next((f for piece, f in formats.items() if piece in name), "q4_1")
        raw = quants.quantize(tensor.numpy(), _GGML[fmt])
        rows = BlockRows(fmt, torch.from_numpy(raw.copy()), (tensor.shape[0], tensor.shape[1]))
        blocks.append((name, rows))
        floats[name] = rows.to_float()
    return blocks, floats


def _logits(loaded: LoadedModel, tokens: list[list[int]]) -> list[torch.Tensor]:
    seqs = allocate(loaded.model, tokens, block_size=16)
    return list(step(loaded.model, seqs, [(i, 0, len(t)) for i, t in enumerate(tokens)]))


TOKENS = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (9, 1, 33)]


def _reload(path: Path, weights: list[tuple[str, torch.Tensor | BlockRows]]) -> LoadedModel:
    """A model of `path`'s config holding `weights` instead of its checkpoint."""
    loaded = _load(path)
    with torch.inference_mode():
        model = LlamaForCausalLM(loaded.spec, select_backend(CPU, "torch"))
        model.load_weights(iter(weights))
    return dataclasses.replace(loaded, model=model, weight_format=model.weight_format)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gguf_blocks_give_the_float_models_logits(untied, tied, tie: bool) -> None:
    path = tied if tie else untied
    blocks, floats = _as_blocks(path, {"embed_tokens": "q8_0", "lm_head": "q8_0"})
    native = _reload(path, blocks)
    reference = _reload(path, list(floats.items()))
    assert native.model.weight_format == "q4_1+q8_0"
    assert reference.model.weight_format == "float32"
    assert native.model.model.embed_tokens.quant is not None
    if tie:  # one set of blocks serves both
        assert native.model.lm_head.packed is native.model.model.embed_tokens.quant
    for got, want in zip(_logits(native, TOKENS), _logits(reference, TOKENS), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_fused_weight_of_mixed_tile_kinds_runs_as_shards(untied) -> None:
    """Q4_1 q/v with a Q8_0 k (as a Q4_K_M file's Q4_K q/k with a Q6_K v):
    tiles of different kinds stay in their blocks as shards, each
    multiplied into its columns, with the float model's logits; the
    compiled decode stack takes the shards too, bit for bit."""
    blocks, floats = _as_blocks(untied, {"k_proj": "q8_0"})
    native = _reload(untied, blocks)
    attn = cast(LlamaDecoderLayer, native.model.model.layers[0]).self_attn
    packed = attn.qkv_proj.packed
    assert isinstance(packed, ShardedWeight) and packed.format == "q4_1|q8_0|q4_1"
    assert "float32" not in native.model.weight_format
    assert len(native.model.quantized_weights()) == 2 * (3 + 3) + 2  # shards count apart
    reference = _reload(untied, list(floats.items()))
    for got, want in zip(_logits(native, TOKENS), _logits(reference, TOKENS), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    _assert_stack_matches(native.model, batch=9)


def test_a_fused_weight_of_blocks_and_floats_is_expanded(untied) -> None:
    blocks, floats = _as_blocks(untied, {})
    mixed = [(n, floats[n] if "k_proj" in n else t) for n, t in blocks]
    native = _reload(untied, mixed)
    attn = cast(LlamaDecoderLayer, native.model.model.layers[0]).self_attn
    assert not isinstance(attn.qkv_proj.packed, QuantizedWeight | ShardedWeight)
    assert native.model.weight_format.startswith("q4_1+float32")
    reference = _reload(untied, list(floats.items()))
    for got, want in zip(_logits(native, TOKENS), _logits(reference, TOKENS), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_fused_weight_of_one_tile_kind_joins_in_its_blocks(untied) -> None:
    """Q5_0 q/k and a Q8_0 v (Gemma 3 270M's file): both are Q8 tiles, so
    the fused qkv stays in blocks, with the float model's logits."""
    blocks, floats = _as_blocks(untied, {"q_proj": "q5_0", "k_proj": "q5_0", "v_proj": "q8_0"})
    native = _reload(untied, blocks)
    attn = cast(LlamaDecoderLayer, native.model.model.layers[0]).self_attn
    packed = attn.qkv_proj.packed
    assert isinstance(packed, QuantizedWeight) and packed.format == "q5_0/q8_0"
    assert "float32" not in native.model.weight_format
    reference = _reload(untied, list(floats.items()))
    for got, want in zip(_logits(native, TOKENS), _logits(reference, TOKENS), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_int8_quantizes_projections_and_lm_head_only(untied, tied) -> None:
    plan = WeightPlan(gguf=None, quantize="int8")
    loose = _load(untied, plan)
    assert loose.model.model.embed_tokens.quant is None  # looked up, never streamed
    assert isinstance(loose.model.lm_head.packed, QuantizedWeight)
    assert loose.weight_format == "int8"
    bound = _load(tied, plan)
    assert bound.model.model.embed_tokens.quant is bound.model.lm_head.packed
    for loaded, path in ((loose, untied), (bound, tied)):
        float_model = _load(path)
        for got, want in zip(_logits(loaded, TOKENS), _logits(float_model, TOKENS), strict=True):
            cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
            assert cosine.item() > 0.999


def _quantized_models(path: Path) -> Iterator[LoadedModel]:
    yield _load(path, WeightPlan(gguf=None, quantize="bf16"))
    yield _load(path, WeightPlan(gguf=None, quantize="int8"))
    yield _load(path, WeightPlan(gguf=None, quantize="int8", int8_activations=True))


@pytest.mark.parametrize("batch", [1, 9, 37])
def test_decode_stack_matches_the_python_layers(untied, batch: int) -> None:
    for loaded in _quantized_models(untied):
        _assert_stack_matches(loaded.model, batch)


def _assert_stack_matches(model: LlamaForCausalLM, batch: int) -> None:
    stack = model.decode_stack
    assert stack is not None and stack.max_rows >= 37
    lens = [3 + (5 * i) % 40 for i in range(batch)]
    tokens = [[(i + j) % VOCAB for j in range(n + 1)] for i, n in enumerate(lens)]
    seqs = allocate(model, tokens, block_size=16, seed=batch)
    step(model, seqs, [(i, 0, n) for i, n in enumerate(lens)])
    twin = PagedSequences(seqs.tokens, seqs.blocks, seqs.block_size, copy.deepcopy(seqs.kv_caches))
    fast = step(model, seqs, [(i, n, n + 1) for i, n in enumerate(lens)])
    model.decode_stack = None
    slow = step(model, twin, [(i, n, n + 1) for i, n in enumerate(lens)])
    model.decode_stack = stack
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)


def test_bf16_weights_give_the_rounded_models_logits(untied) -> None:
    bf16 = _load(untied, WeightPlan(gguf=None, quantize="bf16"))
    assert bf16.weight_format == "bf16"
    rounded: list[tuple[str, torch.Tensor | BlockRows]] = [
        (name, t.bfloat16().float() if t.ndim == 2 and "embed" not in name else t)
        for name, t in load_file(str(untied / "model.safetensors")).items()
    ]
    reference = _reload(untied, rounded)
    # 10 rows: float32 inputs on every CPU.
    for got, want in zip(_logits(bf16, TOKENS[:2]), _logits(reference, TOKENS[:2]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # 43 rows: where the CPU has AVX512_BF16, from bf16_dot_rows() rows on the
    # inputs are rounded to bfloat16 too (each off by up to 2^-9 of itself).
    dot_rows = bf16_dot_rows()
    rounded_inputs = dot_rows is not None and sum(map(len, TOKENS)) >= dot_rows
    tolerance = 2e-2 if rounded_inputs else 1e-4
    for got, want in zip(_logits(bf16, TOKENS), _logits(reference, TOKENS), strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_every_linear_is_quantized_or_float(untied) -> None:
    loaded = _load(untied, WeightPlan(gguf=None, quantize="int8"))
    for module in loaded.model.modules():
        if isinstance(module, Linear):
            assert isinstance(module.packed, QuantizedWeight)
            assert module.weight.shape == (module.packed.out_features, 0)  # a placeholder


def test_plans() -> None:
    gguf = Path("/models/m.gguf")
    f32 = torch.float32
    assert plan_weights("auto", gguf, f32, CPU) == WeightPlan(gguf=gguf, quantize=None)
    assert plan_weights("auto", None, f32, CPU) == FLOAT_WEIGHTS
    assert plan_weights("auto", gguf, torch.bfloat16, CPU) == FLOAT_WEIGHTS
    assert plan_weights("auto", gguf, f32, torch.device("cuda")) == FLOAT_WEIGHTS
    assert plan_weights("none", gguf, f32, CPU) == FLOAT_WEIGHTS
    assert plan_weights("int8", gguf, f32, CPU, int8_activations=True) == WeightPlan(
        gguf=None, quantize="int8", int8_activations=True
    )
    with pytest.raises(ConfigError, match="not a GGUF file"):
        plan_weights("gguf", None, f32, CPU)
    with pytest.raises(ConfigError, match="CPU only"):
        plan_weights("int8", None, f32, torch.device("cuda"))
    with pytest.raises(ConfigError, match="float32"):
        plan_weights("gguf", gguf, torch.bfloat16, CPU)
    assert plan_weights("auto", gguf, f32, CPU, int8_activations=True) == WeightPlan(
        gguf=gguf, quantize=None, int8_activations=True
    )
    # int8 activations where the weights end up float (or bfloat16) are refused.
    refused: list[tuple[QuantizationName, Path | None]] = [
        ("bf16", gguf),
        ("none", gguf),
        ("auto", None),
    ]
    for quantization, path in refused:
        with pytest.raises(ConfigError, match=f"int8_activations needs quantized.*{quantization}"):
            plan_weights(quantization, path, f32, CPU, int8_activations=True)


def test_block_rows_keep_the_bytes() -> None:
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q4_1)
    rows = BlockRows("q4_1", torch.from_numpy(raw.copy()), (8, 64))
    want = quants.dequantize(raw, GGMLQuantizationType.Q4_1).reshape(8, 64)
    assert torch.equal(rows.to_float(), torch.from_numpy(want))


def test_quantized_weights_share_one_huge_page_buffer(tied) -> None:
    # kernels/huge_pages.py: the loader gathers the blocks a decode step
    # streams into one buffer advised MADV_HUGEPAGE.
    loaded = _load(tied, WeightPlan(gguf=None, quantize="int8"))
    weights = loaded.model.quantized_weights()
    assert len(weights) == 1 + 4 * loaded.spec.num_layers  # tied head once
    storages = {w.packed.untyped_storage().data_ptr() for w in weights}
    assert len(storages) == 1
    start = min(w.packed.data_ptr() for w in weights)
    assert start % (2 * 2**20) == 0
