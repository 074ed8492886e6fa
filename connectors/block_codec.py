"""How a KV block is named and framed in a content-addressed store.

Name: the block's hash-chain value (``engine.kv_cache.hashing``: the same
prefix gives the same hashes in every process and pod) under a namespace of
the model, the dtype and the block layout, so any pod serving the same model
with the same layout finds any other's blocks, and no other pod does.

Frame: a 32-byte header (magic, payload length, xxh3-64 checksum of the
payload, layout digest), then the payload: for each layer, K then V of the
block, ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` in the cache
dtype. A frame that is short, long, from another layout or fails its
checksum is rejected, and the block is recomputed instead.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from connectors.base import KVLayout

MAGIC = b"TKV1"
_HEADER = struct.Struct("<4sIQQ8s")  # magic, flags, payload bytes, checksum, layout digest
HEADER_BYTES = _HEADER.size
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class FrameError(ValueError):
    """A stored block is unusable; the message says why."""


@dataclass(frozen=True)
class BlockCodec:
    """Keys and frames for one (model, layout)."""

    model_name: str
    layout: KVLayout

    @property
    def namespace(self) -> str:
        """Short hex digest of what a block must match to be reused."""
        lay = self.layout
        ident = (
            f"tandem-kv-v1|{self.model_name}|{lay.dtype}|L{lay.num_layers}"
            f"|H{lay.num_kv_heads}|D{lay.head_dim}|B{lay.block_size}"
        )
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    @property
    def payload_bytes(self) -> int:
        lay = self.layout
        return 2 * lay.num_layers * lay.elements_per_layer_half * _ITEMSIZE[lay.dtype]

    @property
    def frame_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def digest_key(self, block_hash: bytes) -> bytes:
        """A fixed 32-byte key (for stores with fixed-size keys)."""
        return hashlib.sha256(self.namespace.encode() + block_hash).digest()

    def text_key(self, block_hash: bytes, prefix: str = "") -> str:
        """A readable key (for Redis): prefix, namespace, block hash."""
        return f"{prefix}kv:{self.namespace}:{block_hash.hex()}"

    def header(self, payload: bytes | memoryview) -> bytes:
        return _HEADER.pack(
            MAGIC,
            0,
            len(payload),
            xxhash.xxh3_64_intdigest(payload),
            bytes.fromhex(self.namespace[:16]),
        )

    def seal(self, frames: npt.NDArray[np.uint8]) -> None:
        """Write the header of each row of ``frames`` ([n, frame_bytes], the
        payload already after HEADER_BYTES), in place."""
        if frames.ndim != 2 or frames.shape[1] != self.frame_bytes:
            raise ValueError(f"frames: expected rows of {self.frame_bytes} bytes")
        for row in frames:
            row[:HEADER_BYTES] = np.frombuffer(self.header(row[HEADER_BYTES:].data), np.uint8)

    def seal_rows(self, frames: npt.NDArray[np.uint8], rows: list[int]) -> None:
        """Like seal, for the given rows of a larger array (rows at least
        frame_bytes long; the frame is the first frame_bytes of each)."""
        end = self.frame_bytes
        for r in rows:
            frames[r, :HEADER_BYTES] = np.frombuffer(
                self.header(frames[r, HEADER_BYTES:end].data), np.uint8
            )

    def encode(self, payload: bytes | memoryview) -> bytes:
        return self.header(payload) + bytes(payload)

    def check(self, frame: bytes | memoryview) -> memoryview:
        """The payload of a stored frame, or FrameError saying what is wrong."""
        view = memoryview(frame)
        if len(view) < HEADER_BYTES:
            raise FrameError(f"frame of {len(view)} bytes is shorter than its header")
        magic, _flags, length, checksum, layout = _HEADER.unpack_from(view)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if layout != bytes.fromhex(self.namespace[:16]):
            raise FrameError("frame is from another model or layout")
        if length != self.payload_bytes or len(view) != HEADER_BYTES + length:
            raise FrameError(
                f"frame holds {len(view) - HEADER_BYTES} payload bytes, header says {length}, "
                f"the layout needs {self.payload_bytes}"
            )
        payload = view[HEADER_BYTES:]
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise FrameError("checksum mismatch")
        return payload
