"""The slot index of a shared-memory block pool (``connectors.shm_pool``).

The pool's header segment holds, per slot, a 32-byte key, the blob's
length, a last-used tick and a state (free or full), plus a shared clock
and an eviction counter. ``SlotIndex`` is the work done on those columns,
always under the pool's lock: find keys, mark hits recently used, pick
slots for new keys (free first, then least recently used), publish written
slots. Two implementations behave alike: ``ShmIndex`` in Tandem's compiled
CPU kernels (``kernels/csrc/shm_index.cpp``), used when the caller has the
module, and ``NumpyIndex`` here. The compiled one exists because a
single-block save or load copies for ~100 us, and this work in numpy, on
caches the copy has just cooled, added 40-60 us to each.

Keys travel concatenated in one ``bytes`` (32 per key): one object to pass
to the compiled index rather than a list.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

KEY_BYTES = 32
FREE = 0
FULL = 1

# Up to this many keys, a lookup compares each with the key column directly.
_DIRECT_MATCH_WORDS = 4
_KEY = struct.Struct(f"{KEY_BYTES}s")
_U64 = struct.Struct("<Q")


class SlotIndex(Protocol):
    """Index work over a pool header; the caller holds the pool lock."""

    def find(self, keys: bytes, touch: bool) -> list[int]:
        """The full slot of each key, -1 where absent; with ``touch``, hits
        are marked recently used, in key order."""
        ...

    def reserve(self, keys: bytes, max_new: int) -> tuple[list[int], list[int]]:
        """For a write: touch the keys present; for each key not present
        (first occurrence of a repeat; of those only the last ``max_new``),
        pick a slot, free ones first, then the least recently used. Picked
        slots become free (invisible until ``publish``) and the eviction
        count grows by the full ones. Returns (positions of the new keys in
        ``keys``, their slots)."""
        ...

    def publish(self, slots: list[int], keys: bytes, sizes: list[int]) -> None:
        """Make ``slots[j]`` hold key j with ``sizes[j]`` bytes, most
        recently used; each slot's state is written last."""
        ...

    def lengths(self, slots: list[int]) -> list[int]:
        """The stored length of each slot."""
        ...


def make_index(
    meta: npt.NDArray[np.void], num_slots: int, compiled: ModuleType | None
) -> SlotIndex:
    """The index over the header array ``meta`` (the pool's structured
    dtype): compiled where ``compiled`` (Tandem's CPU kernels module) is given."""
    if compiled is None:
        return NumpyIndex.over(meta)
    fields = meta.dtype.fields
    assert fields is not None
    offsets = [fields[name][1] for name in _COLUMNS]
    header = meta.reshape(1).view(np.uint8)  # the same memory, as bytes
    index: SlotIndex = compiled.ShmIndex(header, num_slots, *offsets)
    return index


_COLUMNS = ("clock", "evictions", "keys", "lengths", "last_used", "state")


def split_keys(keys: bytes) -> list[bytes]:
    return [keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]


