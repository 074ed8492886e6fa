"""Putting quantized weights into a model while its checkpoint streams in.

A checkpoint names HF's separate q/k/v and gate/up projections; the model
multiplies fused ones. Float shards are copied into their rows of the fused
weight as they arrive (llama.py's load_weights), but quantized blocks can
only be repacked once the whole fused weight is there, so `QuantizedLoad`
holds a projection's shards until its last one arrives, then hands the
module its `QuantizedWeight`. Only one layer's shards wait at a time in a
checkpoint ordered by layer, so peak memory stays near the quantized model.

What gets quantized: every tensor that arrives in GGUF blocks
(`BlockRows`), and with ``quantize="int8"`` (or ``"bf16"``) every projection and the LM
head (a tied embedding with it, since it is the same matrix; an untied
embedding stays float: it is looked up a row a token, never streamed).
Shards of one fused weight in different GGUF formats are expanded to float32
(int8 mode quantizes that instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from engine.models.gguf_weights import BlockRows
from kernels.quant import QuantizedWeight, from_gguf_rows, quantize_int8, to_bf16

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

Quantize = Literal["int8", "bf16"] | None

# HF projection name piece -> (fused module name piece, shard, the fused weight's shards).
_SHARDS = {
    ".q_proj.": (".qkv_proj.", "q", ("q", "k", "v")),
    ".k_proj.": (".qkv_proj.", "k", ("q", "k", "v")),
    ".v_proj.": (".qkv_proj.", "v", ("q", "k", "v")),
    ".gate_proj.": (".gate_up_proj.", "gate", ("gate", "up")),
    ".up_proj.": (".gate_up_proj.", "up", ("gate", "up")),
}
_EMBEDDING = "model.embed_tokens.weight"


class QuantizedLoad:
    def __init__(
        self, model: LlamaForCausalLM, quantize: Quantize, int8_activations: bool = False
    ) -> None:
        self.model = model
        self.quantize = quantize
        self.int8_activations = int8_activations
        # fused module name -> shard -> what arrived for it
        self.pending: dict[str, dict[str, torch.Tensor | BlockRows]] = {}

    def offer(self, name: str, tensor: torch.Tensor | BlockRows) -> bool:
        """Take `tensor` (HF name `name`, shape already checked) if it is, or
        is to be, quantized; False leaves a float tensor for the caller to copy."""
        if not name.endswith(".weight") or not self._quantizes(name, tensor):
            return False
        module_name, shard = name.removesuffix(".weight"), ""
        shards: tuple[str, ...] = ("",)
        for piece, (fused, part, parts) in _SHARDS.items():
            if piece in name:
                module_name = module_name.replace(piece.rstrip("."), fused.rstrip("."))
                shard, shards = part, parts
        got = self.pending.setdefault(module_name, {})
        got[shard] = tensor
        if set(got) == set(shards):
            del self.pending[module_name]
            self._finish(module_name, [got[s] for s in shards])
        return True

    def _quantizes(self, name: str, tensor: torch.Tensor | BlockRows) -> bool:
        if isinstance(tensor, BlockRows):
            return True
        if self.quantize is None:
            return False
        if name == _EMBEDDING:
            return self.model.spec.tie_word_embeddings
        return "_proj." in name or name == "lm_head.weight"

    def _finish(self, module_name: str, parts: list[torch.Tensor | BlockRows]) -> None:
        module = self.model.get_submodule(module_name)
        formats = {p.format for p in parts if isinstance(p, BlockRows)}
        if len(formats) == 1 and len(parts) == sum(isinstance(p, BlockRows) for p in parts):
            rows = torch.cat([p.rows for p in parts if isinstance(p, BlockRows)])
            in_features = parts[0].shape[1] if isinstance(parts[0], BlockRows) else 0
            weight = from_gguf_rows(rows, formats.pop(), in_features, self.int8_activations)
            self._install(module, module_name, weight)
            return
        floats = torch.cat([p.to_float() if isinstance(p, BlockRows) else p for p in parts])
        if self.quantize == "int8":
            self._install(module, module_name, quantize_int8(floats, self.int8_activations))
            return
        if self.quantize == "bf16":
            self._install(module, module_name, to_bf16(floats))
            return
        # Mixed GGUF formats in one fused weight: float32, like the conversion.
        target = module.weight
        assert isinstance(target, torch.Tensor)
        target.copy_(floats)

    def _install(self, module: nn.Module, name: str, weight: QuantizedWeight) -> None:
        module.set_quantized(weight)  # type: ignore[operator]
        if name == _EMBEDDING.removesuffix(".weight") and self.model.spec.tie_word_embeddings:
            self.model.lm_head.set_quantized(weight)
