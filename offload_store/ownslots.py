"""A private store's segment files, kept mapped and reused in its own process.

[Note: own slots] A private store ([Note: private index] in `offload_store.shm`) is the
only reader of what it writes, so it needs neither a segment's header nor a file per
stash: it keeps a few files of the tier mapped (slots) and copies each micro-batch's
stash into a free one of the same size, recording in this process where each tensor lies.
A take views the slot's bytes (no copy); the slot is free again once no tensor views
it, or at once when the stash is released untaken. So a put is the tensors' copies and a
take their views, with no system call, lock file, directory scan or rename: each of
those lets the interpreter's lock go to another thread of the worker, and on a busy
host getting it back costs more than the call.

Only a new slot goes through the tier's reservation (the lock file, the cap, spares
dropped first), as `segments.write` does for a segment. The slots are files
``own-<attempt>-<token>.seg`` in the store's job directory, so the tier's cap and its
used bytes count them, and a later attempt's store, or the job's clear, removes those a
crashed worker left ([Note: tier leases] in `offload_store.shm`). A stash whose slot
would pass the cap is not written here (the caller spills it to Redis).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import math
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload_store import segments
from offload_store.mapped import map_file, unmap
from offload_store.segments import SegmentError
from pipefb.codec import NAMES
from pipefb.errors import CodecError

Key = tuple[int, int, int]  # step, micro-batch, version
# free slots kept per size: a step's stashes reuse them; more would hold room of the tier's
# cap that no other writer can free
FREE_SLOTS = 2
# where one tensor lies in a slot: layer, name, dtype, shape, offset
Placed = tuple[int, str, torch.dtype, tuple[int, ...], int]


@dataclass(eq=False)
class _Slot:
    path: Path
    size: int
    fd: int  # kept open: its link count says whether a clear of the job removed the file
    data: torch.Tensor  # (size,) uint8 over the file's shared mapping
    mapping: mmap.mmap


@dataclass
class _Filled:
    slot: _Slot
    placed: list[Placed] = field(default_factory=list)


@functools.lru_cache(maxsize=64)  # a rank's stashes repeat a few sizes
def _offsets(sizes: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Each tensor's offset (aligned to `segments.ALIGN`) and the slot size they need."""
    offsets, offset = [], 0
    for nbytes in sizes:
        offsets.append(offset)
        offset = segments.aligned(offset + nbytes)
    return tuple(offsets), max(offset, segments.ALIGN)


