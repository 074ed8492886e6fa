"""The shape of a Llama-family model, read once from its Hugging Face config.

Everything the model code needs is pulled out of the (large, loosely typed)
`PretrainedConfig` into one frozen `ModelSpec`, checked here, so the forward
pass never consults the HF config and an unsupported feature fails at load
time with a message naming it rather than as wrong logits later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# RoPE variants the model implements. "dynamic" (NTK) is deliberately absent:
# its frequencies depend on the current sequence length, which breaks the
# precomputed, position-indexed cos/sin cache a paged KV cache relies on.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class ModelConfigError(ValueError):
    """The model's config asks for something Tandem does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling on top of plain RoPE; `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str
    factor: float = 1.0
    # llama3 (Llama 3.1) only: wavelengths between the two bands are smoothly
    # interpolated, longer ones are divided by `factor`, shorter ones are kept.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3 / Phi-4-mini long context): per-frequency divisors for
    # positions inside the pretraining length and past it, and the factor
    # cos and sin are scaled by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on q/k/v (Qwen2 always; Llama with `attention_bias`) and on o_proj
    # (Llama with `attention_bias` only: Qwen2's o_proj has none).
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # Per layer: how many most recent tokens it attends to (itself included),
    # or None for its whole context (Mistral windows every layer, Gemma 3
    # five layers in six, most families none).
    layer_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Qwen3: RMSNorm (weights [head_dim]) over each head of q and of k, before RoPE.
    qk_norm: bool
    # Leading dims of each head that RoPE rotates (Phi-3's partial_rotary_factor
    # makes it less than head_dim); the rest pass through unrotated.
    rotary_dim: int
    # Per layer: whether it applies RoPE at all (SmolLM3 leaves every
    # no_rope_layer_interval-th layer without position encoding).
    rope_layers: tuple[bool, ...]
    # Softmax scale of q.k (head_dim ** -0.5 unless Granite's attention_multiplier).
    attention_scale: float
    # Granite: embeddings are multiplied by embedding_multiplier, each sublayer's
    # output by residual_multiplier before its residual add, and the logits
    # divided by logits_divisor (its config's logits_scaling).
    embedding_multiplier: float
    residual_multiplier: float
    logits_divisor: float
    # Phi-3 checkpoints store q/k/v as one qkv_proj and gate/up as one
    # gate_up_proj, already in the fused layout the model keeps.
    fused_checkpoint_projections: bool
    # The MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU,
    # the tanh approximation of GELU).
    hidden_act: str = "silu"
    # Gemma scales by (1 + weight) in every RMSNorm: the loader adds this to
    # each checkpoint norm weight, so the norm itself is Llama's.
    norm_weight_offset: float = 0.0
    # Gemma: each sublayer's output is normed before its residual add
    # (post_attention_layernorm, post_feedforward_layernorm) and the MLP's
    # input by pre_feedforward_layernorm.
    sandwich_norms: bool = False
    # RoPE of the windowed layers when they have their own (Gemma 3's local
    # layers: theta 10,000 against the global layers' 1,000,000).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelConfigError(
                f"rotary_dim={self.rotary_dim} is invalid: expected an even number in "
                f"(0, head_dim={self.head_dim}]"
            )
        if len(self.rope_layers) != self.num_layers:
            raise ModelConfigError(
                f"rope_layers has {len(self.rope_layers)} entries: expected one per layer "
                f"({self.num_layers})"
            )
        for name in ("attention_scale", "embedding_multiplier", "residual_multiplier"):
            if not getattr(self, name) > 0:
                raise ModelConfigError(f"{name}={getattr(self, name)!r} is invalid: expected > 0")
        if self.logits_divisor == 0:
            raise ModelConfigError("logits_scaling=0 is invalid: logits are divided by it")
        if len(self.layer_windows) != self.num_layers:
            raise ModelConfigError(
                f"layer_windows has {len(self.layer_windows)} entries: expected one per layer "
                f"({self.num_layers})"
            )
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ModelConfigError(
                f"sliding_window={min(w for w in self.layer_windows if w is not None)} is "
                "invalid: expected at least 1"
            )
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ModelConfigError(
                        f"rope_parameters.{name} has {len(getattr(scaling, name))} entries: "
                        f"expected rotary_dim / 2 = {self.rotary_dim // 2}"
                    )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelConfigError(
                f"hidden_act={self.hidden_act!r} is not supported: expected one of "
                f"{sorted(HIDDEN_ACTS)}"
            )

    @property
    def sliding_window(self) -> int | None:
        """The smallest layer window, None when no layer is windowed."""
        windows = [w for w in self.layer_windows if w is not None]
        return min(windows) if windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Read and validate a transformers `PretrainedConfig` (or an object like it)."""
        architecture = architecture_of(config)
        num_heads = int(config.num_attention_heads)
        hidden_size = int(config.hidden_size)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}: expected grouped-query attention"
            )
        head_dim = int(getattr(config, "head_dim", None) or hidden_size // num_heads)
        rope_theta, rope_scaling, sliding_rope = _rope(config)
        is_gemma3 = architecture == "Gemma3ForCausalLM"
        if is_gemma3:
            _check_gemma3(config)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        num_layers = int(config.num_hidden_layers)
        llama_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(config.vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(config.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=not is_qwen2 and llama_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            layer_windows=_layer_windows(config, num_layers),
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=_token_ids(getattr(config, "eos_token_id", None)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            rotary_dim=_rotary_dim(config, architecture, head_dim),
            rope_layers=_rope_layers(config, num_layers),
            attention_scale=_attention_scale(config, head_dim),
            # Gemma scales the embeddings by sqrt(hidden) in its model code, not its config.
            embedding_multiplier=(
                hidden_size**0.5
                if is_gemma3
                else float(getattr(config, "embedding_multiplier", 1.0))
            ),
            residual_multiplier=float(getattr(config, "residual_multiplier", 1.0)),
            logits_divisor=float(getattr(config, "logits_scaling", 1.0)),
            fused_checkpoint_projections=architecture == "Phi3ForCausalLM",
            hidden_act=_hidden_act(config),
            norm_weight_offset=1.0 if is_gemma3 else 0.0,
            sandwich_norms=is_gemma3,
            sliding_rope_theta=sliding_rope[0] if sliding_rope else None,
            sliding_rope_scaling=sliding_rope[1] if sliding_rope else None,
        )


def architecture_of(config: Any) -> str:
    """The single HF architecture name (e.g. 'LlamaForCausalLM') a config declares."""
    architectures = getattr(config, "architectures", None) or []
    if len(architectures) != 1:
        raise ModelConfigError(
            f"config.architectures={architectures!r} is invalid: expected exactly one "
            "architecture name such as 'LlamaForCausalLM'"
        )
    return str(architectures[0])


def _rope(config: Any) -> tuple[float, RopeScaling | None, tuple[float, RopeScaling | None] | None]:
    """(theta, scaling) of the full-attention layers, and of the windowed
    layers where they have their own, from any config layout.

    transformers 5 folds everything into `rope_parameters`
    ({"rope_theta": ..., "rope_type": ..., <scaling keys>}, or one such dict
    per layer type, as Gemma 3 has); older configs keep `rope_theta` beside
    an optional `rope_scaling` dict whose type key is "rope_type" or, older
    still, "type", and Gemma 3's `rope_local_base_freq`.
    """
    params: Mapping[str, Any] | None = getattr(config, "rope_parameters", None)
    if params is not None and "rope_theta" not in params and params:
        if not all(isinstance(v, Mapping) for v in params.values()):
            raise ModelConfigError(f"rope_parameters={dict(params)!r} is invalid: no rope_theta")
        unknown = set(params) - {"full_attention", "sliding_attention"}
        if unknown or "full_attention" not in params:
            raise ModelConfigError(
                f"rope_parameters has layer types {sorted(params)}: expected 'full_attention' "
                "and optionally 'sliding_attention'"
            )
        full = _theta_and_scaling(params["full_attention"], config)
        sliding = params.get("sliding_attention")
        return (*full, _theta_and_scaling(sliding, config) if sliding is not None else None)
    if params is None:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling: Mapping[str, Any] = getattr(config, "rope_scaling", None) or {}
        local = getattr(config, "rope_local_base_freq", None)
        sliding_rope = (float(local), None) if local is not None else None
        return theta, _rope_scaling(scaling, config), sliding_rope
    return (*_theta_and_scaling(params, config), None)


def _theta_and_scaling(params: Mapping[str, Any], config: Any) -> tuple[float, RopeScaling | None]:
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return theta, _rope_scaling(params, config)


def _rope_scaling(scaling: Mapping[str, Any], config: Any) -> RopeScaling | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("su", "yarn") and architecture_of(config) == "Phi3ForCausalLM":
        rope_type = "longrope"  # Phi-3's older names for it, as transformers reads them
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"RoPE type {rope_type!r} (the 'rope_type' of rope_scaling / rope_parameters) "
            f"is not supported: expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    if rope_type == "longrope":
        return _longrope(scaling, config)
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    return RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _longrope(scaling: Mapping[str, Any], config: Any) -> RopeScaling:
    """LongRoPE as transformers computes it: `factor` defaults to
    max_position_embeddings over the pretraining length, the attention
    factor to sqrt(1 + ln(factor) / ln(pretraining length))."""
    if "short_factor" not in scaling or "long_factor" not in scaling:
        raise ModelConfigError(
            f"rope_scaling={dict(scaling)!r} is invalid: longrope needs short_factor and "
            "long_factor (one divisor per rotary frequency pair)"
        )
    original = int(
        scaling.get(
            "original_max_position_embeddings",
            getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings,
        )
    )
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(x) for x in scaling["short_factor"]),
        long_factor=tuple(float(x) for x in scaling["long_factor"]),
        attention_factor=float(attention),
    )


def _rotary_dim(config: Any, architecture: str, head_dim: int) -> int:
    """head_dim times Phi-3's partial_rotary_factor (in rope_parameters, or
    beside them in older configs); transformers' other families here ignore
    the factor in their default RoPE, so a config that sets it is refused."""
    params: Mapping[str, Any] = getattr(config, "rope_parameters", None) or {}
    factor = float(
        params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    )
    if factor != 1.0 and architecture != "Phi3ForCausalLM":
        raise ModelConfigError(
            f"partial_rotary_factor={factor} is not supported for {architecture}: "
            "expected 1.0 (only Phi3ForCausalLM rotates part of each head)"
        )
    return int(head_dim * factor)


def _rope_layers(config: Any, num_layers: int) -> tuple[bool, ...]:
    """Which layers apply RoPE. SmolLM3's `no_rope_layers` is, despite its
    name, a per-layer flag that is 1 where the layer *uses* RoPE; without it,
    every `no_rope_layer_interval`-th layer (1-based) goes without."""
    flags = getattr(config, "no_rope_layers", None)
    interval = getattr(config, "no_rope_layer_interval", None)
    if flags is None:
        if interval is None:
            return (True,) * num_layers
        flags = [int((i + 1) % int(interval) != 0) for i in range(num_layers)]
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ModelConfigError(
            f"no_rope_layers={list(flags)!r} is invalid: expected one 0 or 1 per layer "
            f"({num_layers})"
        )
    return tuple(bool(f) for f in flags)


def _layer_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window: the config's `sliding_window` for the
    layers `layer_types` calls "sliding_attention", or for every layer when
    the config has no layer types (Mistral); None elsewhere."""
    window = getattr(config, "sliding_window", None)
    # Qwen2 configs carry a window even when `use_sliding_window` turns it off.
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    if len(layer_types) != num_layers:
        raise ModelConfigError(
            f"layer_types has {len(layer_types)} entries: expected one per layer ({num_layers})"
        )
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ModelConfigError(
            f"layer_types {sorted(unknown)} are not supported: expected 'full_attention' "
            "or 'sliding_attention'"
        )
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


# HF activation names -> the MLP gate's activation.
HIDDEN_ACTS = {"silu": "silu", "gelu_tanh": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def _hidden_act(config: Any) -> str:
    # Gemma names it hidden_activation; the others hidden_act.
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in HIDDEN_ACTS:
        raise ModelConfigError(
            f"hidden_act={name!r} is not supported: expected one of {sorted(HIDDEN_ACTS)}"
        )
    return HIDDEN_ACTS[name]


def _attention_scale(config: Any, head_dim: int) -> float:
    """Softmax scale of q.k: Granite's attention_multiplier, Gemma's
    query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
    multiplier = getattr(config, "attention_multiplier", None)
    if multiplier:
        return float(multiplier)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    base = float(scalar) if scalar else float(head_dim)
    return float(base**-0.5)


def _check_gemma3(config: Any) -> None:
    """Refuse the Gemma options this decoder does not implement."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise ModelConfigError(
                f"{name}={getattr(config, name)!r} is not supported: expected None"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelConfigError(
            "use_bidirectional_attention=True is not supported: expected causal attention"
        )


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
