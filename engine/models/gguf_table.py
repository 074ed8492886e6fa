"""A GGUF file's tensor table, read without parsing its metadata.

The `gguf` package's GGUFReader builds a numpy view for every part of every
metadata field: the default model's tokenizer (49,152 tokens and 48,900
merges) alone makes ~150,000 of them, 6.4 s of each model load. The weights
need none of it: this reader walks past the metadata values (reading only
their lengths), keeps the two keys it needs (the architecture and the data
alignment), reads the tensor infos and maps the file. Types and block sizes
come from the gguf package's constants.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `data` is its bytes (uint8, a view of the mapped file);
    `shape` outermost first (GGUF stores it innermost first)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFTable:
    architecture: str
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, f: BinaryIO, path: Path) -> None:
        self.f = f
        self.path = path

    def _bytes(self, size: int) -> bytes:
        raw = self.f.read(size)
        if len(raw) != size:
            raise ValueError(f"{self.path}: truncated GGUF header")
        return raw

    def read(self, fmt: str) -> int:
        value: int = struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]
        return value

    def string(self) -> str:
        return self._bytes(self.read("<Q")).decode("utf-8")

    def skip_value(self, value_type: int) -> None:
        vtype = GGUFValueType(value_type)
        if vtype == GGUFValueType.STRING:
            self.f.seek(self.read("<Q"), 1)
        elif vtype == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self.read("<I")), self.read("<Q")
            if item_type in _SCALAR_SIZES:
                self.f.seek(count * _SCALAR_SIZES[item_type], 1)
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            self.f.seek(_SCALAR_SIZES[vtype], 1)


def read_gguf_table(path: Path) -> GGUFTable:
    """The tensors of the GGUF at `path`; ValueError if it is not one."""
    with open(path, "rb") as f:
        cur = _Cursor(f, path)
        if f.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = cur.read("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        n_tensors, n_fields = cur.read("<Q"), cur.read("<Q")
        architecture, alignment = "", _DEFAULT_ALIGNMENT
        for _ in range(n_fields):
            key, value_type = cur.string(), cur.read("<I")
            if key == "general.architecture" and value_type == GGUFValueType.STRING:
                architecture = cur.string()
            elif key == "general.alignment" and value_type == GGUFValueType.UINT32:
                alignment = cur.read("<I")
            else:
                cur.skip_value(value_type)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.read("<Q") for _ in range(cur.read("<I"))]
            infos.append((name, GGMLQuantizationType(cur.read("<I")), dims, cur.read("<Q")))
        start = -(-f.tell() // alignment) * alignment
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, tensor_type, dims, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        nbytes = int(np.prod(dims)) // block * block_bytes
        data = mapped[start + offset : start + offset + nbytes]
        if data.size != nbytes:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        tensors.append(GGUFTensor(name, tensor_type, tuple(reversed(dims)), data))
    return GGUFTable(architecture, tensors)
