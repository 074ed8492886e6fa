"""Which HF checkpoint tensors a model of a given spec has, and where each goes.

Tandem fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; a
checkpoint's separate projections fill rows of those (Phi-3 stores them
fused already).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.spec import ModelSpec


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the model built from its config."""


# HF projection name -> (fused parameter name, which shard of it).
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


def _shard_rows(shard: str, spec: ModelSpec) -> tuple[int, int]:
    """(first row, row count) of a shard inside its fused weight."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    return {
        "q": (0, q),
        "k": (q, kv),
        "v": (q + kv, kv),
        "gate": (0, inter),
        "up": (inter, inter),
    }[shard]


def destination(name: str, params: dict[str, nn.Parameter], spec: ModelSpec) -> torch.Tensor | None:
    """The parameter (or the rows of a fused one) that HF tensor `name` fills."""
    for piece, (fused, shard) in _FUSED.items():
        if piece in name:
            param = params.get(name.replace(piece, fused))
            if param is None:
                return None
            start, length = _shard_rows(shard, spec)
            return param.narrow(0, start, length)
    return params.get(name)


def is_ignored(name: str, spec: ModelSpec) -> bool:
    # inv_freq is recomputed from the config; a tied checkpoint that still
    # stores lm_head holds a copy of the embedding we already load; a GGUF's
    # LongRoPE factors were read into the config (engine/models/loader.py).
    return (
        name.endswith("rotary_emb.inv_freq")
        or name.startswith("rope_factors_")
        or (spec.tie_word_embeddings and name == "lm_head.weight")
    )


def check_complete(missing: set[str], unexpected: list[str]) -> None:
    problems = []
    if missing:
        problems.append(f"missing tensors {sorted(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {sorted(unexpected)}")
    if problems:
        raise WeightLoadError("checkpoint does not match the model config: " + "; ".join(problems))


def hf_parameter_names(spec: ModelSpec) -> list[str]:
    """The HF checkpoint tensor names a model of this spec needs (lm_head only if untied)."""
    fused = spec.fused_checkpoint_projections
    attention = ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj")
    mlp = ("gate_up_proj", "down_proj") if fused else ("gate_proj", "up_proj", "down_proj")
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        for proj in attention:
            names += _linear_names(f"{prefix}self_attn.{proj}", spec.attention_bias)
        names += _linear_names(f"{prefix}self_attn.o_proj", spec.o_proj_bias)
        if spec.qk_norm:
            names += [f"{prefix}self_attn.q_norm.weight", f"{prefix}self_attn.k_norm.weight"]
        for proj in mlp:
            names += _linear_names(f"{prefix}mlp.{proj}", spec.mlp_bias)
        norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
        if spec.sandwich_norms:
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        names += [f"{prefix}{norm}.weight" for norm in norms]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _linear_names(prefix: str, bias: bool) -> list[str]:
    return [f"{prefix}.weight", f"{prefix}.bias"] if bias else [f"{prefix}.weight"]
