"""Reads how many cores a transfer keeps busy: the CPU seconds of every thread of some
processes (Linux `/proc/PID/task/*/schedstat`) over the wall seconds of timed spans.

Both ends of a transfer work at once (the sender and receiver, or this process and
redis-server), so a link's `cpu` counts the threads of both processes, and the simulator
charges a transfer that many cores rather than one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipefb.sim.cluster import MAX_TRANSFER_CPU


def _cpu_by_thread(pids: Sequence[int]) -> dict[str, int] | None:
    """Nanoseconds each thread of `pids` has run on a core, by `PID/TID` (Linux
    `/proc/PID/task/*/schedstat`); None where /proc cannot tell. A thread that ends while
    it is read is skipped."""
    by_thread: dict[str, int] = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            return None
        for task in tasks:
            with contextlib.suppress(OSError, ValueError, IndexError):
                by_thread[f"{pid}/{task.name}"] = int((task / "schedstat").read_text().split()[0])
    return by_thread


def _ran(before: dict[str, int], after: dict[str, int]) -> float:
    """Seconds the threads ran between two readings: each thread's own difference (one
    started meanwhile from 0); a thread that ended meanwhile counts nothing, so threads that
    come and go (a closed stream's) never make the sum negative."""
    return sum(ns - before.get(key, 0) for key, ns in after.items()) / 1e9


def child_pids(pid: int) -> list[int]:
    """The children of process `pid` (the store's redis-server under `python -m
    offload_store`); none where /proc cannot tell."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


class CpuMeter:
    """CPU seconds of some processes (all their threads) against the wall seconds of the
    spans it times: how many cores a transfer keeps busy, both ends together."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids, self.cpu, self.wall, self.readable = list(pids), 0.0, 0.0, True

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Times the body."""
        cpu, wall = _cpu_by_thread(self.pids), time.perf_counter()
        yield
        end_wall, end_cpu = time.perf_counter(), _cpu_by_thread(self.pids)
        if cpu is None or end_cpu is None:
            self.readable = False
        else:
            self.cpu, self.wall = self.cpu + _ran(cpu, end_cpu), self.wall + end_wall - wall

    def cores(self) -> float:
        """Cores busy on average over the spans, within 1..MAX_TRANSFER_CPU (1 where the
        CPU could not be read)."""
        if not self.readable or self.wall <= 0:
            return 1.0
        return min(MAX_TRANSFER_CPU, max(1.0, self.cpu / self.wall))
