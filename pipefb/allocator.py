"""Tunes the C allocator of a training process so that a step reuses the memory the last
step freed instead of asking the kernel for fresh pages.

glibc's malloc serves a large block (beyond `M_MMAP_THRESHOLD`) with its own `mmap` and
gives it back on free, and trims the top of its heap once more than `M_TRIM_THRESHOLD` is
free there. Torch's CPU tensors are malloc'd, and a training step allocates and frees the
same large activations again and again, so with glibc's defaults every step pays page
faults to zero fresh pages (see docs/benchmarks.md). The thresholds below keep those blocks
in the heap and the freed heap in the process; the trim threshold sits above what one step
frees at once, so the heap is not trimmed between steps. The cost is memory: up to
`TRIM_THRESHOLD_BYTES` of freed heap stays in the process, and blocks up to
`MMAP_THRESHOLD_BYTES` come from the heap.

Threads: glibc gives threads their own arenas, whose heaps it creates and deletes as threads
come and go (gRPC's event engine starts and ends threads while a worker trains), so blocks
freed in a thread's arena come back as fresh pages. With one arena (`ARENAS`) every thread
allocates from the main heap under the thresholds above. A worker computes on one thread at
a time, so the threads do not contend for that one arena.

Workers call `keep_freed_memory` at start; benchmarks call it in their baselines' processes
too, so comparisons stay like for like. Elsewhere (not glibc) it does nothing.

Work that is not a step (a Profile RPC builds the model, loads data and times every layer,
then drops it all) frees memory the next steps will not reuse; `release_freed_memory` then
gives the free pages back (`malloc_trim`, which also returns free pages inside the heap),
so that the large thresholds do not leave that memory resident in a long-lived worker.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD_BYTES = 64 << 20  # freed heap kept before trimming
ARENAS = 1  # every thread allocates from the main heap, under the thresholds above
_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds and its arena count for this process (see the
    module docstring); call it before starting threads.

    Returns:
        True when all three took effect, False where the C library is not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    arenas_ok = libc.mallopt(_M_ARENA_MAX, ARENAS)
    return bool(mmap_ok and trim_ok and arenas_ok)


def release_freed_memory() -> bool:
    """Returns this process's free heap pages to the kernel (glibc's `malloc_trim`; see the
    module docstring). Returns False where the C library is not glibc."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) in (0, 1)


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc on Linux, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


__all__ = ["ARENAS", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory",
           "release_freed_memory"]
