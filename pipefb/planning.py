"""Planning a job: which schedules it may use, its cluster with measured speeds and caps, the
search, and how the result is shown (table, JSON, timelines).

Shared by `pipefb plan` and the coordinator's `plan: auto`; the search itself is
`pipefb.planner.search`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table

from pipefb.cluster import Cluster, WorkerSpec
from pipefb.config import AUTO, JobConfig
from pipefb.costs import Profile
from pipefb.errors import ConfigError
from pipefb.planner import PlanSearch, search
from pipefb.schedule import KINDS


def job_schedules(job: JobConfig) -> tuple[str, ...]:
    """The schedule kinds the planner may pick for `job`: all, or the one it names."""
    return KINDS if job.schedule == AUTO else (job.schedule,)


def job_cluster(cluster: Cluster, workers: int, speeds: Sequence[float] | None = None,
                memory_cap: int = 0) -> Cluster:
    """The first `workers` workers of `cluster`, with measured relative speeds multiplied in
    and every cap lowered to `memory_cap` (0: unchanged).

    Raises:
        ConfigError: the cluster describes fewer workers than the job uses.
    """
    if cluster.size < workers:
        raise ConfigError(f"the cluster describes {cluster.size} workers; the job uses "
                          f"{workers}")
    specs = []
    for i, w in enumerate(cluster.workers[:workers]):
        speed = w.speed * (speeds[i] if speeds is not None else 1.0)
        memory = min(w.memory, memory_cap) if memory_cap else w.memory
        specs.append(WorkerSpec(w.name, speed, memory, w.host))
    return replace(cluster, workers=tuple(specs))


def plan_job(job: JobConfig, profile: Profile, cluster: Cluster) -> PlanSearch:
    """Searches the plans `job` allows on `cluster` (see `pipefb.planner.search`)."""
    return search(profile, cluster, job.batch_size, schedules=job_schedules(job),
                  mode=job.mode, staleness=job.staleness)


def summary(result: PlanSearch) -> dict[str, Any]:
    """The JSON `pipefb plan --json` prints and report.json keeps under `planner`."""
    peaks = result.simulation.peak_memory
    return {"plan": result.plan.to_dict(),
            "predicted_step_seconds": result.best.step_seconds,
            "predicted_peak_memory_bytes": max(peaks.values(), default=0),
            "predicted_peak_memory_by_rank": {str(r): b for r, b in sorted(peaks.items())},
            "bubble_fraction": result.simulation.bubble_fraction,
            "candidates": [c.row() for c in result.candidates],
            "timeline": result.simulation.timeline()}


def candidates_table(result: PlanSearch, batch_size: int, limit: int = 12) -> Table:
    """The best candidates as a rich table; the chosen one first."""
    table = Table(title="plans considered (simulated; best first)")
    for name in ("candidate", "step ms", "samples/s", "peak MiB", "bubble", "partition",
                 "policy", "note"):
        table.add_column(name, justify="right" if name in ("step ms", "samples/s",
                                                           "peak MiB", "bubble") else "left")
    for c in result.candidates[:limit]:
        done = math.isfinite(c.step_seconds)
        row = c.row()
        parts = (str(row["forward_partition"]) if row["forward_partition"] ==
                 row["backward_partition"] else
                 f"F{row['forward_partition']} B{row['backward_partition']}")
        table.add_row(c.label, f"{c.step_seconds * 1e3:.2f}" if done else "-",
                      f"{batch_size / c.step_seconds:.1f}" if done else "-",
                      f"{row['peak_memory_bytes'] / 2**20:.1f}" if done else "-",
                      f"{c.bubble_fraction:.0%}" if done else "-", parts, row["policy"],
                      c.note or "chosen")
    return table


def write_timeline(result: PlanSearch, path: Path, measured: dict[str, Any] | None = None
                   ) -> Path:
    """The simulated timeline of the chosen plan, beside a measured one when given."""
    from pipefb.report import plot_timelines

    panels = [(f"simulated: {result.best.label}, "
               f"{result.best.step_seconds * 1e3:.1f} ms/step", result.simulation.timeline())]
    if measured is not None:
        panels.append((f"measured: step {measured['step']}", measured))
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_timelines(panels, path)
    return path
