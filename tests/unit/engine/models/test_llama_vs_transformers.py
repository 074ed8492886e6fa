"""Tandem's decoder against transformers' own modeling code on tiny random models.

Each family is saved with `save_pretrained` and loaded back through Tandem's
loader, then driven through a paged cache with shuffled block ids: one batched
prefill, a chunked prefill mixed with decodes, and a run of decode steps. Every
logit row must match transformers' forward over the whole sequence.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.layers import LlamaMLP
from engine.models.llama import rope_cache
from engine.models.loader import LoadedModel, load_model
from engine.models.spec import ModelConfigError, ModelSpec
from engine.models.weight_names import hf_parameter_names
from tests.unit.engine.models.families import (
    TINY_SHAPE,
    TINY_VOCAB,
    architecture_name,
    family_configs,
    randomize_weights,
)
from tests.unit.engine.models.paged import REFERENCE_OPS, allocate, step

ATOL = 1e-4
PROMPT_LENS = (11, 5, 8)
DECODE_STEPS = 3


def _configs() -> dict[str, PretrainedConfig]:
    return {
        # original_max_position_embeddings well inside head_dim 16's wavelength
        # range, so all three llama3 bands (kept, blended, stretched) occur.
        "llama3-rope-untied": LlamaConfig(
            **TINY_SHAPE,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        ),
        "llama-tied-bias": LlamaConfig(
            **TINY_SHAPE, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
        ),
        "mistral-linear-rope": MistralConfig(
            **TINY_SHAPE,
            head_dim=16,
            sliding_window=4096,
            rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
            tie_word_embeddings=False,
        ),
        "qwen2-qkv-bias": Qwen2Config(**TINY_SHAPE, tie_word_embeddings=False),
        **family_configs(TINY_SHAPE),
    }


@pytest.fixture(scope="module", params=list(_configs()))
def family(request, tmp_path_factory):
    """(HF model, saved directory) for one family."""
    config = _configs()[request.param]
    config.architectures = [architecture_name(config)]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation="eager", dtype=torch.float32
    )
    randomize_weights(hf)
    hf.eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@pytest.fixture(scope="module")
def tandem(family) -> LoadedModel:
    return load_model(family[1], dtype=torch.float32, device=torch.device("cpu"), ops=REFERENCE_OPS)


def _sequences(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(n + DECODE_STEPS)] for n in PROMPT_LENS]


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf(input_ids=torch.tensor([tokens])).logits[0]
    return out.float()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"{what}: max |logit diff| {diff:.2e} > {ATOL:.0e}"


def test_parameter_names_match_transformers(family, tandem):
    hf, _ = family
    hf_names = set(hf.state_dict())
    if tandem.spec.tie_word_embeddings:
        hf_names.discard("lm_head.weight")
    assert set(hf_parameter_names(tandem.spec)) == hf_names


def _check_batched_prefill(family, tandem, seed: int) -> None:
    hf, _ = family
    tokens = _sequences(seed)
    seqs = allocate(tandem.model, tokens)
    chunks = [(i, 0, n) for i, n in enumerate(PROMPT_LENS)]
    for (i, _, n), logits in zip(chunks, step(tandem.model, seqs, chunks), strict=True):
        _assert_close(logits, _hf_logits(hf, tokens[i])[:n], f"prefill of sequence {i}")


def test_batched_prefill(family, tandem):
    _check_batched_prefill(family, tandem, seed=2)


def test_prefill_through_the_mlp_in_row_chunks(family, tandem, monkeypatch):
    # Large prefills on CPU run the MLP a chunk of rows at a time; 3 rows per
    # chunk splits every sequence here, ragged last chunk included.
    monkeypatch.setattr(LlamaMLP, "CHUNK_ROWS", 3)
    _check_batched_prefill(family, tandem, seed=8)


def test_chunked_prefill_mixed_with_decode(family, tandem):
    """Step 1: sequence 0 whole, 1 and 2 in part. Step 2: sequence 0 decodes a
    token while 1 and 2 finish their prompts from the cache."""
    hf, _ = family
    tokens = _sequences(seed=3)
    seqs = allocate(tandem.model, tokens, seed=4)
    n0, n1, n2 = PROMPT_LENS
    first = [(0, 0, n0), (1, 0, 2), (2, 0, n2 - 3)]
    second = [(0, n0, n0 + 1), (1, 2, n1), (2, n2 - 3, n2)]
    for chunks in (first, second):
        for (i, start, end), logits in zip(chunks, step(tandem.model, seqs, chunks), strict=True):
            want = _hf_logits(hf, tokens[i])[start:end]
            _assert_close(logits, want, f"sequence {i} tokens {start}:{end}")


def test_decode_steps(family, tandem):
    hf, _ = family
    tokens = _sequences(seed=5)
    seqs = allocate(tandem.model, tokens, seed=6)
    step(tandem.model, seqs, [(i, 0, n) for i, n in enumerate(PROMPT_LENS)])
    want = [_hf_logits(hf, t) for t in tokens]
    for k in range(DECODE_STEPS):
        chunks = [(i, n + k, n + k + 1) for i, n in enumerate(PROMPT_LENS)]
        for (i, start, _), logits in zip(chunks, step(tandem.model, seqs, chunks), strict=True):
            _assert_close(logits[0], want[i][start], f"decode step {k} of sequence {i}")


def test_bfloat16_close_to_float32(family, tandem):
    _, path = family
    bf16 = load_model(path, dtype=torch.bfloat16, device=torch.device("cpu"), ops=REFERENCE_OPS)
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    tokens = _sequences(seed=7)
    chunks = [(i, 0, n) for i, n in enumerate(PROMPT_LENS)]
    ref = step(tandem.model, allocate(tandem.model, tokens), chunks)
    got = step(bf16.model, allocate(bf16.model, tokens, dtype=torch.bfloat16), chunks)
    # Gemma's four norms a layer (weights near 2 here) and sqrt(hidden)
    # embeddings amplify bf16 rounding: transformers' own Gemma 3 in bf16 is
    # off by ~4% of the logit scale on these weights.
    rel = 0.1 if tandem.spec.sandwich_norms else 0.05
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.dtype == torch.float32
        assert torch.isfinite(g).all()
        scale = r.abs().max().item()
        diff = (g - r).abs().max().item()
        assert diff <= rel * scale + 0.05, (
            f"sequence {i}: bf16 off by {diff:.3f} (scale {scale:.2f})"
        )


def test_spec_reads_family_switches(tandem):
    spec: ModelSpec = tandem.spec
    arch = spec.architecture
    assert spec.attention_bias == (arch == "Qwen2ForCausalLM" or spec.o_proj_bias)
    if arch == "MistralForCausalLM":
        assert spec.layer_windows == (4096,) * spec.num_layers
    elif arch == "Gemma3ForCausalLM":
        assert spec.layer_windows == (6, None, 6)
        assert (spec.rope_theta, spec.sliding_rope_theta) == (1_000_000.0, 10_000.0)
        assert (spec.hidden_act, spec.norm_weight_offset, spec.sandwich_norms) == (
            "gelu_tanh",
            1.0,
            True,
        )
        assert spec.embedding_multiplier == spec.hidden_size**0.5
    else:
        assert spec.sliding_window is None
    assert spec.qk_norm == (arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"))
    assert spec.fused_checkpoint_projections == (arch == "Phi3ForCausalLM")
    if arch == "Qwen3ForCausalLM":
        assert (spec.head_dim, spec.num_heads * spec.head_dim) == (24, 96)
    if arch == "GraniteForCausalLM":
        assert (spec.embedding_multiplier, spec.attention_scale) == (3.0, 0.2)
        assert (spec.residual_multiplier, spec.logits_divisor) == (0.5, 4.0)
    elif arch == "Gemma3ForCausalLM":
        assert spec.attention_scale == 24**-0.5  # query_pre_attn_scalar
    else:
        assert spec.attention_scale == spec.head_dim**-0.5
    assert spec.rotary_dim == (12 if arch == "Phi3ForCausalLM" else spec.head_dim)
    want_rope = (True, False, True) if arch == "SmolLM3ForCausalLM" else (True,) * spec.num_layers
    assert spec.rope_layers == want_rope
    assert all(not p.requires_grad for p in tandem.model.parameters())
    assert not tandem.model.training


def test_longrope_table_is_transformers_short_set_inside_and_long_set_past_pretraining():
    """Phi-4-mini's LongRoPE: positions inside the pretraining length rotate
    as transformers' short set, those past it as its long set (which it
    picks for a whole sequence once the sequence outgrows that length),
    both scaled by its attention factor."""
    config = family_configs(TINY_SHAPE)["phi3-longrope-partial-rotary"]
    config.architectures = [architecture_name(config)]
    spec = ModelSpec.from_hf_config(config)
    scaling = spec.rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = init(config, torch.device("cpu"))
    long, _ = init(config, torch.device("cpu"), seq_len=65)
    assert scaling.attention_factor == pytest.approx(factor) and factor > 1.0
    cos, sin = rope_cache(spec, spec.rope_theta, scaling, torch.device("cpu"))
    positions = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    for rows, inv_freq in ((slice(0, 64), short), (slice(64, None), long)):
        angles = torch.outer(positions, inv_freq.float())[rows]
        torch.testing.assert_close(cos[rows], angles.cos() * factor, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[rows], angles.sin() * factor, rtol=0, atol=1e-6)


def test_longrope_factors_must_cover_every_rotary_pair():
    config = family_configs(TINY_SHAPE)["phi3-longrope-partial-rotary"]
    config.architectures = [architecture_name(config)]
    config.rope_parameters = {**config.rope_parameters, "short_factor": [1.0] * 5}
    with pytest.raises(ModelConfigError, match="short_factor has 5 entries: expected"):
        ModelSpec.from_hf_config(config)
