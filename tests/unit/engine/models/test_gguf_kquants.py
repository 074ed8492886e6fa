"""A tiny Llama written as a GGUF file with K-quant tensors (Q4_K, Q6_K) and Q5_0.

All stay in their blocks (the compiled kernels multiply them,
kernels/quant.py). The reference is the float model holding the `gguf`
package's dequantization of the same blocks: the loaded model must give its
logits up to float32 rounding.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from transformers import LlamaConfig

from engine.models.gguf_weights import BlockRows, iter_gguf
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.loader import LoadedModel, load_model
from engine.models.weight_plan import WeightPlan
from kernels import cpu_kernels
from kernels.backend import select_backend
from kernels.quant import QuantizedWeight, ShardedWeight
from tests.unit.engine.models.paged import PagedSequences, allocate, step
from tests.unit.kernels.kquant_blocks import Q4_K, Q6_K, random_rows

Q5_0 = GGMLQuantizationType.Q5_0

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels did not build")

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 256, 256, 512, 4, 1, 64
CPU = torch.device("cpu")
TOKENS = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (9, 1, 33)]


def _shapes(layer: int) -> dict[str, tuple[int, int, GGMLQuantizationType]]:
    """GGUF name -> (rows, width, type): layer 0's v and both layers' down
    projections in Q6_K (as llama.cpp's Q4_K_M mixes them), layer 1's o in
    Q5_0 (its fallback for rows that are not whole super-blocks), the rest
    Q4_K."""
    blk = f"blk.{layer}"
    return {
        f"{blk}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN, Q4_K),
        f"{blk}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN, Q4_K),
        f"{blk}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN, Q6_K if layer == 0 else Q4_K),
        f"{blk}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM, Q4_K if layer == 0 else Q5_0),
        f"{blk}.ffn_gate.weight": (INTER, HIDDEN, Q4_K),
        f"{blk}.ffn_up.weight": (INTER, HIDDEN, Q4_K),
        f"{blk}.ffn_down.weight": (HIDDEN, INTER, Q6_K),
    }


@functools.cache
def _raws() -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """GGUF name -> (random blocks, type) of every K-quant tensor."""
    tensors = {"token_embd.weight": (VOCAB, HIDDEN, Q4_K)}
    for layer in range(2):
        tensors.update(_shapes(layer))
    raws = {}
    for seed, (name, (rows, width, qtype)) in enumerate(tensors.items()):
        if qtype == Q5_0:
            values = np.random.default_rng(seed).standard_normal((rows, width)) * width**-0.5
            raws[name] = (quants.quantize(values.astype(np.float32), Q5_0), qtype)
        else:
            raws[name] = (random_rows(qtype, rows, width, seed=seed, std=width**-0.5), qtype)
    return raws


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config directory and `model.gguf` (the weights, `_raws()`'s blocks) in it."""
    path = tmp_path_factory.mktemp("kquants")
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path / "model.gguf", "llama")
    for name, (raw, qtype) in _raws().items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    norms = ["output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "ffn_norm")
    ]
    for name in norms:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _native(path: Path, int8_activations: bool = False) -> LoadedModel:
    plan = WeightPlan(gguf=path / "model.gguf", quantize=None, int8_activations=int8_activations)
    return load_model(
        path, dtype=torch.float32, device=CPU, ops=select_backend(CPU, "torch"), plan=plan
    )


def _reference(loaded: LoadedModel) -> LlamaForCausalLM:
    """The float32 model of gguf's dequantization of the same tensors."""
    weights = [
        (name, t.to_float() if isinstance(t, BlockRows) else t)
        for name, t in iter_gguf(loaded.path / "model.gguf", loaded.spec)
    ]
    with torch.inference_mode():
        model = LlamaForCausalLM(loaded.spec, select_backend(CPU, "torch"))
        model.load_weights(iter(weights))
    return model


def _logits(model: LlamaForCausalLM) -> list[torch.Tensor]:
    seqs = allocate(model, TOKENS, block_size=16)
    return list(step(model, seqs, [(i, 0, len(t)) for i, t in enumerate(TOKENS)]))


