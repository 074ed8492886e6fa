"""Reading a PEFT LoRA adapter directory into the slot layout the model uses.

A PEFT adapter is ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``use_rslora``, ...) and ``adapter_model.safetensors`` holding, per adapted
projection, ``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r]. Tandem's model fuses q/k/v into ``qkv_proj``
and gate/up into ``gate_up_proj``, so an adapter is stored the way the fused
layer applies it (kernels/lora.py): per layer and fused projection, the
shards' A matrices stacked, each padded to ``max_rank`` rows, and one B whose
columns for shard ``j`` hold that shard's B (scaled by alpha / r) in its own
output rows. A projection the adapter does not touch is absent (zeros in a
slot). Every error names the file and, where one is at fault, the key.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.models.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection -> (Tandem's fused projection, the shard it is).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter directory Tandem cannot serve; the message names the file
    (and the key) at fault."""


@dataclass(frozen=True)
class FusedShape:
    """One fused projection: its input width and its shards' output widths."""

    in_features: int
    shard_outs: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.shard_outs)

    def shard_start(self, shard: int) -> int:
        return sum(self.shard_outs[:shard])


def fused_shapes(spec: ModelSpec) -> dict[str, FusedShape]:
    """The four projections of a decoder layer that adapters reach."""
    hidden, inter, kv = spec.hidden_size, spec.intermediate_size, spec.kv_size
    return {
        "qkv_proj": FusedShape(hidden, (spec.q_size, kv, kv)),
        "o_proj": FusedShape(spec.q_size, (hidden,)),
        "gate_up_proj": FusedShape(hidden, (inter, inter)),
        "down_proj": FusedShape(inter, (hidden,)),
    }


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights on the host, in slot layout: ``layers[i][proj]``
    is ``(A [shards * max_rank, in], B [out, shards * max_rank])`` float32."""

    rank: int  # the largest rank of any of its projections
    target_modules: tuple[str, ...]
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]
    digest: str  # sha256 of its two files: the adapter's identity

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def adapter_digest(path: Path) -> str:
    """sha256 over the config and the weights: what the KV cache keys by."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with (path / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_adapter(path: str | Path, spec: ModelSpec, max_rank: int) -> LoRAAdapter:
    """Loads and checks a PEFT adapter for a model of ``spec``."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAAdapterError(f"{directory}: is not a directory (a PEFT adapter is one)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise LoRAAdapterError(f"{directory / name}: missing (a PEFT adapter has {name})")
    alpha, use_rslora = _read_config(directory / CONFIG_FILE)
    pairs = _read_pairs(directory / WEIGHTS_FILE, spec.num_layers)
    shapes = fused_shapes(spec)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
        {} for _ in range(spec.num_layers)
    ]
    rank = 0
    for (layer, module), (a, b, key) in sorted(pairs.items()):
        fused, shard = TARGETS[module]
        shape = shapes[fused]
        r = _check_shapes(directory / WEIGHTS_FILE, key, a, b, shape, shard, max_rank)
        rank = max(rank, r)
        scale = alpha / math.sqrt(r) if use_rslora else alpha / r
        slot_a, slot_b = layers[layer].setdefault(fused, _zeros(shape, max_rank))
        rows = slice(shard * max_rank, shard * max_rank + r)
        slot_a[rows] = a
        start = shape.shard_start(shard)
        slot_b[start : start + shape.shard_outs[shard], rows] = b * scale
    if not pairs:
        raise LoRAAdapterError(
            f"{directory / WEIGHTS_FILE}: holds no LoRA weights of "
            f"{sorted(TARGETS)} (keys like model.layers.0.self_attn.q_proj.lora_A.weight)"
        )
    modules = tuple(sorted({module for _, module in pairs}))
    return LoRAAdapter(rank, modules, tuple(layers), adapter_digest(directory))


def _read_config(path: Path) -> tuple[float, bool]:
    """(lora_alpha, use_rslora), refusing what the slot layout cannot express."""
    try:
        config: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{path}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type={config['peft_type']!r}: expected 'LORA'")
    refused: dict[str, Callable[[Any], bool]] = {
        "bias": lambda v: v not in (None, "none"),
        "use_dora": bool,
        "fan_in_fan_out": bool,
        "modules_to_save": bool,
        "alpha_pattern": bool,
    }
    for key, bad in refused.items():
        if bad(config.get(key)):
            raise LoRAAdapterError(f"{path}: {key}={config[key]!r} is not supported")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAAdapterError(f"{path}: lora_alpha={alpha!r}: expected a positive number")
    return float(alpha), bool(config.get("use_rslora", False))


def _read_pairs(
    path: Path, num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, str]]:
    """(layer, module) -> (A, B, the A key), every key checked."""
    halves: dict[tuple[int, str], dict[str, tuple[torch.Tensor, str]]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                layer, module, half = _parse_key(path, key, num_layers)
                halves.setdefault((layer, module), {})[half] = (f.get_tensor(key).float(), key)
    except (OSError, ValueError, RuntimeError) as e:
        if isinstance(e, LoRAAdapterError):
            raise
        raise LoRAAdapterError(f"{path}: not a readable safetensors file: {e}") from None
    pairs = {}
    for where, got in halves.items():
        missing = {"A", "B"} - set(got)
        if missing:
            key = next(iter(got.values()))[1]
            raise LoRAAdapterError(f"{path}: {key} has no matching lora_{missing.pop()} tensor")
        pairs[where] = (got["A"][0], got["B"][0], got["A"][1])
    return pairs


def _parse_key(path: Path, key: str, num_layers: int) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None or match.group(2) not in TARGETS:
        raise LoRAAdapterError(
            f"{path}: key {key!r} is not a LoRA weight Tandem applies "
            f"(it adapts the decoder layers' {sorted(TARGETS)})"
        )
    layer = int(match.group(1))
    if layer >= num_layers:
        raise LoRAAdapterError(f"{path}: key {key!r}: the model has {num_layers} layers")
    return layer, match.group(2), match.group(3)


def _check_shapes(
    path: Path,
    key: str,
    a: torch.Tensor,
    b: torch.Tensor,
    shape: FusedShape,
    shard: int,
    max_rank: int,
) -> int:
    """The pair's rank, once A is [r, in] and B [out, r] for this model."""
    out = shape.shard_outs[shard]
    if a.dim() != 2 or a.shape[1] != shape.in_features:
        raise LoRAAdapterError(
            f"{path}: {key} has shape {tuple(a.shape)}: expected [r, {shape.in_features}]"
        )
    r = a.shape[0]
    b_key = key.replace("lora_A", "lora_B")
    if tuple(b.shape) != (out, r):
        raise LoRAAdapterError(f"{path}: {b_key} has shape {tuple(b.shape)}: expected {(out, r)}")
    if not 1 <= r <= max_rank:
        raise LoRAAdapterError(
            f"{path}: {key} has rank {r}: this server takes ranks up to "
            f"max_lora_rank={max_rank} (--max-lora-rank)"
        )
    return int(r)


def _zeros(shape: FusedShape, max_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = len(shape.shard_outs) * max_rank
    return torch.zeros(width, shape.in_features), torch.zeros(shape.out_features, width)
