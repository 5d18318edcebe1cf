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


def _cpu_seconds(pids: Sequence[int]) -> float | None:
    """Seconds every thread of `pids` has run on a core (Linux `/proc/PID/task/*/schedstat`,
    nanoseconds); None where /proc cannot tell. A thread that ends meanwhile is skipped."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            return None
        for task in tasks:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


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
        cpu, wall = _cpu_seconds(self.pids), time.perf_counter()
        yield
        end_wall, end_cpu = time.perf_counter(), _cpu_seconds(self.pids)
        if cpu is None or end_cpu is None:
            self.readable = False
        else:
            self.cpu, self.wall = self.cpu + end_cpu - cpu, self.wall + end_wall - wall

    def cores(self) -> float:
        """Cores busy on average over the spans, within 1..MAX_TRANSFER_CPU (1 where the
        CPU could not be read)."""
        if not self.readable or self.wall <= 0:
            return 1.0
        return min(MAX_TRANSFER_CPU, max(1.0, self.cpu / self.wall))
