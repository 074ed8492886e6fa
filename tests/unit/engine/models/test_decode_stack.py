"""The compiled layer loop for small decode steps (kernels/csrc/decode_stack.cpp)
against the Python-driven layers it replaces: same kernels, same order, so
the logits and the KV caches it writes must be bit-identical."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from engine.models.loader import LoadedModel, load_model
from kernels import cpu_kernels
from kernels.backend import select_backend
from kernels.layer_ops import (
    PACKED_LINEAR_MAX_ROWS,
    SMALL_LINEAR_ROWS,
    mkl_packing_available,
)
from tests.unit.engine.models.families import architecture_name
from tests.unit.engine.models.paged import PagedSequences, allocate, step

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels did not build"),
]

VOCAB = 300
# head_dim 64 (the decode kernel's smallest instantiation), GQA 3:1.
_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=192,
    intermediate_size=320,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _configs() -> dict[str, PretrainedConfig]:
    """Every family, each with its odd switches on (the stack's options)."""
    return {
        "llama": LlamaConfig(**_SHAPE),
        "llama-bias": LlamaConfig(**_SHAPE, attention_bias=True, mlp_bias=True),
        "qwen2-qkv-bias": Qwen2Config(**_SHAPE),
        # The embedding multiplier and logit divisor apply outside the stack.
        "granite-multipliers": GraniteConfig(
            **_SHAPE,
            embedding_multiplier=3.0,
            attention_multiplier=0.2,
            logits_scaling=4.0,
            residual_multiplier=0.5,
        ),
        "qwen3-qk-norm": Qwen3Config(**_SHAPE),
        "phi3-partial-rotary": Phi3Config(
            **_SHAPE,
            rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5},
            pad_token_id=0,
        ),
        "smollm3-no-rope-layers": SmolLM3Config(**_SHAPE, no_rope_layer_interval=2, pad_token_id=0),
        # A 16-token window (the contexts reach 73) on the local layers,
        # which rotate with their own RoPE base; QK-norm, GeGLU, sandwich norms.
        "gemma3-windowed": Gemma3TextConfig(
            **_SHAPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=16,
            pad_token_id=0,
        ),
    }


def test_no_stack_for_a_head_dim_the_kernels_lack(tmp_path, caplog) -> None:
    config = LlamaConfig(**{**_SHAPE, "head_dim": 32})
    config.architectures = [architecture_name(config)]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ops = select_backend(torch.device("cpu"), "torch")
    with caplog.at_level("INFO", logger="engine.models.llama"):
        loaded = load_model(tmp_path, dtype=torch.float32, device=torch.device("cpu"), ops=ops)
    assert loaded.model.decode_stack is None
    assert "without the compiled decode stack" in caplog.text
    assert "this model's is 32" in caplog.text


@pytest.fixture(scope="module", params=list(_configs()))
def model(request, tmp_path_factory) -> LoadedModel:
    config = _configs()[request.param]
    config.architectures = [architecture_name(config)]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3 if param.ndim == 1 else param.shape[-1] ** -0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ops = select_backend(torch.device("cpu"), "torch")
    return load_model(path, dtype=torch.float32, device=torch.device("cpu"), ops=ops)


def _stack(model: LoadedModel) -> Any:
    stack = model.model.decode_stack
    assert stack is not None, "the model built no decode stack"
    return stack


def _decode(
    model: LoadedModel,
    seqs: PagedSequences,
    lens: list[int],
    use_stack: bool,
    layer_blocks: list[PagedSequences] | None = None,
):
    stack = model.model.decode_stack
    if not use_stack:
        model.model.decode_stack = None
    try:
        return step(model.model, seqs, [(i, n, n + 1) for i, n in enumerate(lens)], layer_blocks)
    finally:
        model.model.decode_stack = stack


def _assert_decodes_match(
    model: LoadedModel,
    seqs: PagedSequences,
    lens: list[int],
    steps: int,
    layer_blocks: list[PagedSequences] | None = None,
) -> None:
    """`steps` decodes with the stack and, on a copy of the caches, without:
    logits and KV caches equal bit for bit after each."""
    for k in range(steps):
        twin = PagedSequences(
            seqs.tokens, seqs.blocks, seqs.block_size, copy.deepcopy(seqs.kv_caches)
        )
        now = [n + k for n in lens]
        fast = _decode(model, seqs, now, use_stack=True, layer_blocks=layer_blocks)
        slow = _decode(model, twin, now, use_stack=False, layer_blocks=layer_blocks)
        for got, want in zip(fast, slow, strict=True):
            assert torch.equal(got, want), f"step {k}: logits differ"
        for got, want in zip(seqs.kv_caches, twin.kv_caches, strict=True):
            assert torch.equal(got, want), f"step {k}: KV caches differ"


