"""Write a tiny random HF model as a GGUF file, the way llama.cpp's converter
lays one out: its metadata keys, tensor names (the `gguf` package's own map)
and the default model's tokenizer fields (copied from SmolLM2's GGUF, so the
vocabulary is its 49,152 tokens). Float tensors are written as F32, 2-d
weights optionally in Q8_0 blocks. Granite's and SmolLM3's q/k rows are
permuted as llama.cpp's converter permutes a Llama's (theirs derive from
it); Llama's own is tested on the real file."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from engine.models.loader import default_gguf_path

_ARCHS = {
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "GraniteForCausalLM": gguf.MODEL_ARCH.GRANITE,
    "SmolLM3ForCausalLM": gguf.MODEL_ARCH.SMOLLM3,
}
# Converters that permute q/k rows (llama.cpp's LlamaModel and its children).
_PERMUTED = (gguf.MODEL_ARCH.GRANITE, gguf.MODEL_ARCH.SMOLLM3)


def write_tiny_gguf(
    hf: Any,
    path: Path,
    q8_0: bool = False,
    extra: dict[str, np.ndarray] | None = None,
    strings: dict[str, str] | None = None,
) -> None:
    """``hf``: a transformers model of an architecture in _ARCHS, with the
    default model's vocabulary size; ``extra``: more tensors, by GGUF name;
    ``strings``: more metadata ("{arch}" in a key: the architecture's name)."""
    config = hf.config
    arch = _ARCHS[config.architectures[0]]
    name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(path, name)
    writer.add_string("general.name", f"tiny-{name}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    _copy_tokenizer(writer)
    for key, value in (strings or {}).items():
        writer.add_string(key.format(arch=name), value)
    if arch == gguf.MODEL_ARCH.PHI3:
        _write_phi3_rope(writer, config, head_dim)
    if arch == gguf.MODEL_ARCH.GRANITE:
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in hf.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if arch in _PERMUTED and base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = config.num_attention_heads if "q_proj" in base else config.num_key_value_heads
            values = _permute(values, heads)
        if q8_0 and values.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(values, qtype)
            writer.add_tensor(f"{gguf_name}.{suffix}", blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(values))
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's halves interleaved in pairs
    (its RoPE rotates adjacent dimensions, HF's rotates halves)."""
    rows = weights.shape[0]
    shaped = weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
    return np.ascontiguousarray(shaped.swapaxes(1, 2).reshape(weights.shape))


def _write_phi3_rope(writer: gguf.GGUFWriter, config: Any, head_dim: int) -> None:
    """As llama.cpp's converter writes Phi-3's RoPE: the rotary dims and,
    for LongRoPE, the pretraining length, the attention factor and the
    factors as float32 tensors."""
    params = config.rope_parameters
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotary)
    if params.get("rope_type") != "longrope":
        return
    original = params.get("original_max_position_embeddings") or (
        config.original_max_position_embeddings
    )
    scale = config.max_position_embeddings / original
    attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(attention)
    for kind in ("long", "short"):
        factors = np.asarray(params[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    for key, vtype, value in _tokenizer_fields():
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif vtype == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))


@functools.cache
def _tokenizer_fields() -> tuple[tuple[str, gguf.GGUFValueType, Any], ...]:
    """The default GGUF's tokenizer fields (parsed once: 49,152 tokens)."""
    reader = gguf.GGUFReader(default_gguf_path())
    return tuple(
        (key, field.types[0], field.contents())
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template"
    )


def seeded(hf: Any, seed: int = 0) -> Any:
    """The model's weights redrawn at unit-variance-preserving scales."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in hf.parameters():
            std = 0.3 if param.ndim == 1 else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * std)
            if param.ndim == 1:
                param.add_(1.0)
    return hf.eval()
