"""A content-addressed pool of equal-size KV blobs in POSIX shared memory.

Several unrelated processes on one host (say a prefill server and a decode
server, started independently) attach to the same pool by name and exchange
KV blocks keyed by 32-byte digests. The pool has a fixed number of slots and
evicts the least recently used blob when it is full.

Files, all derived from the pool name:

* ``/dev/shm/tandem-<name>``: the header segment: geometry, counters, the
  table of attached processes and the slot index (see ``_header_dtype``).
* ``/dev/shm/tandem-<name>.data``: ``num_slots * slot_bytes`` of blob storage.
* ``tandem-<name>.lock`` in /dev/shm (or the temp dir): the ``flock(2)`` file.

Every index mutation and every read holds the exclusive flock, and the blob
memcpy happens under it too, so no reader can see a blob that a concurrent put
or eviction is overwriting. The lock covers only index work and memcpy.

Lifetime is managed here rather than by Python's resource_tracker: each attach
records its PID, ``close()`` removes it, and the last live process to close
unlinks everything. Entries of dead processes (SIGKILL, OOM) are pruned on
attach, on close and by ``cleanup_stale``.

Limitations: POSIX only (flock, /dev/shm); segments are created mode 0600, so
all processes must run as the same user; a process in another PID namespace
(another container sharing /dev/shm) is never judged dead, since its PID means
nothing here, so its entry outlives it until a process in its own namespace
prunes it; an instance inherited across fork() must not be used in the child.
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from types import ModuleType, TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from connectors.shm_index import FULL, KEY_BYTES, SlotIndex, make_index

MAX_ATTACHMENTS = 64

_MAGIC = int.from_bytes(b"TNDMSHMP", "little")
_VERSION = 1
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
# "tandem-<name>.data" and "tandem-<name>.lock" must stay under NAME_MAX (255).
_MAX_NAME_LEN = 200
_SHM_DIR = "/dev/shm"

# SharedMemory.unlink() also unregisters from the resource tracker, which we
# have already done on open; unlinking through the C module directly keeps the
# tracker's bookkeeping balanced (an unbalanced unregister makes it print a
# KeyError traceback). typeshed has no stub for _posixshmem.
_shm_unlink: Callable[[str], None] = importlib.import_module("_posixshmem").shm_unlink

# Geometry first, at fixed offsets, so an attacher can read it before it knows
# how large the index is; the attachment table is fixed-size for the same reason.
_FIXED_FIELDS: list[tuple[Any, ...]] = [
    ("magic", "<u8"),
    ("version", "<u4"),
    ("reserved", "<u4"),
    ("num_slots", "<u8"),
    ("slot_bytes", "<u8"),
    ("clock", "<u8"),
    ("evictions", "<u8"),
    ("att_pid", "<i8", (MAX_ATTACHMENTS,)),
    ("att_start", "<u8", (MAX_ATTACHMENTS,)),
    ("att_pidns", "<u8", (MAX_ATTACHMENTS,)),
]
_FIXED_DTYPE = np.dtype(_FIXED_FIELDS)

# Shared mappings that could not be unmapped because a caller still holds a
# view into them (e.g. a traceback's frame locals); kept alive, not leaked to
# a __del__ that would complain at shutdown.
_PINNED: list[SharedMemory] = []


@dataclass(frozen=True)
class ShmPoolConfig:
    """Geometry and name of a pool; every process attaching must agree on it."""

    name: str
    num_slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        _check_name(self.name)
        for field_name in ("num_slots", "slot_bytes"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ShmPoolConfig.{field_name} must be a positive int, got {value!r}"
                )


@dataclass(frozen=True)
class ShmPoolStats:
    num_slots: int
    used_slots: int
    # Cumulative over the pool's lifetime, counted by every attached process.
    evictions: int
    attached_processes: int


def segment_names(name: str) -> list[str]:
    """The shared-memory segment names of pool ``name`` (files in /dev/shm on Linux)."""
    _check_name(name)
    return [f"tandem-{name}", f"tandem-{name}.data"]


def lock_path(name: str) -> str:
    """Path of the lock file of pool ``name``."""
    _check_name(name)
    directory = _SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir()
    return os.path.join(directory, f"tandem-{name}.lock")


def cleanup_stale(name: str) -> bool:
    """Unlink pool ``name`` if no live process is attached to it.

    Returns whether a segment was removed. Blocks on the pool lock (held by
    other processes only for index work and memcpy).
    """
    header_name, data_name = segment_names(name)
    path = lock_path(name)
    fd = _lock_file(path)
    try:
        header = _open_segment_if_sound(header_name)
        if header is not None:
            abandoned = _is_abandoned(header)
            _close_segment(header)
            if not abandoned:
                return False
        removed = [_unlink_segment(header_name), _unlink_segment(data_name)]
        _unlink_file(path)
        return any(removed)
    finally:
        _unlock_and_close(fd)


class ShmBlockPool:
    """Fixed-size LRU pool of blobs keyed by 32-byte digests, shared by processes.

    Every method blocks on the pool lock, which other processes hold only for
    index work and memcpy. Thread-safe within a process. Usable as a context
    manager; ``close()`` also runs on garbage collection and interpreter exit.
    """

    def __init__(self, config: ShmPoolConfig, compiled: ModuleType | None = None) -> None:
        """Create the pool, or attach to an existing one of the same name.

        ``compiled``: Tandem's compiled CPU kernels (``kernels.cpu_kernels.load()``),
        whose ShmIndex then does the index work; without it numpy does (the
        same behaviour, ~50 us more per call). Processes attached to one pool
        may differ in this.

        Raises ValueError if the existing pool has another geometry and a live
        process is attached to it (a pool nobody alive uses is recreated), and
        RuntimeError if MAX_ATTACHMENTS live attachments exist. Blocks on the
        pool lock and, when creating, while /dev/shm reserves the data segment.
        """
        self.config = config
        self._state = _attach(config, compiled)
        self._finalizer = weakref.finalize(self, _detach, self._state)

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> int:
        """Store blobs under their keys; return how many were newly written.

        A key already present is only marked recently used, never rewritten;
        repeats of a key within ``items`` count once (the first blob wins).
        When the pool is full the least recently used slots are evicted; if
        ``items`` holds more new keys than the pool has slots, only the last
        ``num_slots`` of them are stored. Raises ValueError, before touching
        the pool, for a key that is not 32 bytes or a blob over ``slot_bytes``.
        Blocks on the pool lock.
        """
        keys, blobs = _validate_items(items, self.config.slot_bytes)
        if not keys:
            return 0
        with self._locked() as views:
            new, victims = views.index.reserve(b"".join(keys), self.config.num_slots)
            for slot, i in zip(victims, new, strict=True):
                views.data[slot, : blobs[i].size] = blobs[i]
            views.index.publish(
                victims, b"".join(keys[i] for i in new), [blobs[i].size for i in new]
            )
        return len(new)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present. Does not mark hits as recently used,
        so a hit may be evicted before it is read. Blocks on the pool lock."""
        joined = _joined_keys(keys)
        if not joined:
            return []
        with self._locked() as views:
            slots = views.index.find(joined, False)
        return [slot >= 0 for slot in slots]

    def read_into(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[int]:
        """Copy each key's blob into ``dests[i]``; return the blob lengths.

        A key that is absent (or was evicted) gives -1 and leaves its buffer
        untouched. Hits are marked recently used. Each ``dests[i]`` must be a
        writable C-contiguous buffer at least as large as its blob, else
        ValueError (raised before anything is copied). The copy happens under
        the lock, so a concurrent put or eviction cannot tear it. Blocks on
        the pool lock.
        """
        if len(dests) != len(keys):
            raise ValueError(f"read_into got {len(keys)} keys but {len(dests)} dests")
        joined = _joined_keys(keys)
        targets = [_writable_bytes(dest, i) for i, dest in enumerate(dests)]
        if not joined:
            return []
        lengths = [-1] * len(targets)
        with self._locked() as views:
            slots = views.index.find(joined, True)
            hits = [i for i, slot in enumerate(slots) if slot >= 0]
            for i, size in zip(hits, views.index.lengths([slots[i] for i in hits]), strict=True):
                if size > targets[i].size:
                    raise ValueError(
                        f"dests[{i}] holds {targets[i].size} bytes but its blob has {size}"
                    )
                lengths[i] = size
            for i in hits:
                targets[i][: lengths[i]] = views.data[slots[i], : lengths[i]]
        return lengths

    def read_with(
        self,
        keys: Sequence[bytes],
        use: Callable[[npt.NDArray[np.uint8], list[int], list[int], list[int]], None],
    ) -> list[int]:
        """Zero-copy reads: under the lock, ``use(data, indices, slots,
        lengths)`` gets the pool's data rows ([num_slots, slot_bytes], shared
        memory) and, for the present keys, their indices in ``keys``, their
        slots and their blob lengths. The
        view is valid only during the call. Returns the blob lengths (-1 for
        an absent key). Hits are marked recently used. Blocks on the pool
        lock, for as long as ``use`` runs."""
        joined = _joined_keys(keys)
        if not joined:
            return []
        lengths = [-1] * len(keys)
        with self._locked() as views:
            slots = views.index.find(joined, True)
            hits = [i for i, slot in enumerate(slots) if slot >= 0]
            if hits:
                hit_slots = [slots[i] for i in hits]
                hit_lengths = views.index.lengths(hit_slots)
                use(views.data, hits, hit_slots, hit_lengths)
                for i, length in zip(hits, hit_lengths, strict=True):
                    lengths[i] = length
        return lengths

    def write_with(
        self,
        keys: Sequence[bytes],
        size: int,
        fill: Callable[[npt.NDArray[np.uint8], list[int], list[int]], None],
    ) -> int:
        """Zero-copy writes: the keys not yet present get slots (evicting the
        least recently used), and under the lock ``fill(data, indices,
        slots)`` writes their ``size``-byte blobs straight into the data rows
        (``indices``: positions in ``keys``, first occurrences only). Present
        keys are only touched. The slots become visible only after ``fill``
        returns, so a reader never sees a half-written blob. Returns how many
        were written. Blocks on the pool lock while ``fill`` runs."""
        if not 0 < size <= self.config.slot_bytes:
            raise ValueError(f"size={size} is invalid: expected 1..{self.config.slot_bytes}")
        joined = _joined_keys(keys)
        if not joined:
            return 0
        with self._locked() as views:
            new, victims = views.index.reserve(joined, self.config.num_slots)
            if not new:
                return 0
            fill(views.data, new, victims)
            fresh = b"".join(joined[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in new)
            views.index.publish(victims, fresh, [size] * len(new))
        return len(new)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's blob, or None if absent. Blocks on the pool lock."""
        scratch = np.empty((len(keys), self.config.slot_bytes), dtype=np.uint8)
        lengths = self.read_into(keys, [row.data for row in scratch])
        return [None if n < 0 else scratch[i, :n].tobytes() for i, n in enumerate(lengths)]

    def stats(self) -> ShmPoolStats:
        """A snapshot of occupancy and counters. Blocks on the pool lock."""
        with self._locked() as views:
            _prune_dead(views.att_pid, views.att_start, views.att_pidns)
            attached = {
                (int(ns), int(pid))
                for pid, ns in zip(views.att_pid, views.att_pidns, strict=True)
                if pid != 0
            }
            return ShmPoolStats(
                num_slots=self.config.num_slots,
                used_slots=int(np.count_nonzero(views.state == FULL)),
                evictions=int(views.evictions),
                attached_processes=len(attached),
            )

    def close(self) -> None:
        """Detach; the last live process to detach unlinks the segments and
        the lock file. Idempotent. Blocks on the pool lock."""
        self._finalizer()

    def __enter__(self) -> ShmBlockPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @contextmanager
    def _locked(self) -> Iterator[_Views]:
        state = self._state
        # flock excludes open file descriptions, not threads sharing one fd.
        with state.thread_lock:
            views = state.views
            if views is None:
                raise ValueError(f"ShmBlockPool {self.config.name!r} is closed")
            if os.getpid() != state.owner_pid:
                # A forked child shares our lock's open file description, so
                # its flock calls would silently take or drop ours.
                raise RuntimeError(
                    f"ShmBlockPool {self.config.name!r} was inherited across fork(); "
                    "create a new ShmBlockPool in the child"
                )
            fcntl.flock(state.lock_fd, fcntl.LOCK_EX)
            try:
                yield views
            finally:
                fcntl.flock(state.lock_fd, fcntl.LOCK_UN)


# ---- layout ------------------------------------------------------------------


def _header_dtype(num_slots: int) -> np.dtype[np.void]:
    # Columns rather than one record per slot: a lookup scans only the first
    # key word and the state column, and eviction only last_used.
    return np.dtype(
        [
            *_FIXED_FIELDS,
            ("keys", "<u8", (num_slots, KEY_BYTES // 8)),
            ("lengths", "<u8", (num_slots,)),
            ("last_used", "<u8", (num_slots,)),
            ("state", "u1", (num_slots,)),
        ]
    )


@dataclass
class _Views:
    """numpy views over the shared segments and the slot index over the
    header; they pin the mappings while alive."""

    meta: npt.NDArray[np.void]
    evictions: npt.NDArray[np.uint64]  # a 0-d view of meta's field
    att_pid: npt.NDArray[np.int64]
    att_start: npt.NDArray[np.uint64]
    att_pidns: npt.NDArray[np.uint64]
    state: npt.NDArray[np.uint8]
    data: npt.NDArray[np.uint8]
    index: SlotIndex

    @classmethod
    def over(
        cls,
        header: SharedMemory,
        data: SharedMemory,
        config: ShmPoolConfig,
        compiled: ModuleType | None,
    ) -> _Views:
        dtype = _header_dtype(config.num_slots)
        data_bytes = config.num_slots * config.slot_bytes
        if header.size < dtype.itemsize or data.size < data_bytes:
            raise ValueError(f"segments of pool {config.name!r} are smaller than its geometry")
        meta = np.ndarray((), dtype=dtype, buffer=_buffer(header))
        return cls(
            meta=meta,
            evictions=meta["evictions"],
            att_pid=meta["att_pid"],
            att_start=meta["att_start"],
            att_pidns=meta["att_pidns"],
            state=meta["state"],
            data=np.ndarray(
                (config.num_slots, config.slot_bytes), dtype=np.uint8, buffer=_buffer(data)
            ),
            index=make_index(meta, config.num_slots, compiled),
        )


@dataclass(frozen=True)
class _HeaderInfo:
    initialised: bool
    num_slots: int
    slot_bytes: int
    live_attachments: int


def _inspect(header: SharedMemory) -> _HeaderInfo:
    if header.size < _FIXED_DTYPE.itemsize:
        return _HeaderInfo(False, 0, 0, 0)
    fixed = np.ndarray((), dtype=_FIXED_DTYPE, buffer=_buffer(header))
    if int(fixed["magic"]) != _MAGIC or int(fixed["version"]) != _VERSION:
        return _HeaderInfo(False, 0, 0, 0)
    live = sum(
        _pid_alive(int(pid), int(start), int(ns))
        for pid, start, ns in zip(
            fixed["att_pid"], fixed["att_start"], fixed["att_pidns"], strict=True
        )
        if pid != 0
    )
    return _HeaderInfo(True, int(fixed["num_slots"]), int(fixed["slot_bytes"]), live)


def _is_blank(header: SharedMemory) -> bool:
    """True for a header whose creator died before finishing it: the creator
    holds the lock until the magic is written, so under the lock a zero magic
    can only mean that."""
    if header.size < _FIXED_DTYPE.itemsize:
        return True
    fixed = np.ndarray((), dtype=_FIXED_DTYPE, buffer=_buffer(header))
    return int(fixed["magic"]) == 0


def _is_abandoned(header: SharedMemory) -> bool:
    """Whether no live process uses the pool. A layout we cannot read is
    never abandoned: it is not ours to remove."""
    if _is_blank(header):
        return True
    info = _inspect(header)
    return info.initialised and not info.live_attachments


def _init_header(header: SharedMemory, config: ShmPoolConfig) -> None:
    fixed = np.ndarray((), dtype=_FIXED_DTYPE, buffer=_buffer(header))
    fixed["version"] = _VERSION
    fixed["num_slots"] = config.num_slots
    fixed["slot_bytes"] = config.slot_bytes
    # Last, so a creator that dies half-way leaves a header _is_blank() spots.
    fixed["magic"] = _MAGIC


def _buffer(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:
        raise ValueError(f"shared memory segment {shm.name!r} is closed")
    return buf


# ---- argument validation (outside the lock) -----------------------------------


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > _MAX_NAME_LEN:
        raise ValueError(
            f"ShmPoolConfig.name must match [A-Za-z0-9_.-]+ and be at most "
            f"{_MAX_NAME_LEN} characters, got {name!r}"
        )


def _validate_keys(keys: Sequence[bytes]) -> list[bytes]:
    checked = [bytes(key) for key in keys]
    for i, key in enumerate(checked):
        if len(key) != KEY_BYTES:
            raise ValueError(f"keys[{i}] must be exactly {KEY_BYTES} bytes, got {len(key)}")
    return checked


def _joined_keys(keys: Sequence[bytes]) -> bytes:
    """The keys, checked, concatenated (as the slot index takes them)."""
    return b"".join(_validate_keys(keys))


def _validate_items(
    items: Sequence[tuple[bytes, bytes | memoryview]], slot_bytes: int
) -> tuple[list[bytes], list[npt.NDArray[np.uint8]]]:
    """Keys and blobs as byte arrays, first occurrence of each key only."""
    keys = _validate_keys([key for key, _ in items])
    first: dict[bytes, npt.NDArray[np.uint8]] = {}
    for i, (key, (_, blob)) in enumerate(zip(keys, items, strict=True)):
        data = _readable_bytes(blob, i)
        if data.size > slot_bytes:
            raise ValueError(
                f"items[{i}] blob has {data.size} bytes, over the pool's slot_bytes={slot_bytes}"
            )
        first.setdefault(key, data)
    return list(first), list(first.values())


def _readable_bytes(blob: bytes | memoryview, index: int) -> npt.NDArray[np.uint8]:
    try:
        return np.frombuffer(blob, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"items[{index}] blob must be a C-contiguous buffer: {exc}") from exc


def _writable_bytes(dest: memoryview, index: int) -> npt.NDArray[np.uint8]:
    try:
        target = np.frombuffer(dest, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"dests[{index}] must be a C-contiguous buffer: {exc}") from exc
    if not target.flags.writeable:
        raise ValueError(f"dests[{index}] is read-only")
    return target


# ---- process liveness ----------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of ``pid`` from procfs, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name in field 2 may itself contain ")" and spaces.
    fields = raw.rpartition(b")")[2].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


def _own_pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_alive(pid: int, start: int, pidns: int) -> bool:
    own_ns = _own_pid_namespace()
    if pidns and own_ns and pidns != own_ns:
        # Its PID means nothing in our namespace: assume alive rather than
        # unlink a pool a process in another container still uses.
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, ticks = stat
    # A zombie still answers kill(0), and a different start time means the
    # PID has been reused by an unrelated process.
    return state not in ("Z", "X") and (start == 0 or ticks == start)


def _prune_dead(
    pids: npt.NDArray[np.int64], starts: npt.NDArray[np.uint64], pidns: npt.NDArray[np.uint64]
) -> None:
    for i in np.flatnonzero(pids != 0).tolist():
        if not _pid_alive(int(pids[i]), int(starts[i]), int(pidns[i])):
            pids[i] = 0
            starts[i] = 0
            pidns[i] = 0


def _add_attachment(views: _Views) -> int:
    _prune_dead(views.att_pid, views.att_start, views.att_pidns)
    free = np.flatnonzero(views.att_pid == 0)
    if free.size == 0:
        raise RuntimeError(f"shared-memory pool already has {MAX_ATTACHMENTS} live attachments")
    index = int(free[0])
    pid = os.getpid()
    stat = _proc_stat(pid)
    views.att_pid[index] = pid
    views.att_start[index] = 0 if stat is None else stat[1]
    views.att_pidns[index] = _own_pid_namespace()
    return index


# ---- files and segments ---------------------------------------------------------


def _lock_file(path: str) -> int:
    """Open ``path`` and take its flock; returns the locked fd. Blocks.

    The last process to close a pool unlinks the lock file while holding it,
    so a waiter may wake up holding a lock on a dead inode: retry until the
    inode we hold is the one the path names.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _unlock_and_close(fd: int) -> None:
    # Unlock first: a forked child holding a copy of the fd would otherwise
    # keep the lock held after we close ours.
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _unlink_file(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _open_segment(segment: str, create_size: int | None = None) -> SharedMemory:
    if create_size is None:
        shm = SharedMemory(segment)
    else:
        shm = SharedMemory(segment, create=True, size=create_size)
    # On 3.11 every process that opens a segment registers it with its
    # resource tracker, which unlinks it when that process exits: the first
    # process to exit would destroy the pool under the others.
    resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    return shm


def _open_segment_if_sound(segment: str) -> SharedMemory | None:
    """The segment, or None if it does not exist or is empty (its creator
    died between creating and sizing it)."""
    try:
        return _open_segment(segment)
    except FileNotFoundError:
        return None
    except ValueError:
        return None


def _unlink_segment(segment: str) -> bool:
    try:
        _shm_unlink(f"/{segment}")
    except FileNotFoundError:
        return False
    return True


def _close_segment(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:
        _PINNED.append(shm)


def _reserve(segment: str, size: int) -> None:
    """Allocate the segment's pages now. tmpfs allocates on first touch, and a
    full /dev/shm then kills the writing process with SIGBUS mid-memcpy;
    reserving turns that into an OSError here."""
    path = os.path.join(_SHM_DIR, segment)
    if not hasattr(os, "posix_fallocate") or not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise OSError(exc.errno, f"cannot reserve {size} bytes for {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _create(config: ShmPoolConfig) -> tuple[SharedMemory, SharedMemory]:
    header_name, data_name = segment_names(config.name)
    data_bytes = config.num_slots * config.slot_bytes
    # A data segment without a header is debris of a creator that died.
    _unlink_segment(data_name)
    header = _open_segment(header_name, _header_dtype(config.num_slots).itemsize)
    try:
        data = _open_segment(data_name, data_bytes)
        try:
            _reserve(data_name, data_bytes)
            _init_header(header, config)
        except BaseException:
            _close_segment(data)
            raise
    except BaseException:
        _close_segment(header)
        _unlink_segment(header_name)
        _unlink_segment(data_name)
        raise
    return header, data


def _open_or_create(config: ShmPoolConfig) -> tuple[SharedMemory, SharedMemory]:
    """Attach to the pool's segments, or create them. Runs under the lock."""
    header_name, data_name = segment_names(config.name)
    header = _open_segment_if_sound(header_name)
    if header is None or _is_blank(header):
        return _recreate(config, header)
    info = _inspect(header)
    if not info.initialised:
        _close_segment(header)
        raise ValueError(f"{header_name} is not a version-{_VERSION} tandem shared-memory pool")
    if (info.num_slots, info.slot_bytes) != (config.num_slots, config.slot_bytes):
        if not info.live_attachments:
            # Left behind by processes that died; nobody can be using it.
            return _recreate(config, header)
        _close_segment(header)
        raise ValueError(
            f"pool {config.name!r} exists with num_slots={info.num_slots}, "
            f"slot_bytes={info.slot_bytes}; requested num_slots={config.num_slots}, "
            f"slot_bytes={config.slot_bytes}"
        )
    try:
        data = _open_segment(data_name)
    except BaseException:
        _close_segment(header)
        raise
    return header, data


def _recreate(
    config: ShmPoolConfig, header: SharedMemory | None
) -> tuple[SharedMemory, SharedMemory]:
    if header is not None:
        _close_segment(header)
    for segment in segment_names(config.name):
        _unlink_segment(segment)
    return _create(config)


# ---- attach and detach ------------------------------------------------------------


@dataclass
class _PoolState:
    """Everything close() needs, kept apart from ShmBlockPool so that the
    weakref finalizer does not keep the pool object alive."""

    name: str
    lock_fd: int
    header: SharedMemory
    data: SharedMemory
    views: _Views | None
    attachment: int
    owner_pid: int = field(default_factory=os.getpid)
    thread_lock: threading.Lock = field(default_factory=threading.Lock)


def _attach(config: ShmPoolConfig, compiled: ModuleType | None) -> _PoolState:
    fd = _lock_file(lock_path(config.name))
    try:
        header, data = _open_or_create(config)
        try:
            views = _Views.over(header, data, config, compiled)
            attachment = _add_attachment(views)
        except BaseException:
            _close_segment(header)
            _close_segment(data)
            raise
    except BaseException:
        _unlock_and_close(fd)
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    _populate(data)
    return _PoolState(config.name, fd, header, data, views, attachment)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module
_PAGE = 4096


def _populate(segment: SharedMemory) -> None:
    """Map every page of the data segment into this process now, without
    changing its contents. Otherwise each first touch of a page, by every
    process, is a fault inside a copy: measured 0.8 GB/s for saves into
    untouched slots against 4-6 GB/s once mapped."""
    mapping = getattr(segment, "_mmap", None)
    try:
        if mapping is None:
            raise OSError("no mmap")
        mapping.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        # Older kernels: a read of one byte per page maps it (tmpfs pages
        # map writable on a read fault).
        int(np.frombuffer(_buffer(segment), np.uint8)[::_PAGE].sum())


def _detach(state: _PoolState) -> None:
    """Drop this attachment; unlink everything if it was the last live one.
    Runs at most once per pool, from close(), collection, or exit."""
    with state.thread_lock:
        views, state.views = state.views, None
        if views is None:
            return
        try:
            if os.getpid() == state.owner_pid:
                _detach_locked(state, views)
        finally:
            del views
            _close_segment(state.header)
            _close_segment(state.data)
            # Close without unlocking: in a forked child the fd shares the
            # parent's open file description, so unlocking would drop its lock.
            os.close(state.lock_fd)


def _detach_locked(state: _PoolState, views: _Views) -> None:
    fcntl.flock(state.lock_fd, fcntl.LOCK_EX)
    try:
        views.att_pid[state.attachment] = 0
        views.att_start[state.attachment] = 0
        views.att_pidns[state.attachment] = 0
        _prune_dead(views.att_pid, views.att_start, views.att_pidns)
        if not np.any(views.att_pid != 0):
            for segment in segment_names(state.name):
                _unlink_segment(segment)
            # Unlinked while still held: waiters notice the stale inode and retry.
            _unlink_file(lock_path(state.name))
    finally:
        # Explicitly, not by closing: a forked child may still hold a copy of
        # this fd, and the lock would live on with it.
        fcntl.flock(state.lock_fd, fcntl.LOCK_UN)
