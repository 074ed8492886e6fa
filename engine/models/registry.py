"""Which Tandem model class serves which Hugging Face architecture name."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# Mistral, Qwen2, Qwen3, Granite, Phi-3, SmolLM3 and Gemma 3 are Llama with
# switches (sliding windows, q/k/v bias, QK-norm, multipliers, fused
# checkpoint projections, partial or skipped RoPE, GeGLU, sandwich norms)
# that ModelSpec captures, so one decoder class serves them all.
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no Tandem implementation."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported: expected one of "
            f"{', '.join(supported_architectures())}"
        ) from None
