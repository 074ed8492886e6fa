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
Shards of one fused weight in different GGUF formats stay in their blocks
(`kernels.quant.join_rows`): tiles of one kind join as they are (Gemma 3
270M's Q5_0 q/k with a Q8_0 v: both Q8 tiles); tiles of different kinds (a
Q4_K_M file's Q4_K q/k with a Q6_K v) stay shards, each multiplied into
its own output columns (`ShardedWeight`). Some in blocks and some float (an
F16 shard, in either order) are expanded to float32 (int8 mode quantizes
that instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from engine.models.gguf_weights import BlockRows
from kernels.quant import (
    BlockWeight,
    from_gguf_rows,
    join_rows,
    quantize_int8,
    to_bf16,
)

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
        # fused module name -> shard -> rows of a float shard the caller
        # copied in before any shard in blocks arrived
        self.in_place: dict[str, dict[str, int]] = {}

    def offer(self, name: str, tensor: torch.Tensor | BlockRows) -> bool:
        """Take `tensor` (HF name `name`, shape already checked) if it is, or
        is to be, quantized, or is a float shard of a fused weight whose
        other shards wait in blocks; False leaves a float tensor for the
        caller to copy."""
        if not name.endswith(".weight"):
            return False
        module_name, shard = name.removesuffix(".weight"), ""
        shards: tuple[str, ...] = ("",)
        for piece, (fused, part, parts) in _SHARDS.items():
            if piece in name:
                module_name = module_name.replace(piece.rstrip("."), fused.rstrip("."))
                shard, shards = part, parts
        if not self._quantizes(name, tensor):
            if shards == ("",) or self.quantize is not None or isinstance(tensor, BlockRows):
                return False
            if module_name not in self.pending:  # the caller copies it into its rows
                placed = self.in_place.setdefault(module_name, {})
                placed[shard] = tensor.shape[0]
                if set(placed) == set(shards):  # all float: nothing waits
                    del self.in_place[module_name]
                return False
        got = self.pending.setdefault(module_name, {})
        got[shard] = tensor
        placed = self.in_place.get(module_name, {})
        if set(got) | set(placed) == set(shards):
            del self.pending[module_name]
            self.in_place.pop(module_name, None)
            self._finish(module_name, [got.get(s, placed.get(s, 0)) for s in shards])
        return True

    def _quantizes(self, name: str, tensor: torch.Tensor | BlockRows) -> bool:
        if isinstance(tensor, BlockRows):
            return True
        if self.quantize is None:
            return False
        if name == _EMBEDDING:
            return self.model.spec.tie_word_embeddings
        return "_proj." in name or name == "lm_head.weight"

    def _finish(self, module_name: str, parts: list[torch.Tensor | BlockRows | int]) -> None:
        """Install a complete fused weight; an int part is a float shard of
        that many rows already copied into its rows of the module's weight."""
        module = self.model.get_submodule(module_name)
        formats = {p.format for p in parts if isinstance(p, BlockRows)}
        if len(formats) == 1 and len(parts) == sum(isinstance(p, BlockRows) for p in parts):
            rows = torch.cat([p.rows for p in parts if isinstance(p, BlockRows)])
            in_features = parts[0].shape[1] if isinstance(parts[0], BlockRows) else 0
            weight = from_gguf_rows(rows, formats.pop(), in_features, self.int8_activations)
            self._install(module, module_name, weight)
            return
        if self.quantize is None:
            blocks = [p for p in parts if isinstance(p, BlockRows)]
            if len(blocks) == len(parts):  # mixed formats: joined or sharded
                shards = [
                    from_gguf_rows(p.rows, p.format, p.shape[1], self.int8_activations)
                    for p in blocks
                ]
                self._install(module, module_name, join_rows(shards))
                return
            # Blocks and floats in one fused weight: float32, like the conversion.
            self._fill_rows(module, parts)
            return
        floats = torch.cat(
            [
                p.to_float() if isinstance(p, BlockRows) else p
                for p in parts
                if not isinstance(p, int)
            ]
        )
        if self.quantize == "int8":
            self._install(module, module_name, quantize_int8(floats, self.int8_activations))
            return
        self._install(module, module_name, to_bf16(floats))

    def _fill_rows(self, module: nn.Module, parts: list[torch.Tensor | BlockRows | int]) -> None:
        """Copy the parts that are not in place yet into their rows, as float."""
        target = module.weight
        assert isinstance(target, torch.Tensor)
        start = 0
        for part in parts:
            if isinstance(part, int):
                start += part
                continue
            values = part.to_float() if isinstance(part, BlockRows) else part
            target[start : start + values.shape[0]].copy_(values)
            start += values.shape[0]

    def _install(self, module: nn.Module, name: str, weight: BlockWeight) -> None:
        module.set_quantized(weight)  # type: ignore[operator]
        if name == _EMBEDDING.removesuffix(".weight") and self.model.spec.tie_word_embeddings:
            self.model.lm_head.set_quantized(weight)
