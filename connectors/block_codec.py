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

Batches: ``seal_rows`` writes headers from checksums the compiled block
copy computed while copying (``KVBlockIO.gather_rows_xxh3``), and
``check_headers`` checks headers, leaving the checksum to the compiled copy
into the cache (``KVBlockIO.scatter_rows_xxh3``): Python never hashes a
payload on those paths, and packs or unpacks one small struct per block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

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

    @cached_property
    def namespace(self) -> str:
        """Short hex digest of what a block must match to be reused."""
        lay = self.layout
        ident = (
            f"tandem-kv-v1|{self.model_name}|{lay.dtype}|L{lay.num_layers}"
            f"|H{lay.num_kv_heads}|D{lay.head_dim}|B{lay.block_size}"
        )
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    @cached_property
    def layout_digest(self) -> bytes:
        """The header's layout field: the namespace's first 8 bytes."""
        return bytes.fromhex(self.namespace[:16])

    @cached_property
    def payload_bytes(self) -> int:
        lay = self.layout
        return 2 * lay.num_layers * lay.elements_per_layer_half * _ITEMSIZE[lay.dtype]

    @cached_property
    def frame_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @cached_property
    def _key_hasher(self) -> hashlib._Hash:
        return hashlib.sha256(self.namespace.encode())

    def digest_key(self, block_hash: bytes) -> bytes:
        """A fixed 32-byte key (for stores with fixed-size keys)."""
        hasher = self._key_hasher.copy()  # the namespace already hashed in
        hasher.update(block_hash)
        return hasher.digest()

    def text_key(self, block_hash: bytes, prefix: str = "") -> str:
        """A readable key (for Redis): prefix, namespace, block hash."""
        return f"{prefix}kv:{self.namespace}:{block_hash.hex()}"

    def header(self, payload: bytes | memoryview) -> bytes:
        return _HEADER.pack(
            MAGIC,
            0,
            len(payload),
            xxhash.xxh3_64_intdigest(payload),
            self.layout_digest,
        )

    def seal(self, frames: npt.NDArray[np.uint8], checksums: Sequence[int] | None = None) -> None:
        """Write the header of each row of ``frames`` ([n, frame_bytes], the
        payload already after HEADER_BYTES), in place; ``checksums``: the
        payloads' xxh3-64 if the caller has them (else computed here)."""
        if frames.ndim != 2 or frames.shape[1] != self.frame_bytes:
            raise ValueError(f"frames: expected rows of {self.frame_bytes} bytes")
        self.seal_rows(frames, range(len(frames)), checksums)

    def seal_rows(
        self,
        frames: npt.NDArray[np.uint8],
        rows: Sequence[int],
        checksums: Sequence[int] | None = None,
    ) -> None:
        """Like seal, for the given rows of a larger C-contiguous array (rows
        at least frame_bytes long; the frame is the first frame_bytes of each)."""
        if checksums is None:
            end = self.frame_bytes
            checksums = [xxhash.xxh3_64_intdigest(frames[r, HEADER_BYTES:end].data) for r in rows]
        if len(checksums) != len(rows):
            raise ValueError(f"{len(checksums)} checksums for {len(rows)} rows")
        length, layout = self.payload_bytes, self.layout_digest
        # Through one view of the whole array: a numpy row view per frame
        # costs more than the pack.
        view, stride = frames.data, frames.strides[0]
        for r, checksum in zip(rows, checksums, strict=True):
            _HEADER.pack_into(view, r * stride, MAGIC, 0, length, checksum, layout)

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
        if layout != self.layout_digest:
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

    def check_headers(
        self, frames: npt.NDArray[np.uint8], rows: Sequence[int], lengths: Sequence[int]
    ) -> list[int | None]:
        """Everything ``check`` verifies but the checksum, for stored frames
        in place: frame ``i`` is row ``rows[i]`` of ``frames``, stored with
        ``lengths[i]`` bytes. Returns, per frame, the checksum its header
        states (to verify while copying the payload), or None if it is
        unusable (``header_error`` says why)."""
        out: list[int | None] = []
        view, stride = frames.data, frames.strides[0]
        for r, stored in zip(rows, lengths, strict=True):
            if stored != self.frame_bytes:
                out.append(None)
                continue
            magic, _flags, length, checksum, layout = _HEADER.unpack_from(view, r * stride)
            sound = magic == MAGIC and layout == self.layout_digest and length == self.payload_bytes
            out.append(checksum if sound else None)
        return out

    def header_error(self, frame: bytes | memoryview) -> FrameError:
        """Why ``check`` rejects a frame (for logging a rejected one)."""
        try:
            self.check(frame)
        except FrameError as e:
            return e
        return FrameError("checksum mismatch")
