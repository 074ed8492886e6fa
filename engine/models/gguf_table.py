"""A GGUF file's tensor table, read without parsing its metadata.

The `gguf` package's GGUFReader builds a numpy view for every part of every
metadata field: the default model's tokenizer (49,152 tokens and 48,900
merges) alone makes ~150,000 of them, 6.4 s of each model load. The weights
need none of it: this reader walks past the metadata values (reading only
their lengths), keeps the scalar ones (numbers and strings: the
architecture, the data alignment, a few hyperparameters transformers'
reader drops), reads the tensor infos and maps the file. Types and block sizes
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

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `data` is its bytes (uint8, a view of the mapped file);
    `shape` outermost first (GGUF stores it innermost first)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


Scalar = int | float | bool | str


@dataclass(frozen=True)
class GGUFTable:
    architecture: str
    tensors: list[GGUFTensor]
    # Metadata keys whose values are one number or string (arrays skipped).
    scalars: dict[str, Scalar]

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)


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

    def scalar(self, value_type: int) -> Scalar | None:
        """The value of a scalar type (None, skipped, for an array)."""
        vtype = GGUFValueType(value_type)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            self.skip_value(value_type)
            return None
        value: Scalar = struct.unpack(_SCALAR_FORMATS[vtype], self._bytes(_SCALAR_SIZES[vtype]))[0]
        return bool(value) if vtype == GGUFValueType.BOOL else value

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
        scalars: dict[str, Scalar] = {}
        for _ in range(n_fields):
            key, value_type = cur.string(), cur.read("<I")
            value = cur.scalar(value_type)
            if value is not None:
                scalars[key] = value
        architecture = scalars.get("general.architecture", "")
        alignment = scalars.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(architecture, str) or not isinstance(alignment, int):
            raise ValueError(f"{path}: general.architecture or general.alignment has a bad type")
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
    return GGUFTable(architecture, tensors, scalars)
