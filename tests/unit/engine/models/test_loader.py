"""Model resolution, GGUF conversion and the errors a bad model path gets."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.models import loader
from engine.models.layers import Linear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.loader import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    default_gguf_path,
    load_model,
    load_tokenizer,
    resolve_model,
)
from engine.models.registry import UnsupportedModelError, supported_architectures
from engine.models.spec import SUPPORTED_ROPE_TYPES, ModelConfigError, ModelSpec
from engine.models.weight_names import WeightLoadError, hf_parameter_names
from kernels.layer_ops import mkl_packing_available
from tests.unit.engine.models.paged import REFERENCE_OPS, allocate, step

# Seconds each (the real model, the Triton interpreter, child processes or
# Helm renders): left out of `make check`, run by `make test`.
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def _tiny_llama(**overrides) -> LlamaConfig:
    fields: dict[str, Any] = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        architectures=["LlamaForCausalLM"],
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


# --- errors ---------------------------------------------------------------


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path, dtype=torch.float32, device=CPU, ops=REFERENCE_OPS)
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    supported = {
        "Gemma3ForCausalLM",
        "GraniteForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "SmolLM3ForCausalLM",
    }
    for name in supported:
        assert name in message
    assert set(supported_architectures()) == supported


def test_missing_path_says_what_is_expected(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model") as err:
        resolve_model(str(missing))
    assert ".gguf" in str(err.value)
    assert "Hub" in str(err.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_model(tmp_path, dtype=torch.float32, device=CPU, ops=REFERENCE_OPS)


def test_directory_without_weights(tmp_path):
    _tiny_llama().save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFoundError, match=r"model\.safetensors"):
        load_model(tmp_path, dtype=torch.float32, device=CPU, ops=REFERENCE_OPS)


def test_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="float16"):
        load_model(tmp_path, dtype=torch.float16, device=CPU, ops=REFERENCE_OPS)


def _plain_config(**overrides) -> SimpleNamespace:
    """A config as a bare object: ModelSpec must not depend on transformers'
    own validation (which rejects, for example, unknown RoPE types itself)."""
    fields = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=16,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    "config",
    [
        _tiny_llama(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
        _tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
        _plain_config(rope_parameters={"rope_type": "made-up", "rope_theta": 1e4}),
        _plain_config(rope_theta=1e4, rope_scaling={"type": "yarn", "factor": 2.0}),
    ],
    ids=["yarn", "dynamic", "made-up", "legacy-yarn"],
)
def test_unknown_rope_type(config):
    with pytest.raises(ModelConfigError) as err:
        ModelSpec.from_hf_config(config)
    message = str(err.value)
    assert "RoPE type" in message
    for supported in SUPPORTED_ROPE_TYPES:
        assert supported in message


def test_legacy_rope_fields():
    """Configs from before transformers 5: rope_theta beside rope_scaling with "type"."""
    config = _plain_config(
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        eos_token_id=[1, 2],
    )
    spec = ModelSpec.from_hf_config(config)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling is not None
    assert (spec.rope_scaling.rope_type, spec.rope_scaling.factor) == ("linear", 4.0)
    assert spec.eos_token_ids == (1, 2)
    assert spec.head_dim == 8


def test_non_silu_activation_rejected():
    with pytest.raises(ModelConfigError, match="gelu"):
        ModelSpec.from_hf_config(_tiny_llama(hidden_act="gelu"))


def _tiny_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    shapes = {
        "q_proj": (spec.q_size, spec.hidden_size),
        "k_proj": (spec.kv_size, spec.hidden_size),
        "v_proj": (spec.kv_size, spec.hidden_size),
        "o_proj": (spec.hidden_size, spec.q_size),
        "gate_proj": (spec.intermediate_size, spec.hidden_size),
        "up_proj": (spec.intermediate_size, spec.hidden_size),
        "down_proj": (spec.hidden_size, spec.intermediate_size),
        "embed_tokens": (spec.vocab_size, spec.hidden_size),
        "lm_head": (spec.vocab_size, spec.hidden_size),
    }
    weights = {}
    for name in hf_parameter_names(spec):
        piece = name.split(".")[-2]
        weights[name] = torch.randn(shapes.get(piece, (spec.hidden_size,)))
    return weights


def test_load_weights_names_missing_unexpected_and_bad_shapes():
    spec = ModelSpec.from_hf_config(_tiny_llama())
    model = LlamaForCausalLM(spec, REFERENCE_OPS)
    weights = _tiny_weights(spec)
    model.load_weights(weights.items())  # complete: loads
    layer = model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    torch.testing.assert_close(
        layer.self_attn.qkv_proj.weight[spec.q_size : spec.q_size + spec.kv_size],
        weights["model.layers.0.self_attn.k_proj.weight"],
    )
    if model.lops.name == "compiled" and mkl_packing_available():
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed is not None for m in linears)

    partial = dict(weights)
    del partial["model.layers.0.mlp.up_proj.weight"]
    partial["model.layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    partial["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)  # skipped
    with pytest.raises(WeightLoadError) as err:
        model.load_weights(partial.items())
    assert "missing tensors ['model.layers.0.mlp.up_proj.weight']" in str(err.value)
    assert "unexpected tensors ['model.layers.7.mlp.up_proj.weight']" in str(err.value)

    bad = dict(weights)
    bad["model.norm.weight"] = torch.ones(spec.hidden_size + 1)
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight' has shape \(17,\)"):
        model.load_weights(bad.items())


# --- GGUF conversion -------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_dir() == tmp_path / "xdg" / "tandem"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "explicit"))
    assert loader.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert loader.cache_dir() == Path.home() / ".cache" / "tandem"


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"not really gguf")

    def explode(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_into", explode)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(fake))
    assert os.listdir(tmp_path / "cache" / "models") == []

    def succeed(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_convert_into", succeed)
    target = resolve_model(str(fake))
    assert target == tmp_path / "cache" / "models" / "tiny"
    assert sorted(os.listdir(target.parent)) == ["tiny"]

    # A changed source file is converted again, replacing the old directory.
    fake.write_bytes(b"a newer version of the file")
    monkeypatch.setattr(loader, "_convert_into", explode)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(fake))
    monkeypatch.setattr(loader, "_convert_into", succeed)
    assert resolve_model(str(fake)) == target
    assert sorted(os.listdir(target.parent)) == ["tiny"]


@pytest.fixture(scope="module")
def converted():
    """The default model as the set-up (`make model`, the same
    `resolve_model`) converted it into the cache: converting it afresh here
    cost 16 s of the suite, and a conversion that fails fails the set-up.
    The cache's bookkeeping is tested above on a stand-in file."""
    return resolve_model(None), loader.cache_dir()


