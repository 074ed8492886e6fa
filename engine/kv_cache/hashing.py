"""Content hashes of full KV blocks, chained from the first block.

``hash(block i) = sha256(hash(block i-1) || token ids of block i || extra
keys)``. The first block's extra keys are the request's cache salt and its
LoRA adapter's cache key, so through the chain every block of a sequence
computed under an adapter differs from the same tokens' under another
adapter or the base model. The encoding is canonical (little-endian int64 token ids, JSON extra
keys) and the root is a fixed constant, so the same prefix hashes the same in
every process, pod and restart. Connectors use these hashes as storage keys;
the block pool uses them for prefix caching; the router (service/pods.py)
matches them against the pods' KV events, so ``hash_chain`` is the one
function that computes a chain: the engine's ``BlockHasher`` and the router
both call it, and a pod's blocks are found by the router only because the
two agree.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Protocol

BlockHash = bytes
"""A 32-byte sha256 digest."""

HASH_BYTES = 32

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


def hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[BlockHash] = (),
    cache_salt: str | None = None,
    lora_key: str | None = None,
) -> list[BlockHash]:
    """The hashes of the full blocks of ``token_ids`` that follow the
    ``known`` ones (the chain of its first ``len(known)`` blocks, computed
    earlier): all of them when ``known`` is empty. A partial last block has
    no hash. The cache salt isolates tenants: it keys the first block, and
    through the chain every block after it; ``lora_key`` (the adapter's
    ``LoRARequest.cache_key``) does the same for an adapter."""
    start = len(known) * block_size
    parent = known[-1] if known else None
    new: list[BlockHash] = []
    first_extra = _first_block_extra(cache_salt, lora_key)
    while start + block_size <= len(token_ids):
        extra = first_extra if start == 0 else None
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        new.append(parent)
        start += block_size
    return new


def _first_block_extra(cache_salt: str | None, lora_key: str | None) -> ExtraKeys | None:
    keys: list[object] = []
    if cache_salt:
        keys.append(cache_salt)
    if lora_key:
        # A list, so no salt string can spell the same JSON.
        keys.append(["lora", lora_key])
    return tuple(keys) or None


class HashedTokens(Protocol):
    """What ``BlockHasher`` reads of a request (``engine.request.Request``)."""

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora_cache_key(self) -> str | None: ...


class BlockHasher:
    """Computes the hashes of a request's newly completed full blocks.

    Called when a request is created and whenever its token list grows past a
    block boundary; the request extends its ``block_hashes`` with the result.
    """

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: HashedTokens) -> list[BlockHash]:
        return hash_chain(
            request.all_token_ids,
            self.block_size,
            request.block_hashes,
            request.cache_salt,
            request.lora_cache_key,
        )
