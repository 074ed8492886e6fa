"""Qwen3, Phi-3, Granite and SmolLM3 from GGUF files: tiny random models
written the way llama.cpp lays them out (tests/unit/engine/models/tiny_gguf.py:
its metadata, tensor names, q/k row order, Q8_0 blocks for the 2-d weights,
SmolLM2's tokenizer fields), loaded by `--model <file>.gguf`, run on the
GGUF's blocks, generate what transformers generates from the same file (the
directory Tandem's conversion keeps: transformers' own GGUF loader
dequantizes Qwen3's and Phi-3's; Granite's and SmolLM3's, which that loader
refuses, are read by Tandem, so their weights are also checked against the
model the file was written from), greedy, 32 tokens on 4 prompts. Granite
has its four multipliers, SmolLM3 a layer without RoPE (every 4th: llama.cpp
stores no key for it). Qwen3 has QK-norm; Phi-3 keeps its
fused q/k/v and gate/up in one tensor each (attn_qkv, ffn_up), and this one
is Phi-4-mini's kind: partial rotary (``rope.dimension_count``) and LongRoPE
(its factors as tensors, its pretraining length as metadata), which
transformers' GGUF reader drops and Tandem's conversion reads."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
    SmolLM3Config,
)

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.models.loader import ModelNotFoundError, resolve_model
from engine.models.spec import ModelSpec
from engine.sampling_params import SamplingParams
from tests.e2e.teacher_forcing import greedy_mismatches
from tests.unit.engine.models.families import LONGROPE_LONG, LONGROPE_SHORT, family_configs
from tests.unit.engine.models.tiny_gguf import seeded, write_tiny_gguf

VOCAB = 49152  # the tokenizer's (SmolLM2's, copied into each file)
SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS: dict[str, PretrainedConfig] = {
    # Qwen3's GGUF config has no head_dim: transformers takes its default, 128.
    "qwen3": Qwen3Config(**SHAPE, head_dim=128, tie_word_embeddings=True),
    # The family tests' Granite (its four multipliers), at this file's shape.
    "granite": family_configs(SHAPE)["granite-multipliers"],
    # Four layers: the 4th attends without RoPE (the family tests' SmolLM3
    # takes another interval, which a GGUF cannot say).
    "smollm3": SmolLM3Config(
        **{**SHAPE, "num_hidden_layers": 4}, pad_token_id=0, tie_word_embeddings=False
    ),
    # Rotary dim 12 of head dim 16, six LongRoPE pairs. The pretraining
    # length (128) covers prompt and output: transformers switches a whole
    # sequence to the long factors past it, Tandem a position (see
    # engine/models/llama.py rope_cache).
    "phi3": Phi3Config(
        **SHAPE,
        pad_token_id=0,
        tie_word_embeddings=False,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": LONGROPE_SHORT,
            "long_factor": LONGROPE_LONG,
            "original_max_position_embeddings": 128,
        },
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def gguf_file(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch_module: pytest.MonkeyPatch,
) -> Path:
    config = CONFIGS[request.param]
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    hf = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation="eager", dtype=torch.float32
    )
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    write_tiny_gguf(seeded(hf), path, q8_0=True)
    torch.save(hf.state_dict(), path.with_suffix(".pt"))  # the weights written
    # The conversion's cache, kept out of the user's.
    monkeypatch_module.setenv("TANDEM_CACHE_DIR", str(path.parent / "cache"))
    return path


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_greedy_output_equals_transformers_from_the_same_file(gguf_file: Path) -> None:
    llm = LLM(str(gguf_file), exact=True, max_model_len=256, kv_cache_memory=2**26)
    assert llm.core.info.weight_format == "q8_0"  # the file's blocks, not expanded
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 17, 33, 60)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # transformers' float32 model from the directory Tandem's conversion
    # keeps: the config and tensors its own GGUF loader read from the file
    # (loading the GGUF again would parse it again, for the same values).
    hf: Any = AutoModelForCausalLM.from_pretrained(resolve_model(str(gguf_file)))
    assert greedy_mismatches(hf.eval(), prompts, outputs) == []


def test_the_converted_weights_and_config_are_the_models(gguf_file: Path) -> None:
    """Each tensor of the conversion is the one the file was written from,
    within Q8_0's rounding (half a step of 1/127 of a block's largest value:
    under 0.5% of a tensor's), so names and q/k row order were undone; the
    config holds the family's settings."""
    written = torch.load(gguf_file.with_suffix(".pt"))
    converted: Any = AutoModelForCausalLM.from_pretrained(resolve_model(str(gguf_file)))
    got = converted.state_dict()
    for name, want in written.items():
        if name == "lm_head.weight" and converted.config.tie_word_embeddings:
            continue
        error = (got[name] - want).abs().max() / want.abs().max()
        assert error < 0.005, (name, float(error))
    family = gguf_file.stem.removeprefix("tiny-")
    keys = [
        *("embedding_multiplier", "residual_multiplier", "attention_multiplier"),
        *("logits_scaling", "no_rope_layers", "head_dim", "rms_norm_eps"),
        *("tie_word_embeddings", "num_key_value_heads"),
    ]
    for key in keys:
        if hasattr(CONFIGS[family], key):
            want = getattr(CONFIGS[family], key)  # (the file keeps floats in float32)
            assert getattr(converted.config, key) == pytest.approx(want, rel=1e-6), key
    theta = converted.config.rope_parameters["rope_theta"]
    assert theta == CONFIGS[family].rope_parameters["rope_theta"]