# Up to SMALL_LINEAR_ROWS the stack's linears are small_linear; above, MKL's
# packed linear (where torch has MKL), as in the Python layers.
@pytest.mark.parametrize("batch", [1, 3, SMALL_LINEAR_ROWS, SMALL_LINEAR_ROWS + 1, 37])
def test_matches_the_python_layers_bit_for_bit(model: LoadedModel, batch: int) -> None:
    stack = _stack(model)
    if batch > stack.max_rows:
        pytest.skip("no MKL-packed weights in this torch: the stack stops at small batches")
    rng = random.Random(batch)
    lens = [rng.randint(1, 70) for _ in range(batch)]
    tokens = [[rng.randrange(VOCAB) for _ in range(n + 3)] for n in lens]
    seqs = allocate(model.model, tokens, block_size=16, seed=batch)
    step(model.model, seqs, [(i, 0, n) for i, n in enumerate(lens)])  # prefill
    _assert_decodes_match(model, seqs, lens, steps=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_matches_the_python_layers_over_a_narrow_cache(
    model: LoadedModel, dtype: torch.dtype, monkeypatch
) -> None:
    """bfloat16 rows are narrowed, int8 rows quantized with their scale, by
    the stack's own cache write: bit for bit as the Python layers' writers."""
    calls: list[int] = []
    monkeypatch.setattr(model.model, "decode_stack", _Spy(_stack(model), calls))
    lens = [5, 33, 17]
    tokens = [[(7 * i + j) % VOCAB for j in range(n + 3)] for i, n in enumerate(lens)]
    seqs = allocate(model.model, tokens, block_size=16, dtype=dtype, seed=1)
    step(model.model, seqs, [(i, 0, n) for i, n in enumerate(lens)])
    _assert_decodes_match(model, seqs, lens, steps=2)
    assert calls == [3, 3]  # both decodes ran the stack


def test_each_layer_reads_its_kv_cache_groups_blocks(model: LoadedModel, monkeypatch) -> None:
    """With KV cache groups (engine/kv_cache/groups.py: Gemma's windowed and
    global layers), layers hold their group's block ids: the stack takes
    each layer's block table and slots, as the Python layers do."""
    calls: list[int] = []
    monkeypatch.setattr(model.model, "decode_stack", _Spy(_stack(model), calls))
    lens = [5, 40, 23]
    tokens = [[(5 * i + j) % VOCAB for j in range(n + 3)] for i, n in enumerate(lens)]
    first = allocate(model.model, tokens, block_size=16, seed=1)
    other = allocate(model.model, tokens, block_size=16, seed=2)
    assert first.blocks != other.blocks
    groups = [first if i % 2 == 0 else other for i in range(model.spec.num_layers)]
    step(model.model, first, [(i, 0, n) for i, n in enumerate(lens)], groups)
    _assert_decodes_match(model, first, lens, steps=2, layer_blocks=groups)
    assert calls == [3, 3]


def test_takes_decodes_up_to_packed_linear_max_rows_where_mkl_packs(model: LoadedModel) -> None:
    expected = PACKED_LINEAR_MAX_ROWS if mkl_packing_available() else SMALL_LINEAR_ROWS
    assert _stack(model).max_rows == expected


def test_a_batch_over_max_rows_is_refused(model: LoadedModel, monkeypatch) -> None:
    stack = _stack(model)
    # Past the model's own check, the stack still refuses it, naming the bound.
    monkeypatch.setattr(type(model.model), "_decode_stack_for", lambda self, meta, caches: stack)
    lens = [2] * (stack.max_rows + 1)
    seqs = allocate(model.model, [[3] * 3 for _ in lens], block_size=16)
    with pytest.raises(RuntimeError, match=f"the stack takes at most {stack.max_rows}"):
        step(model.model, seqs, [(i, n, n + 1) for i, n in enumerate(lens)])


def test_not_used_for_prefills_or_large_batches(model: LoadedModel, monkeypatch) -> None:
    calls: list[int] = []
    stack = _stack(model)
    monkeypatch.setattr(model.model, "decode_stack", _Spy(stack, calls))
    lens = [5] * (stack.max_rows + 1)
    tokens = [[7] * 8 for _ in lens]
    seqs = allocate(model.model, tokens, block_size=16)
    step(model.model, seqs, [(i, 0, n) for i, n in enumerate(lens)])
    step(model.model, seqs, [(i, n, n + 1) for i, n in enumerate(lens)])
    assert calls == []
    step(model.model, seqs, [(0, 6, 7)])
    assert calls == [1]


def test_a_slot_outside_the_cache_is_refused(model: LoadedModel) -> None:
    seqs = allocate(model.model, [[1] * 4], block_size=16)
    seqs.blocks[0][0] = 10_000  # the decode's slot lands past the cache
    with pytest.raises(RuntimeError, match="outside the cache"):
        step(model.model, seqs, [(0, 3, 4)])


class _Spy:
    def __init__(self, stack, calls: list[int]) -> None:
        self.stack, self.calls = stack, calls

    @property
    def max_rows(self) -> int:
        return int(self.stack.max_rows)

    def forward(self, residual: torch.Tensor, *args):
        self.calls.append(residual.shape[0])
        return self.stack.forward(residual, *args)
