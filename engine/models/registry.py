"""Which Tandem model class serves which Hugging Face architecture name."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with small switches (sliding window, q/k/v bias)
# that ModelSpec captures, so one decoder class serves all three.
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
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
