"""Copying whole KV blocks between the paged cache and flat byte buffers.

The cache is one tensor per layer, ``[2, num_blocks, block_size, heads,
head_dim]``. A block's payload is every layer's K then V for that block,
``[num_layers, 2, block_size * heads * head_dim]``, contiguous: the unit a
store keeps under one key. Each block's bytes go as they lie in memory
(head-major for int8: kernels/kv_layout.py), so pods exchange blocks only
with pods of the same cache dtype, which block keys already ensure. Gather
and scatter touch each layer once for a whole batch of blocks, not once per
block.

The frame variants work on rows of one ``[n, header + payload]`` byte
array, the payload after a header the caller fills: the store's frames are
written by the gather itself and read by the scatter, with no copy between.
On CPU the compiled ``gather_kv_blocks`` / ``scatter_kv_blocks``
(``kernels/csrc/kv_copy.cpp``) do one memcpy per block, layer and half,
blocks across threads; without the extension, numpy copies row by row.
The ``_xxh3`` variants (compiled only) also checksum each payload in the
same pass (see ``connectors.block_codec``), so a store never reads a block
a second time to seal or verify it.

``FrameBuffers`` keeps frame arrays for reuse: a batch of a few hundred
blocks is hundreds of MiB, and a fresh array faults in every page on its
first write (about a quarter of the time of the copy itself).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kernels import cpu_kernels
from kernels.kv_layout import in_memory_order

# Same-size integer types: numpy has no bfloat16, and a copy is a copy.
_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.uint8}

Frames = npt.NDArray[np.uint8]
_NO_ROWS = torch.empty(0, dtype=torch.int64)  # frame row j for block j


class KVBlockIO:
    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("kv_caches: expected at least one layer's cache")
        first = kv_caches[0]
        self.num_blocks = first.shape[1]
        # Each layer as [2, num_blocks, elements of one block's K (or V)]: a
        # block is one unit of memory in either order (kernels/kv_layout.py).
        self.layers = [in_memory_order(c).view(2, self.num_blocks, -1) for c in kv_caches]
        self.dtype = first.dtype
        self.itemsize = first.element_size()
        self.device = first.device
        self.block_shape = (len(kv_caches), 2, self.layers[0].shape[2])
        self.payload_bytes = int(np.prod(self.block_shape)) * self.itemsize
        on_cpu = self.device.type == "cpu"
        self._compiled = cpu_kernels.load() if on_cpu else None
        # The checksumming copies, set up once over the layers.
        self._copier = (
            self._compiled.KVBlockCopier(self.layers) if self._compiled is not None else None
        )
        # Without the extension: numpy views ([2, num_blocks, E]) of each layer.
        self._np_layers = (
            [layer.view(_INT_VIEW[self.itemsize]).numpy() for layer in self.layers]
            if on_cpu and self._compiled is None
            else None
        )

    # ---- frames ------------------------------------------------------------

    def _payload_view(self, frames: Frames, header_bytes: int) -> npt.NDArray[np.generic]:
        """The payload part of frame rows as [n, layers, 2, E] (a view)."""
        n, row_bytes = frames.shape
        if row_bytes != header_bytes + self.payload_bytes or frames.strides[1] != 1:
            raise ValueError(
                f"frames: rows of {row_bytes} bytes, expected {header_bytes + self.payload_bytes}"
            )
        isz = self.itemsize
        layers, _, elems = self.block_shape
        body = frames[:, header_bytes:].view(np.dtype(f"i{isz}") if isz > 1 else np.uint8)
        return np.lib.stride_tricks.as_strided(
            body,
            shape=(n, layers, 2, elems),
            strides=(frames.strides[0], 2 * elems * isz, elems * isz, isz),
        )

    def gather_frames(self, block_ids: Sequence[int], header_bytes: int) -> Frames:
        """A new ``[n, header_bytes + payload]`` array holding the blocks'
        payloads after an uninitialised header."""
        n = len(block_ids)
        frames: Frames = np.empty((n, header_bytes + self.payload_bytes), np.uint8)
        payload = self._payload_view(frames, header_bytes)
        if self._compiled is not None:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            self._compiled.gather_kv_blocks(
                torch.from_numpy(frames), header_bytes, self.layers, ids, _NO_ROWS
            )
            return frames
        if self._np_layers is not None:
            for j, block_id in enumerate(block_ids):
                for i, np_layer in enumerate(self._np_layers):
                    payload[j, i] = np_layer[:, block_id]
            return frames
        ids_t = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        host = torch.from_numpy(payload)
        for i, layer in enumerate(self.layers):
            gathered = layer.index_select(1, ids_t).transpose(0, 1)
            host[:, i].copy_(gathered.view(_INT_VIEW[self.itemsize]))
        return frames

    def scatter_frames(self, block_ids: Sequence[int], frames: Frames, header_bytes: int) -> None:
        """Write frame rows (payload after the header) into the blocks."""
        payload = self._payload_view(frames, header_bytes)
        if self._compiled is not None:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            self._compiled.scatter_kv_blocks(
                torch.from_numpy(frames), header_bytes, self.layers, ids, _NO_ROWS
            )
            return
        if self._np_layers is not None:
            for j, block_id in enumerate(block_ids):
                for i, np_layer in enumerate(self._np_layers):
                    np_layer[:, block_id] = payload[j, i]
            return
        staging = torch.from_numpy(np.ascontiguousarray(payload)).to(self.device)
        staging = staging.view(self.dtype)
        ids_t = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for i, layer in enumerate(self.layers):
            layer[:, ids_t] = staging[:, i].transpose(0, 1)

    # ---- chosen rows of a larger frame array (a shared-memory pool) --------

    @property
    def copies_rows(self) -> bool:
        """Whether gather_rows / scatter_rows are available (compiled, CPU)."""
        return self._compiled is not None

    def gather_rows(
        self, block_ids: Sequence[int], frames: Frames, rows: Sequence[int], header_bytes: int
    ) -> None:
        """Block block_ids[j]'s payload into frames[rows[j]], after the header."""
        assert self._compiled is not None, "gather_rows needs the compiled CPU kernels"
        self._compiled.gather_kv_blocks(
            torch.from_numpy(frames),
            header_bytes,
            self.layers,
            torch.tensor(block_ids, dtype=torch.int64),
            torch.tensor(rows, dtype=torch.int64),
        )

    def scatter_rows(
        self, block_ids: Sequence[int], frames: Frames, rows: Sequence[int], header_bytes: int
    ) -> None:
        """frames[rows[j]]'s payload into block block_ids[j]."""
        assert self._compiled is not None, "scatter_rows needs the compiled CPU kernels"
        self._compiled.scatter_kv_blocks(
            torch.from_numpy(frames),
            header_bytes,
            self.layers,
            torch.tensor(block_ids, dtype=torch.int64),
            torch.tensor(rows, dtype=torch.int64),
        )

    # ---- copies with checksums (compiled, CPU) ------------------------------

    def gather_rows_xxh3(
        self,
        block_ids: Sequence[int],
        frames: Frames,
        rows: Sequence[int] | None,
        header_bytes: int,
    ) -> list[int]:
        """gather_rows (rows None: row j for block j) that also returns the
        xxh3-64 of each payload, computed while it is still in cache."""
        assert self._copier is not None, "gather_rows_xxh3 needs the compiled CPU kernels"
        sums: list[int] = self._copier.gather_xxh3(frames, header_bytes, block_ids, rows or [])
        return sums

    def scatter_rows_xxh3(
        self,
        block_ids: Sequence[int],
        frames: Frames,
        rows: Sequence[int] | None,
        header_bytes: int,
        expected: Sequence[int],
    ) -> list[int]:
        """scatter_rows (rows None: row j for block j) of the payloads whose
        xxh3-64 is ``expected[j]``, each hashed just before its copy. Returns
        the positions j that did not match; those blocks are not written."""
        assert self._copier is not None, "scatter_rows_xxh3 needs the compiled CPU kernels"
        mismatched: list[int] = self._copier.scatter_xxh3(
            frames, header_bytes, block_ids, rows or [], expected
        )
        return mismatched

    # ---- payloads ------------------------------------------------------------

    def gather(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Copies of the blocks' KV, one payload per block (host memory)."""
        frames = self.gather_frames(block_ids, 0)
        return [memoryview(row) for row in frames]

    def scatter(self, block_ids: Sequence[int], payloads: Sequence[memoryview | bytes]) -> None:
        """Write payloads (as made by gather) into the blocks."""
        frames: Frames = np.empty((len(block_ids), self.payload_bytes), np.uint8)
        for i, payload in enumerate(payloads):
            frames[i] = np.frombuffer(payload, np.uint8)
        self.scatter_frames(block_ids, frames, 0)


class FrameBuffers:
    """Frame arrays ([rows, row_bytes] uint8) kept for reuse across batches.

    ``take(n)`` hands out a retained array with room for ``n`` rows (a view
    of its first ``n``), or a new one; ``give_back`` returns it once nothing
    reads it any more. Up to ``max_retained_bytes`` are kept (the largest
    arrays first), the rest freed. Thread-safe: the step thread takes, the
    transfer thread gives back.
    """

    def __init__(self, row_bytes: int, max_retained_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.max_retained_bytes = max_retained_bytes
        self._free: list[Frames] = []
        # Every array take() made, so that nothing else is ever adopted
        # (a view of a shared-memory pool has the same row size).
        self._ours: weakref.WeakValueDictionary[int, Frames] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def take(self, n: int) -> Frames:
        with self._lock:
            fits = [i for i, buf in enumerate(self._free) if len(buf) >= n]
            if fits:
                best = min(fits, key=lambda i: len(self._free[i]))
                return self._free.pop(best)[:n]
        frames: Frames = np.empty((n, self.row_bytes), np.uint8)
        with self._lock:
            self._ours[id(frames)] = frames
        return frames

    def give_back(self, frames: Frames) -> None:
        """Return an array from ``take`` (or a view of its leading rows)."""
        whole = frames if frames.base is None else frames.base
        with self._lock:
            if self._ours.get(id(whole)) is not whole:
                return  # not one of ours (say, a copy of some rows)
            if any(buf is whole for buf in self._free):
                return
            self._free.append(whole)
            self._free.sort(key=len, reverse=True)
            kept, total = [], 0
            for buf in self._free:
                if total + buf.nbytes <= self.max_retained_bytes:
                    kept.append(buf)
                    total += buf.nbytes
            self._free = kept
