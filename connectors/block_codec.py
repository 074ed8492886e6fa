"""How a KV block is named and framed in a content-addressed store.

Name: the block's hash-chain value (``engine.kv_cache.hashing``: the same
prefix gives the same hashes in every process and pod) under a namespace of
the model, the weight format, the dtype and the block layout, so any pod
serving the same model with the same weights and layout finds any other's
blocks, and no other pod does (float32 and Q4_1 weights give different KV
for the same tokens).

Frame: a 64-byte header, then the payload: for each layer, K then V of the
block, ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` in the cache
dtype. The header, little-endian::

    magic "TKV2" (4) | flags (4) | payload bytes (8) | payload xxh3-64 (8)
    | layout digest (16) | key digest (16) | header xxh3-64 (8)

* the payload checksum covers the payload;
* the layout digest is the namespace's (model, weight format, dtype,
  layers, heads, head dim, block size, frame version);
* the key digest is xxh3-128 of the block hash the frame was written for;
* the header checksum covers the 56 header bytes before it, so every header
  field, and through the payload checksum the payload: the whole frame.

A reader checks the key digest against the block hash it asked for and the
layout digest against its own, so a frame is usable only under the key it
was sealed for, in the namespace it was sealed in. A frame that is short or
long, from another model, weight format or layout, fails either checksum,
or was written under another key (another prompt's valid frame under the
victim's key, two keys' frames swapped, a slot or key mixed up in the
store) is rejected: the load counts it as ``corrupt`` and the block is
recomputed instead.

Why that is enough: what a block's KV is follows from its namespace and
its block hash (the hash chain covers every token of the prefix and its
extra keys: LoRA adapter, cache salt), and a frame that passes was sealed
for exactly that pair over exactly these payload bytes. It is integrity,
not authentication: xxh3 is no MAC, and whoever can write the store can
forge a frame that passes; keeping hostile writers out is the store's
access control (Redis AUTH and TLS, shared-memory file permissions).

Versions: the magic and the namespace moved from ``TKV1`` /
``tandem-kv-v1`` (a 32-byte header bound to no key); an older release's
frames live under other keys and another shared-memory pool, so they are
misses, and one found under a key anyway is refused (bad magic).

Batches: ``seal_rows`` writes headers from checksums the compiled block
copy computed while copying (``KVBlockIO.gather_rows_xxh3``), and
``check_headers`` checks headers, leaving the payload checksum to the
compiled copy into the cache (``KVBlockIO.scatter_rows_xxh3``): Python
never hashes a payload on those paths; per block it packs or unpacks one
small struct and hashes the block hash and the 56-byte header body.
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

from engine.kv_transfer.base import KVLayout

MAGIC = b"TKV2"
# Everything the header checksum covers: magic, flags, payload bytes, payload
# checksum, layout digest, key digest.
_BODY = struct.Struct("<4sIQQ16s16s")
_HEADER = struct.Struct("<4sIQQ16s16sQ")  # the body, then its xxh3-64
_SEAL = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size  # 64: payloads stay aligned for the copies' views
_BODY_BYTES = _BODY.size
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}


class FrameError(ValueError):
    """A stored block is unusable; the message says why."""


def key_digest(block_hash: bytes) -> bytes:
    """The header's key field: 16 bytes naming the block a frame is for."""
    return xxhash.xxh3_128_digest(block_hash)


def _flat(frames: npt.NDArray[np.uint8]) -> memoryview:
    """The bytes of a C-contiguous frame array, one dimension (for slicing
    a header body out of any row)."""
    return frames.data.cast("B")