class OwnSlots:
    """One private store's slots ([Note: own slots]). Safe to share between threads."""

    def __init__(self, base: Path, attempt: int, cap_bytes: int,
                 folder: Callable[[], Path]) -> None:
        """Args:
            base: the tier's base directory (its lock file and cap).
            attempt: the job attempt, in the slot files' names.
            cap_bytes: the tier's cap, all jobs.
            folder: the store's job directory (made on first use).
        """
        self.base, self.attempt, self.cap_bytes, self._folder = base, attempt, cap_bytes, folder
        self._free: dict[int, list[_Slot]] = {}  # size -> free slots
        self._filled: dict[Key, _Filled] = {}
        self._slots: list[_Slot] = []  # every slot, lent ones too
        self._lent = 0  # bytes of slots that taken tensors view
        # slots whose views are gone, queued by their finalizers (which may run in the
        # garbage collector on a thread that holds `_lock`) and freed under the lock
        self._returns: deque[_Slot] = deque()
        self._lock = threading.Lock()

    def put(self, key: Key, tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int | None:
        """Copies `tensors` into a free slot of their size (a new one if none is free);
        returns the slot's size, or None when a new slot would pass the tier's cap. A
        stash already here under `key` (a step run again) is replaced: its slot is reused
        or freed, so a None leaves nothing under `key`.

        Raises:
            CodecError: a dtype the codec does not allow.
            FileNotFoundError: the job's directory is gone (a clear of the job removed it).
        """
        items = [(layer, name, tensor) for layer, named in tensors.items()
                 for name, tensor in named.items()]
        for _, _, tensor in items:
            if tensor.dtype not in NAMES:
                raise CodecError(f"dtype {tensor.dtype} is not allowed in the tier")
        offsets, size = _offsets(tuple(t.numel() * t.element_size() for *_, t in items))
        with self._lock:
            replaced = self._filled.pop(key, None)
        if replaced is not None:
            self._give_back(replaced.slot)
        slot = self._claim(size)
        if slot is None:
            return None
        filled = _Filled(slot)
        data = slot.data  # its own hold on the mapping: a `close` meanwhile lets go of slot's
        if data.numel() != size:  # closed already (`_remove` left it empty)
            return None
        try:
            with torch.no_grad():  # a copy, not an autograd node
                for (layer, name, tensor), offset in zip(items, offsets, strict=True):
                    nbytes = tensor.numel() * tensor.element_size()
                    data[offset:offset + nbytes].view(tensor.dtype).view(
                        tensor.shape).copy_(tensor)
                    filled.placed.append((layer, name, tensor.dtype, tuple(tensor.shape),
                                          offset))
        except BaseException:
            self._give_back(slot)
            raise
        with self._lock:
            if slot not in self._slots:  # closed meanwhile: the caller spills the stash
                return None
            self._filled[key] = filled
        return size

    def take(self, key: Key, names: Mapping[int, Sequence[str]]
             ) -> tuple[dict[int, dict[str, torch.Tensor]], int] | None:
        """The stash put under `key`, as tensors viewing its slot (writable; the slot is
        free again once none is left), and the slot's size; None when it is not here.

        Raises:
            SegmentError: `names` are not the tensors the stash holds (the stash is
                dropped: a take consumes it).
        """
        with self._lock:
            filled = self._filled.pop(key, None)
        if filled is None:
            return None
        slot = filled.slot
        held = sorted((layer, name) for layer, name, *_ in filled.placed)
        asked = sorted((layer, name) for layer, named in names.items() for name in named)
        if held != asked:
            self._give_back(slot)
            raise SegmentError(f"slot {slot.path.name} holds {held}; a take asked for {asked}")
        try:
            holder = (ctypes.c_uint8 * slot.size).from_buffer(slot.mapping)
            data = torch.frombuffer(holder, dtype=torch.uint8)
            out: dict[int, dict[str, torch.Tensor]] = {}
            for layer, name, dtype, shape, offset in filled.placed:
                nbytes = dtype.itemsize * math.prod(shape)
                out.setdefault(layer, {})[name] = data[offset:offset + nbytes].view(
                    dtype).view(shape)
        except BaseException:  # e.g. a close unmapped it meanwhile
            self._give_back(slot)
            raise
        with self._lock:
            self._lent += slot.size
        weakref.finalize(holder, self._returns.append, slot)
        return out, slot.size

    def release(self, key: Key) -> tuple[int, int] | None:
        """Frees the slot of a stash not taken; returns its size and how many tensors it
        held (None: not here)."""
        with self._lock:
            filled = self._filled.pop(key, None)
        if filled is None:
            return None
        self._give_back(filled.slot)
        return filled.slot.size, len(filled.placed)

    def held_bytes(self) -> int:
        """Bytes of the slots no taken tensor views: those holding stashes and the free."""
        with self._lock:
            self._drain_returns()
            return sum(s.size for s in self._slots) - self._lent

    def close(self) -> None:
        """Removes every slot's file and forgets the stashes (tensors that view a slot
        keep its mapping until they go)."""
        with self._lock:
            slots, self._slots, self._free, self._filled = self._slots, [], {}, {}
            self._lent = 0
            self._returns.clear()
        for slot in slots:
            _remove(slot)

    def _claim(self, size: int) -> _Slot | None:
        """A free slot of `size` bytes whose file is still there, else a new one (None:
        past the cap). A slot whose file a clear of the job removed is dropped, with every
        other (the clear removed theirs too)."""
        with self._lock:
            self._drain_returns()
            free = self._free.get(size)
            slot = free.pop() if free else None
        if slot is not None and os.fstat(slot.fd).st_nlink:
            return slot
        if slot is not None:
            self.close()
        return self._new(size)

    def _new(self, size: int) -> _Slot | None:
        """A new slot of `size` bytes, reserved under the tier's lock; None past the cap
        (after the tier's spares and this store's free slots went)."""
        folder = self._folder()
        with open(self.base / segments.LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if segments.used_bytes(self.base) + size > self.cap_bytes:
                segments.drop_spares(self.base, "*+*/")
                self._drop_free()
                if segments.used_bytes(self.base) + size > self.cap_bytes:
                    return None
            path = folder / segments.own_name(self.attempt)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, size)
                mapping = map_file(fd, size)
                holder = (ctypes.c_uint8 * size).from_buffer(mapping)
                slot = _Slot(path, size, fd, torch.frombuffer(holder, dtype=torch.uint8),
                             mapping)
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        with self._lock:
            self._slots.append(slot)
        return slot

    def _drop_free(self) -> None:
        """Removes the free slots (a stash of a new size needs their room)."""
        with self._lock:
            self._drain_returns()
            free = [s for slots in self._free.values() for s in slots]
            self._free = {}
            self._slots = [s for s in self._slots if s not in free]
        for slot in free:
            _remove(slot)

    def _give_back(self, slot: _Slot) -> None:
        """Frees a slot: kept for the next stash of its size, up to `FREE_SLOTS` of them;
        removed beyond (its room goes back to the tier's cap for every writer)."""
        with self._lock:
            if slot not in self._slots or self._keep_free(slot):  # closed meanwhile, or kept
                return
        _remove(slot)

    def _drain_returns(self) -> None:
        """Frees the lent slots whose views are gone (under `_lock`)."""
        while self._returns:
            slot = self._returns.popleft()
            if slot in self._slots:
                self._lent -= slot.size
                if not self._keep_free(slot):
                    _remove(slot)

    def _keep_free(self, slot: _Slot) -> bool:
        """Keeps a freed slot for the next stash of its size, up to `FREE_SLOTS` of them;
        past that takes it out of the store's slots, for the caller to remove (under
        `_lock`)."""
        free = self._free.setdefault(slot.size, [])
        if len(free) < FREE_SLOTS:
            free.append(slot)
            return True
        self._slots.remove(slot)
        return False


def _remove(slot: _Slot) -> None:
    """Unlinks a slot's file and unmaps it (once no tensor views it)."""
    slot.path.unlink(missing_ok=True)
    os.close(slot.fd)
    slot.data = torch.empty(0, dtype=torch.uint8)  # lets go of the mapping's buffer
    unmap(slot.mapping)
