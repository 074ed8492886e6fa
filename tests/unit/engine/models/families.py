"""Tiny configs of the model families added after Llama/Mistral/Qwen2, and
the random weights every family test uses (tests/unit/engine/models/
test_llama_vs_transformers.py, tests/e2e/test_llm_families.py)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma3TextConfig,
    GraniteConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
    SmolLM3Config,
)

TINY_VOCAB = 96
# The shape every tiny test model shares (its family's features on top).
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


# Per rotary frequency pair (rotary_dim 12: 6 pairs), as Phi-4-mini's lists.
LONGROPE_SHORT = [1.0, 1.1, 1.3, 1.7, 2.2, 3.0]
LONGROPE_LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]


def family_configs(shape: dict[str, Any]) -> dict[str, PretrainedConfig]:
    """One config per family added after Llama/Mistral/Qwen2, each with its
    odd feature switched on."""
    return {
        # head_dim 24 (not hidden / heads = 16): Qwen3 gives it explicitly.
        "qwen3-qk-norm": Qwen3Config(**shape, head_dim=24, tie_word_embeddings=True),
        "granite-multipliers": GraniteConfig(
            **shape,
            embedding_multiplier=3.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=4.0,
            tie_word_embeddings=True,
        ),
        # Phi-4-mini's RoPE: rotary_dim 12 of head_dim 16, LongRoPE with
        # short factors inside the 64-token pretraining length (every test
        # sequence) and its attention factor (sqrt(1 + ln 2 / ln 64)).
        "phi3-longrope-partial-rotary": Phi3Config(
            **shape,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": LONGROPE_SHORT,
                "long_factor": LONGROPE_LONG,
                "original_max_position_embeddings": 64,
            },
            pad_token_id=0,
            tie_word_embeddings=False,
        ),
        # Layers 1 and 3 of 3 attend to their last 6 tokens, with their own
        # RoPE base; QK-norm, GeGLU, sandwich norms, sqrt(hidden) embeddings.
        "gemma3-sliding-window": Gemma3TextConfig(
            **{**shape, "num_hidden_layers": 3},
            head_dim=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=6,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            query_pre_attn_scalar=24,
            pad_token_id=0,
            tie_word_embeddings=True,
        ),
        # Layers 1 and 3 of 3 use RoPE, layer 2 goes without (1-based interval 2).
        "smollm3-no-rope-layers": SmolLM3Config(
            **{**shape, "num_hidden_layers": 3}, no_rope_layer_interval=2, pad_token_id=0
        ),
    }


def randomize_weights(model: torch.nn.Module) -> None:
    """Weights large enough that logits spread over several units: at HF's
    default init (std 0.02) they are nearly uniform and hide mistakes."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif param.ndim == 1:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)


def architecture_name(config: PretrainedConfig) -> str:
    """The HF model class a tiny config builds (Gemma 3's text config is
    Gemma3TextConfig, its model Gemma3ForCausalLM)."""
    if isinstance(config, Gemma3TextConfig):
        return "Gemma3ForCausalLM"
    return type(config).__name__.replace("Config", "ForCausalLM")