def test_phi3_rope_read_from_the_file(gguf_file: Path) -> None:
    """The converted config holds what llama.cpp wrote: the rotary share and
    LongRoPE's factors (float32 in the file), pretraining length and
    attention factor."""
    if "phi3" not in gguf_file.name:
        pytest.skip("Phi-3's RoPE only")
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(resolve_model(str(gguf_file))))
    want = ModelSpec.from_hf_config(CONFIGS["phi3"])
    assert (spec.rotary_dim, spec.head_dim) == (want.rotary_dim, 16) == (12, 16)
    got, expected = spec.rope_scaling, want.rope_scaling
    assert got is not None and expected is not None and got.rope_type == "longrope"
    assert got.original_max_position_embeddings == 128
    for name in ("short_factor", "long_factor"):
        rounded = tuple(float(np.float32(x)) for x in getattr(expected, name))
        assert getattr(got, name) == rounded
    assert got.attention_factor == pytest.approx(expected.attention_factor, rel=1e-6)


def test_longrope_factors_without_the_pretraining_length_are_refused(
    tmp_path: Path, monkeypatch
) -> None:
    config = Phi3Config(**SHAPE, pad_token_id=0)
    config.architectures = ["Phi3ForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    path = tmp_path / "longrope.gguf"
    factors = np.ones(8, dtype=np.float32)
    extra = {"rope_factors_long.weight": factors, "rope_factors_short.weight": factors}
    write_tiny_gguf(hf, path, extra=extra)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="original_context_length"):
        resolve_model(str(path))


def test_a_file_without_a_chat_template_chats_with_the_option(gguf_file: Path) -> None:
    """The tiny files carry no template (as Gemma 3 270M's): chat is refused
    by name, and served with ``chat_template``."""
    if "qwen3" not in gguf_file.name:
        pytest.skip("one file is enough")
    hello = [{"role": "user", "content": "Hello"}]
    bare = LLM(str(gguf_file), max_model_len=256, kv_cache_memory=2**24)
    with pytest.raises(InvalidRequestError, match="this model has no chat template"):
        bare.chat(hello, use_tqdm=False)
    del bare
    # (Jinja drops a template's last line break: the final one is a literal.)
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{{ '<|im_start|>assistant\\n' }}"
    )
    llm = LLM(str(gguf_file), chat_template=template, max_model_len=256, kv_cache_memory=2**24)
    text = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert llm.chat_prompt(hello) == text
    (out,) = llm.chat(hello, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert out.prompt_token_ids == llm.inputs.tokenize(text) and len(out.token_ids) > 0


@pytest.mark.parametrize(
    ("extra", "strings", "reason"),
    [
        ({}, {"{arch}.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn'"),
        ({"blk.0.attn_q.bias": np.zeros(64, np.float32)}, {}, "tensors its config does not use"),
    ],
    ids=["rope-scaling", "unknown-tensor"],
)
def test_what_tandems_own_reader_cannot_take_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: Any, strings: Any, reason: str
) -> None:
    """Granite's and SmolLM3's files are read by Tandem's reader: a RoPE
    scaling it does not take, or a tensor the config has no place for, is
    refused by name, never run as plain RoPE or dropped."""
    config = SmolLM3Config(**SHAPE, pad_token_id=0)
    config.architectures = ["SmolLM3ForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    path = tmp_path / "smollm3.gguf"
    write_tiny_gguf(hf, path, extra=extra, strings=strings)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match=reason):
        resolve_model(str(path))