@dataclass
class NumpyIndex:
    """SlotIndex in numpy and struct, for when the compiled kernels are not built."""

    clock: npt.NDArray[np.uint64]  # 0-d views of the header's fields
    evictions: npt.NDArray[np.uint64]
    keys: npt.NDArray[np.uint64]  # [num_slots, 4]
    last_used: npt.NDArray[np.uint64]
    state: npt.NDArray[np.uint8]
    # Columns as raw bytes, for struct access to single slots (cheaper
    # than numpy's call costs for the few slots of a typical call).
    keys_bytes: memoryview
    lengths_bytes: memoryview
    last_used_bytes: memoryview

    @classmethod
    def over(cls, meta: npt.NDArray[np.void]) -> NumpyIndex:
        keys: Any = meta["keys"]
        return cls(
            clock=meta["clock"],
            evictions=meta["evictions"],
            keys=keys,
            last_used=meta["last_used"],
            state=meta["state"],
            keys_bytes=keys.data.cast("B"),
            lengths_bytes=meta["lengths"].data.cast("B"),
            last_used_bytes=meta["last_used"].data.cast("B"),
        )

    def find(self, keys: bytes, touch: bool) -> list[int]:
        slots = self._lookup(split_keys(keys))
        if touch:
            self._touch([slot for slot in slots if slot >= 0])
        return slots

    def reserve(self, keys: bytes, max_new: int) -> tuple[list[int], list[int]]:
        split = split_keys(keys)
        slots = self._lookup(split)
        self._touch([slot for slot in slots if slot >= 0])
        seen: set[bytes] = set()
        fresh: list[int] = []
        for i, (key, slot) in enumerate(zip(split, slots, strict=True)):
            if slot < 0 and key not in seen:
                seen.add(key)
                fresh.append(i)
        keep = min(len(fresh), max_new, len(self.state))
        fresh = fresh[len(fresh) - keep :]
        if not fresh:
            return fresh, []
        victims = self._oldest(len(fresh))
        evicted = sum(int(self.state[slot] == FULL) for slot in victims)
        for slot in victims:
            self.state[slot] = FREE
        if evicted:
            self.evictions[()] += evicted
        return fresh, victims

    def publish(self, slots: list[int], keys: bytes, sizes: list[int]) -> None:
        first = self._tick(len(slots))
        for j, (slot, key, size) in enumerate(zip(slots, split_keys(keys), sizes, strict=True)):
            _KEY.pack_into(self.keys_bytes, slot * KEY_BYTES, key)
            _U64.pack_into(self.lengths_bytes, slot * 8, size)
            _U64.pack_into(self.last_used_bytes, slot * 8, first + j)
        for slot in slots:
            self.state[slot] = FULL

    def lengths(self, slots: list[int]) -> list[int]:
        return [_U64.unpack_from(self.lengths_bytes, slot * 8)[0] for slot in slots]

    # ---- internals ----------------------------------------------------------

    def _lookup(self, keys: list[bytes]) -> list[int]:
        if not keys:
            return []
        if len(keys) <= _DIRECT_MATCH_WORDS:
            candidates = self._few_word_matches([int.from_bytes(key[:8], "little") for key in keys])
        else:
            words = np.frombuffer(b"".join(key[:8] for key in keys), dtype="<u8")
            candidates = self._first_word_matches(words).tolist()
        # Keys are digests, so a first-word match is almost always a hit: the
        # dict spans about len(keys) candidates, never the whole index.
        by_key = {
            self.keys[slot].tobytes(): slot for slot in candidates if self.state[slot] == FULL
        }
        return [by_key.get(key, -1) for key in keys]

    def _few_word_matches(self, words: list[int]) -> list[int]:
        """Slots (full or not) whose first key word is one of a few ``words``."""
        column = self.keys[:, 0]
        hit = column == words[0]
        for word in words[1:]:
            hit |= column == word
        found: list[int] = hit.nonzero()[0].tolist()
        return found

    def _first_word_matches(self, words: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Full slots whose first key word is one of ``words``.

        A branch-free gather from a small table indexed by the word's low
        bits drops all but ~1/1024 of the non-matching slots, and only those
        survivors get an exact (binary search) check. np.isin, or a binary
        search for every slot, was about 6x slower at 50k slots.
        """
        column = self.keys[:, 0]
        bits = max(16, (words.size * 1024 - 1).bit_length())
        low = np.uint64((1 << bits) - 1)
        wanted = np.zeros(1 << bits, dtype=bool)
        wanted[words & low] = True
        maybe = np.flatnonzero(wanted[column & low] & (self.state == FULL))
        ordered = np.sort(words)
        values = column[maybe]
        nearest = ordered[np.searchsorted(ordered, values).clip(max=ordered.size - 1)]
        matches: npt.NDArray[np.int64] = maybe[nearest == values]
        return matches

    def _tick(self, count: int) -> int:
        """Advance the shared logical clock by ``count``; return the first new value."""
        first = int(self.clock) + 1
        self.clock[()] = first + count - 1
        return first

    def _touch(self, slots: list[int]) -> None:
        if not slots:
            return
        first = self._tick(len(slots))
        if len(slots) <= _DIRECT_MATCH_WORDS:
            for j, slot in enumerate(slots):
                _U64.pack_into(self.last_used_bytes, slot * 8, first + j)
        else:
            self.last_used[slots] = np.arange(first, first + len(slots), dtype=np.uint64)

    def _oldest(self, count: int) -> list[int]:
        """``count`` slots, oldest first. A slot never written has 0 in
        ``last_used``, below every tick, so free slots come first without a
        scan of ``state``; ties go to the lower slot."""
        ages = self.last_used
        if count == 1:
            return [int(ages.argmin())]
        part = np.argpartition(ages, count - 1)[:count]
        victims: list[int] = part[np.lexsort((part, ages[part]))].tolist()
        return victims
