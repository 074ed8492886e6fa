"""The shape of a Llama-family model, read once from its Hugging Face config.

Everything the model code needs is pulled out of the (large, loosely typed)
`PretrainedConfig` into one frozen `ModelSpec`, checked here, so the forward
pass never consults the HF config and an unsupported feature fails at load
time with a message naming it rather than as wrong logits later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# RoPE variants the model implements. "dynamic" (NTK) is deliberately absent:
# its frequencies depend on the current sequence length, which breaks the
# precomputed, position-indexed cos/sin cache a paged KV cache relies on.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    # None when every layer attends to its whole context.
    sliding_window: int | None
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

    @property
    def plain_llama_layers(self) -> bool:
        """Whether every layer is a plain Llama layer: no QK-norm, whole-head
        RoPE in every layer, no residual multiplier (what the compiled decode
        stack implements)."""
        return (
            not self.qk_norm
            and self.rotary_dim == self.head_dim
            and all(self.rope_layers)
            and self.residual_multiplier == 1.0
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest context the model computes exactly.

        The paged attention kernels attend to the whole context, which equals
        sliding-window attention only while the context fits in the window.
        """
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Read and validate a transformers `PretrainedConfig` (or an object like it)."""
        architecture = architecture_of(config)
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelConfigError(f"hidden_act={hidden_act!r} is not supported: expected 'silu'")
        num_heads = int(config.num_attention_heads)
        hidden_size = int(config.hidden_size)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ModelConfigError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}: expected grouped-query attention"
            )
        head_dim = int(getattr(config, "head_dim", None) or hidden_size // num_heads)
        rope_theta, rope_scaling = _rope(config)
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
            sliding_window=_sliding_window(config),
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=_token_ids(getattr(config, "eos_token_id", None)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rotary_dim=_rotary_dim(config, architecture, head_dim),
            rope_layers=_rope_layers(config, num_layers),
            attention_scale=float(getattr(config, "attention_multiplier", None) or head_dim**-0.5),
            embedding_multiplier=float(getattr(config, "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(config, "residual_multiplier", 1.0)),
            logits_divisor=float(getattr(config, "logits_scaling", 1.0)),
            fused_checkpoint_projections=architecture == "Phi3ForCausalLM",
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


def _rope(config: Any) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either config layout.

    transformers 5 folds everything into `rope_parameters`
    ({"rope_theta": ..., "rope_type": ..., <scaling keys>}); older configs keep
    `rope_theta` beside an optional `rope_scaling` dict whose type key is
    "rope_type" or, older still, "type".
    """
    params: Mapping[str, Any] | None = getattr(config, "rope_parameters", None)
    if params is None:
        theta = float(getattr(config, "rope_theta", 10000.0))
        scaling: Mapping[str, Any] = getattr(config, "rope_scaling", None) or {}
    else:
        if "rope_theta" not in params and all(isinstance(v, Mapping) for v in params.values()):
            raise ModelConfigError(
                f"rope_parameters={dict(params)!r} gives each layer type its own RoPE: "
                "expected one set of RoPE parameters for all layers"
            )
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        scaling = params
    return theta, _rope_scaling(scaling)


def _rope_scaling(scaling: Mapping[str, Any]) -> RopeScaling | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        # Phi-3's long-context "su"/"longrope" scaling switches frequency sets
        # with the sequence length, like "dynamic": refused for the same reason.
        raise ModelConfigError(
            f"RoPE type {rope_type!r} (the 'rope_type' of rope_scaling / rope_parameters) "
            f"is not supported: expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
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


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    # Qwen2 configs carry a window even when `use_sliding_window` turns it off.
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
