"""Tunes the C allocator of a training process so that a step reuses the memory the last
step freed instead of asking the kernel for fresh pages.

glibc's malloc serves a large block (beyond `M_MMAP_THRESHOLD`) with its own `mmap` and
gives it back on free, and trims the top of its heap once more than `M_TRIM_THRESHOLD` is
free there. Torch's CPU tensors are malloc'd, and a training step allocates and frees the
same large activations again and again, so with glibc's defaults every step pays page
faults to zero fresh pages: a one-rank tiny-GPT step (8 MiB logits per micro-batch) took
about 26,000 minor faults and 170 ms; with the thresholds below, about 70 faults and
120-130 ms (a 32 MiB trim threshold gave nothing: a step frees more). The cost is memory:
up to `TRIM_THRESHOLD_BYTES` of freed heap stays in the process, and blocks up to
`MMAP_THRESHOLD_BYTES` come from the heap.

Threads: glibc gives threads their own arenas, whose heaps it creates and deletes as threads
come and go (gRPC's event engine starts and ends threads while a worker trains), so their
blocks were fresh pages again: a 2-worker gpt job's first worker took about 1,200 faults a
step with the thresholds alone, about 25 with one arena (`ARENAS`). A worker computes on
one thread at a time; the job's steps got faster with one arena, not slower.

Workers call `keep_freed_memory` at start; benchmarks call it in their baselines' processes
too, so comparisons stay like for like. Elsewhere (not glibc) it does nothing.
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
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    arenas_ok = libc.mallopt(_M_ARENA_MAX, ARENAS)
    return bool(mmap_ok and trim_ok and arenas_ok)


__all__ = ["ARENAS", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory"]
