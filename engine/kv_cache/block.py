"""KV cache blocks and the free queue that orders them for eviction."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache.hashing import BlockHash


class KVCacheBlock:
    """One block of the paged cache.

    ``ref_cnt`` counts the requests using the block. A block with a
    ``block_hash`` is full and registered for prefix caching; it stays
    reusable after its ref count drops to zero until it is evicted.
    ``prev_free``/``next_free`` link it into the free queue (None when it is
    not in the queue).
    """

    __slots__ = ("block_hash", "block_id", "is_null", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction (LRU) order.

    The front is evicted first. A block can be removed from the middle in
    O(1) when a prefix-cache hit revives it; a Python deque cannot do that.
    Sentinel head and tail nodes keep the link code branch-free.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks left")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free
        assert last is not None
        count = 0
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
            count += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
