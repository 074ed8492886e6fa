"""Content hashes of full KV blocks, chained from the first block.

``hash(block i) = sha256(hash(block i-1) || token ids of block i || extra
keys)``. The encoding is canonical (little-endian int64 token ids, JSON extra
keys) and the root is a fixed constant, so the same prefix hashes the same in
every process, pod and restart. Connectors use these hashes as storage keys;
the block pool uses them for prefix caching.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request

BlockHash = bytes
"""A 32-byte sha256 digest."""

NONE_HASH: BlockHash = hashlib.sha256(b"tandem.kv.block-hash.root.v1").digest()
"""The parent of the first block of every sequence."""

ExtraKeys = tuple[object, ...]


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash one block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(b"\x00extra:")
        h.update(json.dumps(extra_keys, separators=(",", ":")).encode())
    return h.digest()


class BlockHasher:
    """Computes the hashes of a request's newly completed full blocks.

    Called when a request is created and whenever its token list grows past a
    block boundary; it extends ``request.block_hashes`` incrementally.
    """

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        size = self.block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        start = len(hashes) * size
        parent = hashes[-1] if hashes else None
        new: list[BlockHash] = []
        while start + size <= len(tokens):
            # The cache salt isolates tenants: it keys the first block, and
            # through the chain every block after it.
            extra: ExtraKeys | None = (
                (request.cache_salt,) if start == 0 and request.cache_salt else None
            )
            parent = hash_block_tokens(parent, tokens[start : start + size], extra)
            new.append(parent)
            start += size
        return new
