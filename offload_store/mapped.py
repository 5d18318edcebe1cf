"""Memory mappings of node-local tier segment files, kept per file, through which a
producer writes a segment with one memcpy and a consumer's taken tensors view it with no
copy.

[Note: segment mappings] A write into a tmpfs file page by page (`os.pwrite`) costs the
kernel a page lookup and lock per 4 KiB, a file's first write allocates its pages, and
mapping a file costs a page-table entry per 4 KiB: 64 MiB of them take longer than
copying 64 MiB. A segment file's pages, though, stay the same while the file goes round
its directory (written, taken, lent, spare, written again: [Note: spare segments] in
`offload_store.segments`), so each process keeps one shared mapping per file it touched
(`SegmentMaps`, populated once) for as long as the file exists: a producer copies a
segment into the mapping of the spare it claimed, a consumer's tensors view the mapping
of the segment it took. Who may touch the bytes follows the file's name: a producer
writes only a spare it renamed to a segment, a consumer's tensors view only a segment it
renamed to lent, and a lent file becomes a spare again only once nothing views it (a
finalizer on the view's holder), so the tensors behave as the consumer's own memory: they
are writable, and nobody else reads or writes them while they live. A mapping goes when
its file is gone (checked when a file is mapped anew, and every `PURGE_EVERY` lookups) or
at `close`; one that tensors still view lives until they go.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import torch

PURGE_EVERY = 32  # lookups between checks of every kept mapping's file
MADV_POPULATE_WRITE = 23  # Linux 5.14: map every page of a range writable now, not at use


class SegmentMaps:
    """One process's shared mappings of tier files, by inode ([Note: segment mappings]).
    Safe to share between threads."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[int, mmap.mmap]] = {}  # inode -> (its fd, its mapping)
        self._calls = 0
        self._lock = threading.Lock()

    def copy_into(self, fd: int, size: int, parts: Sequence[tuple[int, memoryview]]) -> None:
        """Copies each (offset, bytes) into the file `fd` of `size` bytes (truncated to it
        already) through its mapping."""
        holder = (ctypes.c_uint8 * size).from_buffer(self._mapping(fd, size))
        target = torch.frombuffer(holder, dtype=torch.uint8)
        for offset, view in parts:
            if view.nbytes:
                target[offset:offset + view.nbytes].copy_(
                    torch.frombuffer(view.cast("B"), dtype=torch.uint8))

    def view(self, fd: int, size: int, released: Callable[[], None]) -> torch.Tensor:
        """The `size` bytes of the file `fd` as a (size,) uint8 tensor viewing its mapping;
        `released` runs once no tensor views these bytes any more."""
        holder = (ctypes.c_uint8 * size).from_buffer(self._mapping(fd, size))
        weakref.finalize(holder, released)
        return torch.frombuffer(holder, dtype=torch.uint8)

    def close(self) -> None:
        """Drops every mapping (those still viewed go with their views)."""
        with self._lock:
            maps, self._maps = self._maps, {}
        for own_fd, mapping in maps.values():
            _unmap(own_fd, mapping)

    def _mapping(self, fd: int, size: int) -> mmap.mmap:
        """The mapping of the file `fd`: the one kept for its inode if that is still this
        file and has `size` bytes, else a new one with every page mapped (the mappings of
        files gone meanwhile go then)."""
        inode = os.fstat(fd).st_ino
        with self._lock:
            self._calls += 1
            if self._calls % PURGE_EVERY == 0:  # a removed spare's pages do not stay mapped
                self._purge()
            entry = self._maps.get(inode)
            # the kept file is this one while it is still linked: a live file's inode number
            # is its own (a removed file's number may be reused by a new file)
            if entry is not None and len(entry[1]) == size and os.fstat(entry[0]).st_nlink:
                return entry[1]
            self._purge()
            entry = self._maps.pop(inode, None)
            if entry is not None:
                _unmap(*entry)
            mapping = map_file(fd, size)
            self._maps[inode] = (os.dup(fd), mapping)
            return mapping

    def _purge(self) -> None:
        """Drops the mappings of files gone (under `_lock`)."""
        for gone in [i for i, (own, _) in self._maps.items() if os.fstat(own).st_nlink == 0]:
            _unmap(*self._maps.pop(gone))


def map_file(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of the file `fd` of `size` bytes, every page mapped writable now."""
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: the pages are mapped at first touch
        pass
    return mapping


def unmap(mapping: mmap.mmap) -> None:
    """Closes a mapping, or leaves it to the tensors that still view it."""
    try:
        mapping.close()
    except BufferError:  # tensors still view it: it is unmapped when they go
        pass


def _unmap(fd: int, mapping: mmap.mmap) -> None:
    os.close(fd)
    unmap(mapping)