@pytest.fixture(scope="module")
def hf_gguf_model():
    """transformers' own GGUF load of the default model (the reference).
    It parses the file twice (config, then weights) and rebuilds gguf's
    tensor-name map once per tensor (21 s of the suite): both are pure, so
    they are memoized here; the tensors and the model are what transformers
    makes."""
    import functools

    import gguf as gguf_lib

    path = default_gguf_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_lib, "GGUFReader", functools.cache(gguf_lib.GGUFReader))
        mp.setattr(gguf_lib, "get_tensor_name_map", functools.cache(gguf_lib.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    model.train(False)
    return model


def test_default_model_directory(converted):
    path, cache = converted
    assert path == cache / "models" / DEFAULT_MODEL
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys
        assert f.get_tensor("model.norm.weight").dtype == torch.float32


def test_converted_tensors_match_transformers_gguf_load(converted, hf_gguf_model):
    path, _ = converted
    reference = hf_gguf_model.state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # GGUF permutes Q/K rows
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.17.mlp.gate_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in names:
            torch.testing.assert_close(f.get_tensor(name), reference[name], rtol=0, atol=0)


def test_second_resolve_reuses_cache(converted, monkeypatch):
    path, _ = converted
    before = (path / "model.safetensors").stat().st_mtime_ns

    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted again although the cache is current")

    monkeypatch.setattr(loader, "_convert_into", must_not_convert)
    assert resolve_model(DEFAULT_MODEL) == path
    assert resolve_model(None) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_same_gguf_installed_elsewhere_reuses_cache(converted, monkeypatch, tmp_path):
    # Another virtualenv installs the same file at another path and mtime.
    path, _ = converted
    copy = tmp_path / "elsewhere" / loader.default_gguf_path().name
    copy.parent.mkdir()
    shutil.copy(loader.default_gguf_path(), copy)

    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted again although only the file's location changed")

    monkeypatch.setattr(loader, "_convert_into", must_not_convert)
    monkeypatch.setattr(loader, "default_gguf_path", lambda: copy)
    assert resolve_model(None) == path


def test_default_model_logits_match_transformers(converted, hf_gguf_model):
    path, _ = converted
    loaded = load_model(path, dtype=torch.float32, device=CPU, ops=REFERENCE_OPS)
    assert loaded.name == DEFAULT_MODEL
    assert (loaded.spec.num_layers, loaded.spec.hidden_size) == (30, 576)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(ids) == prompt
    seqs = allocate(loaded.model, [ids], block_size=16)
    (logits,) = step(loaded.model, seqs, [(0, 0, len(ids))])
    with torch.no_grad():
        want = hf_gguf_model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-3)


@pytest.mark.parametrize("rope_type", ["su", "yarn", "longrope"])
def test_phi3_long_context_rope_is_longrope_under_any_of_its_names(rope_type):
    config = _plain_config(
        architectures=["Phi3ForCausalLM"],
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_scaling={"type": rope_type, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
    )
    scaling = ModelSpec.from_hf_config(config).rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert (scaling.factor, scaling.original_max_position_embeddings) == (4.0, 16)
    assert scaling.long_factor == (2.0,) * 4


def test_longrope_without_its_factors_is_refused():
    config = _plain_config(rope_scaling={"type": "longrope", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="longrope needs short_factor and long_factor"):
        ModelSpec.from_hf_config(config)


def test_phi3_partial_rotary_factor_sets_rotary_dim():
    config = _plain_config(
        architectures=["Phi3ForCausalLM"],
        rope_parameters={"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5},
    )
    spec = ModelSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim, spec.fused_checkpoint_projections) == (8, 4, True)


def test_partial_rotary_factor_refused_outside_phi3():
    config = _plain_config(partial_rotary_factor=0.5)
    with pytest.raises(ModelConfigError, match=r"partial_rotary_factor=0\.5"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(no_rope_layers=[1, 0]), "no_rope_layers"),
        (dict(no_rope_layers=[2]), "no_rope_layers"),
        (dict(logits_scaling=0.0), "logits_scaling"),
        (dict(residual_multiplier=-1.0), "residual_multiplier"),
    ],
)
def test_invalid_family_switches_refused(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelSpec.from_hf_config(_plain_config(**overrides))


def test_smollm3_rope_layers_from_interval():
    config = _plain_config(
        architectures=["SmolLM3ForCausalLM"], num_hidden_layers=8, no_rope_layer_interval=4
    )
    spec = ModelSpec.from_hf_config(config)
    assert spec.rope_layers == (True, True, True, False, True, True, True, False)
