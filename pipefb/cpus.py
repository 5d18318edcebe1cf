"""Which cores a process runs on: cpu lists, and the local cluster's share per worker.

[Note: pinned workers] A local cluster pins each worker to cores of its own when the
machine has a core for each of every worker's torch threads: the kernel then never moves
a stage's threads from core to core, nor stacks two stages' compute on one core while
another idles. On the small models, whose steps take milliseconds, that raised 1F1B's
throughput by a third (docs/benchmarks.md). The coordinator, Redis and the client run
wherever the kernel puts them. A worker takes its cores with `--cpus` first thing, for
the threads it has and, by inheritance, every thread it starts. On Kubernetes the
kubelet's static CPU manager gives a Guaranteed pod with whole CPUs cores of its own in
the same way (docs/deploy.md). Where the system cannot pin (no `sched_setaffinity`, as
on macOS) a local cluster leaves its workers to the kernel.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from pipefb.errors import ConfigError

ENV = "PIPEFB_CPUS"  # a worker's `--cpus` from the environment (`python -m worker`)


def allowed() -> list[int]:
    """The cores this process may run on, in order."""
    if not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def parse_cpu_list(text: str) -> set[int]:
    """The cores of a cpu list as `taskset -c` and cpusets write it ("0-3,8").

    Raises:
        ConfigError: an empty list, or a piece that is not a core or a rising range.
    """
    cores: set[int] = set()
    for piece in text.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdecimal() or (dash and not high.isdecimal()):
            raise ConfigError(f"cpu list {text!r}: {piece.strip()!r} is not a core number "
                              "or a range such as 0-3")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ConfigError(f"cpu list {text!r}: the range {piece.strip()!r} runs down")
        cores.update(range(first, last + 1))
    return cores


def format_cpu_list(cores: Iterable[int]) -> str:
    """A cpu list with runs of consecutive cores as ranges ({0, 1, 2, 5} -> "0-2,5")."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin(cores: set[int]) -> None:
    """Runs this process on `cores` only: every thread it has (torch's import starts one)
    and, by inheritance, every thread it starts.

    Raises:
        ConfigError: a core this process may not run on (outside its cpuset, or absent).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cpus: this system cannot pin a process to cores")
    outside = sorted(cores - set(allowed()))
    if outside:
        raise ConfigError(f"--cpus {format_cpu_list(cores)}: core {outside[0]} is not one "
                          f"this process may run on ({format_cpu_list(allowed())})")
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cores)
    os.sched_setaffinity(0, cores)


def share_out(workers: int, threads: int, cores: list[int] | None = None
              ) -> list[set[int]] | None:
    """`threads` cores of their own for each of `workers` workers, in core order, from
    `cores` (default: this process's); None where there are too few to go round."""
    if cores is None:
        if not hasattr(os, "sched_setaffinity"):
            return None
        cores = allowed()
    if workers < 1 or threads < 1 or workers * threads > len(cores):
        return None
    return [set(cores[i * threads:(i + 1) * threads]) for i in range(workers)]