def test_k_quant_tensors_read_as_ggufs_values(model_dir: Path) -> None:
    loaded = _native(model_dir)
    raws = {name: raw for name, (raw, _) in _raws().items()}
    got = dict(iter_gguf(model_dir / "model.gguf", loaded.spec))
    up = got["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, BlockRows) and up.format == "q4_k" and up.shape == (INTER, HIDDEN)
    assert np.array_equal(up.rows.numpy(), raws["blk.0.ffn_up.weight"])
    want = quants.dequantize(raws["blk.0.ffn_up.weight"], Q4_K)
    assert torch.equal(up.to_float(), torch.from_numpy(want))
    down = got["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(down, BlockRows) and down.format == "q6_k" and down.shape == (HIDDEN, INTER)
    assert np.array_equal(down.rows.numpy(), raws["blk.1.ffn_down.weight"])
    want = quants.dequantize(raws["blk.1.ffn_down.weight"], Q6_K)
    assert torch.equal(down.to_float(), torch.from_numpy(want))


def test_a_k_quant_gguf_gives_the_float_models_logits(model_dir: Path) -> None:
    native = _native(model_dir)
    model = native.model
    assert native.weight_format == "q4_k+q6_k+q5_0"
    assert model.model.embed_tokens.quant is not None  # Q4_K rows, looked up
    assert model.lm_head.packed is model.model.embed_tokens.quant  # tied
    layers = [layer for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)]
    # Layer 0's q/k (Q4_K) and v (Q6_K) stay shards in their blocks; layer 1's join as Q4_K.
    qkv = layers[0].self_attn.qkv_proj.packed
    assert isinstance(qkv, ShardedWeight) and qkv.format == "q4_k|q4_k|q6_k"
    assert isinstance(layers[1].self_attn.qkv_proj.packed, QuantizedWeight)
    assert isinstance(layers[0].mlp.gate_up_proj.packed, QuantizedWeight)
    o_proj = layers[1].self_attn.o_proj.packed
    assert isinstance(o_proj, QuantizedWeight) and o_proj.format == "q5_0"
    down = layers[0].mlp.down_proj.packed
    assert isinstance(down, QuantizedWeight) and down.format == "q6_k"
    reference = _reference(native)
    for got, want in zip(_logits(model), _logits(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_decode_stack_matches_the_python_layers(model_dir: Path, int8_activations: bool) -> None:
    # Q4_K takes float32 inputs even where int8 activations are asked for.
    model = _native(model_dir, int8_activations).model
    stack = model.decode_stack
    assert stack is not None
    lens = [3 + (5 * i) % 40 for i in range(9)]
    tokens = [[(i + j) % VOCAB for j in range(n + 1)] for i, n in enumerate(lens)]
    seqs = allocate(model, tokens, block_size=16, seed=1)
    step(model, seqs, [(i, 0, n) for i, n in enumerate(lens)])
    twin = PagedSequences(seqs.tokens, seqs.blocks, seqs.block_size, copy.deepcopy(seqs.kv_caches))
    fast = step(model, seqs, [(i, n, n + 1) for i, n in enumerate(lens)])
    model.decode_stack = None
    slow = step(model, twin, [(i, n, n + 1) for i, n in enumerate(lens)])
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)


def test_a_float_shard_may_arrive_before_the_blocks_it_fuses_with(model_dir: Path) -> None:
    native = _native(model_dir)
    weights = list(iter_gguf(model_dir / "model.gguf", native.spec))
    v = next(i for i, (name, _) in enumerate(weights) if name.endswith("0.self_attn.v_proj.weight"))
    # v as a float tensor (as an F16 or F32 shard arrives), before the Q4_K q and k.
    name, blocks = weights[v]
    assert isinstance(blocks, BlockRows)
    reordered = [(name, blocks.to_float()), *weights[:v], *weights[v + 1 :]]
    with torch.inference_mode():
        model = LlamaForCausalLM(native.spec, select_backend(CPU, "torch"))
        model.load_weights(iter(reordered))
    reference = _reference(native)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(
        dict(model.named_parameters())[name], dict(reference.named_parameters())[name]
    )
    for got, want in zip(_logits(model), _logits(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
