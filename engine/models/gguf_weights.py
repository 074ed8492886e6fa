"""A GGUF file's tensors under HF names, the quantized ones left in their blocks.

The float32 conversion (engine/models/loader.py) goes through transformers
and expands every block; this reader hands the model the GGUF's own bytes
for the block formats the CPU kernels multiply (`kernels.quant`: Q4_0,
Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), so a Q4_1 model stays 0.625 bytes a weight
in memory. Other tensors (norms in F32, F16, or block formats the kernels
lack, such as Q5_K) are expanded to float32 with the `gguf` package's own
dequantizer, then take the model's dtype as any float weight does.

llama.cpp's converter permutes the rows of Llama's q and k projections (its
RoPE pairs adjacent dimensions, HF's rotates halves); the reader undoes that
on whole rows, which block-quantized rows allow, exactly as transformers'
GGUF loader does on the float values.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from engine.models.gguf_table import read_gguf_table
from engine.models.spec import ModelSpec

logger = logging.getLogger(__name__)

_BLOCK_FORMATS = {
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q5_0: "q5_0",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q6_K: "q6_k",
}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's sandwich norms: its ffn_norm is the MLP input's norm, which HF
# calls pre_feedforward_layernorm (Llama's post_attention_layernorm).
_IN_GEMMA_LAYER = {
    **_IN_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps its checkpoint's fused projections: q/k/v in one tensor, and
# gate and up in ffn_up (gate first, as in HF's gate_up_proj).
_IN_PHI3_LAYER = {
    **_IN_LAYER,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_IN_LAYER_BY_ARCH = {"gemma3": _IN_GEMMA_LAYER, "phi3": _IN_PHI3_LAYER}
# llama.cpp stores Gemma's norm weights plus one (its RMSNorm multiplies by
# the weight, Gemma's by 1 + weight): the reader takes the one off again, as
# transformers' GGUF loader does, so every source yields HF's values.
_NORM_OFFSET = {"gemma3": 1.0}
# Architectures whose llama.cpp converter permutes q/k rows (its LlamaModel
# and the models derived from it).
_PERMUTED_QK = ("llama", "granite", "smollm3")


@dataclass(frozen=True)
class BlockRows:
    """A 2-d GGUF tensor kept in its blocks: `rows` is uint8 [out, bytes per
    row], standing for a float [out, in] weight in `format`."""

    format: str
    rows: torch.Tensor
    shape: tuple[int, int]

    def to_float(self) -> torch.Tensor:
        """The float32 values, by the gguf package's dequantizer."""
        ggml_type = next(t for t, f in _BLOCK_FORMATS.items() if f == self.format)
        values = quants.dequantize(self.rows.numpy(), ggml_type).astype(np.float32, copy=False)
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.shape)


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor name, or None if unknown."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    in_layer = _IN_LAYER_BY_ARCH.get(architecture, _IN_LAYER)
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in in_layer:
        return f"model.layers.{parts[1]}.{in_layer[parts[2]]}.{parts[3]}"
    return None


def iter_gguf(path: Path, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor | BlockRows]]:
    """(HF name, tensor or BlockRows) for every tensor of the GGUF at `path`;
    a name it cannot map is yielded as-is, for the model to refuse."""
    table = read_gguf_table(path)
    expanded: set[str] = set()
    for tensor in table.tensors:
        name = hf_name(tensor.name, table.architecture) or tensor.name
        shape = tensor.shape
        permuted = table.architecture in _PERMUTED_QK
        rows = _heads_permutation(name, shape[0], spec) if permuted else None
        fmt = _BLOCK_FORMATS.get(tensor.tensor_type)
        if fmt is not None and len(shape) == 2:
            data = torch.from_numpy(np.array(tensor.data)).view(shape[0], -1)
            if rows is not None:
                data = data[rows].contiguous()
            yield name, BlockRows(fmt, data, (shape[0], shape[1]))
            continue
        if tensor.tensor_type != GGMLQuantizationType.F32:
            expanded.add(tensor.tensor_type.name)
        values = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        out = torch.from_numpy(np.array(values)).reshape(shape)
        if name.endswith("norm.weight") and table.architecture in _NORM_OFFSET:
            out -= _NORM_OFFSET[table.architecture]
        yield name, (out[rows].contiguous() if rows is not None else out)
    if expanded:
        logger.info("GGUF tensors in %s expanded to float32 (no kernel)", sorted(expanded))


def _heads_permutation(name: str, rows: int, spec: ModelSpec) -> torch.Tensor | None:
    """The row order undoing llama.cpp's q/k permutation, for q and k tensors."""
    if ".self_attn.q_proj." in name:
        heads = spec.num_heads
    elif ".self_attn.k_proj." in name:
        heads = spec.num_kv_heads
    else:
        return None
    # GGUF row (head, d, pair) holds HF row (head, pair, d).
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2)
    return order.reshape(-1)