@dataclass(frozen=True)
class BlockCodec:
    """Keys and frames for one (model, layout), the layout's weight format
    included."""

    model_name: str
    layout: KVLayout

    @cached_property
    def _ident_digest(self) -> bytes:
        lay = self.layout
        ident = (
            f"tandem-kv-v2|{self.model_name}|{lay.dtype}|W{lay.weight_format}"
            f"|L{lay.num_layers}|H{lay.num_kv_heads}|D{lay.head_dim}|B{lay.block_size}"
        )
        return hashlib.sha256(ident.encode()).digest()

    @cached_property
    def namespace(self) -> str:
        """Short hex digest of what a block must match to be reused."""
        return self._ident_digest[:8].hex()

    @cached_property
    def layout_digest(self) -> bytes:
        """The header's layout field: 16 bytes, the namespace's first 8."""
        return self._ident_digest[:16]

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

    def header(self, payload: bytes | memoryview, block_hash: bytes) -> bytes:
        """The header of ``payload`` stored under ``block_hash``."""
        body = _BODY.pack(
            MAGIC,
            0,
            len(payload),
            xxhash.xxh3_64_intdigest(payload),
            self.layout_digest,
            key_digest(block_hash),
        )
        return body + _SEAL.pack(xxhash.xxh3_64_intdigest(body))

    def seal(
        self,
        frames: npt.NDArray[np.uint8],
        hashes: Sequence[bytes],
        checksums: Sequence[int] | None = None,
    ) -> None:
        """Write the header of each row of ``frames`` ([n, frame_bytes], the
        payload already after HEADER_BYTES), in place, row ``i`` for
        ``hashes[i]``; ``checksums``: the payloads' xxh3-64 if the caller
        has them (else computed here)."""
        if frames.ndim != 2 or frames.shape[1] != self.frame_bytes:
            raise ValueError(
                f"frames: shape {frames.shape}, expected rows of {self.frame_bytes} bytes"
            )
        self.seal_rows(frames, range(len(frames)), hashes, checksums)

    def seal_rows(
        self,
        frames: npt.NDArray[np.uint8],
        rows: Sequence[int],
        hashes: Sequence[bytes],
        checksums: Sequence[int] | None = None,
    ) -> None:
        """Like seal, for the given rows of a larger C-contiguous array (rows
        at least frame_bytes long; the frame is the first frame_bytes of
        each), row ``rows[i]`` for ``hashes[i]``."""
        if checksums is None:
            end = self.frame_bytes
            checksums = [xxhash.xxh3_64_intdigest(frames[r, HEADER_BYTES:end].data) for r in rows]
        if not len(checksums) == len(hashes) == len(rows):
            raise ValueError(f"{len(checksums)} checksums, {len(hashes)} keys for {len(rows)} rows")
        length, layout = self.payload_bytes, self.layout_digest
        # Through one view of the whole array: a numpy row view per frame
        # costs more than the pack.
        view, stride = _flat(frames), frames.strides[0]
        for r, block_hash, checksum in zip(rows, hashes, checksums, strict=True):
            at = r * stride
            _BODY.pack_into(view, at, MAGIC, 0, length, checksum, layout, key_digest(block_hash))
            seal = xxhash.xxh3_64_intdigest(view[at : at + _BODY_BYTES])
            _SEAL.pack_into(view, at + _BODY_BYTES, seal)

    def encode(self, payload: bytes | memoryview, block_hash: bytes) -> bytes:
        return self.header(payload, block_hash) + bytes(payload)

    def check(self, frame: bytes | memoryview, block_hash: bytes) -> memoryview:
        """The payload of a frame read under ``block_hash``, or FrameError
        saying what is wrong."""
        view = memoryview(frame).cast("B")
        if len(view) < HEADER_BYTES:
            raise FrameError(f"frame of {len(view)} bytes is shorter than its header")
        magic, _flags, length, checksum, layout, key, seal = _HEADER.unpack_from(view)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if seal != xxhash.xxh3_64_intdigest(view[:_BODY_BYTES]):
            raise FrameError("header checksum mismatch")
        if layout != self.layout_digest:
            raise FrameError("frame is from another model or layout (or weight format)")
        if key != key_digest(block_hash):
            raise FrameError(
                f"frame was written for another block (key digest {key.hex()}, "
                f"expected {key_digest(block_hash).hex()} for {block_hash.hex()})"
            )
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
        self,
        frames: npt.NDArray[np.uint8],
        rows: Sequence[int],
        lengths: Sequence[int],
        hashes: Sequence[bytes],
    ) -> list[int | None]:
        """Everything ``check`` verifies but the payload checksum, for
        stored frames in place: frame ``i`` is row ``rows[i]`` of
        ``frames``, stored with ``lengths[i]`` bytes, read under
        ``hashes[i]``. Returns, per frame, the payload checksum its header
        states (to verify while copying the payload), or None if it is
        unusable (``header_error`` says why)."""
        out: list[int | None] = []
        view, stride = _flat(frames), frames.strides[0]
        want_length, want_layout = self.payload_bytes, self.layout_digest
        for r, stored, block_hash in zip(rows, lengths, hashes, strict=True):
            if stored != self.frame_bytes:
                out.append(None)
                continue
            at = r * stride
            magic, _flags, length, checksum, layout, key, seal = _HEADER.unpack_from(view, at)
            sound = (
                magic == MAGIC
                and layout == want_layout
                and length == want_length
                and key == key_digest(block_hash)
                and seal == xxhash.xxh3_64_intdigest(view[at : at + _BODY_BYTES])
            )
            out.append(checksum if sound else None)
        return out

    def header_error(self, frame: bytes | memoryview, block_hash: bytes) -> FrameError:
        """Why ``check`` rejects a frame read under ``block_hash`` (for
        logging a rejected one)."""
        try:
            self.check(frame, block_hash)
        except FrameError as e:
            return e
        return FrameError("checksum mismatch")
