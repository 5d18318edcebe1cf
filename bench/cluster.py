"""The local cluster the measured benches run their jobs on, a client for it, and the
interleaved loop they run their systems in."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def local_client(workers: int, folder: Path, *, threads: int = 0,
                 env: dict[str, str] | None = None, calibrated: bool = False,
                 cluster_file: Path | None = None, pin_cpus: bool = True) -> Iterator[Any]:
    """A coordinator client of a fresh local cluster whose `workers` workers registered.

    Args:
        workers: worker processes to start.
        folder: where logs (and the cluster description) go.
        threads: torch threads per worker (0: `pipefb.app.local.default_threads`).
        env: extra environment of every process.
        calibrated: give the coordinator this machine's calibrated cluster description
            (what `plan: auto` plans on).
        cluster_file: give the coordinator this cluster description instead.
        pin_cpus: each worker runs on cores of its own where there are enough
            ([Note: pinned workers] in pipefb/cpus.py).
    """
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices
    from pipefb.app.train import local_cluster_file

    if cluster_file is None and calibrated:
        cluster_file = local_cluster_file(workers, folder)
    with LocalServices(workers, folder, threads=threads, extra_env=env,
                      cluster_file=cluster_file, pin_cpus=pin_cpus) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(workers)
        yield client


def run_interleaved(counts: Sequence[int], systems: Sequence[str], repeats: int,
                    run_one: Callable[[str, int], dict[str, Any]]
                    ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """`run_one(system, workers)` for every system and worker count, `repeats` times
    interleaved (so the machine's noise spreads over all systems alike), with progress.

    Returns:
        str(workers) -> system -> one result per repeat.
    """
    started = time.perf_counter()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(n): {s: [] for s in systems} for n in counts}
    for r in range(repeats):
        for n in counts:
            for name in systems:
                runs[str(n)][name].append(run_one(name, n))
            print(f"repeat {r + 1}/{repeats}, {n} workers done "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    return runs
