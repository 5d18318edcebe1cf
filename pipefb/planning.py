"""Planning a job: which schedules it may use, its cluster with measured speeds and caps, the
search, and how the result is shown (table, JSON, timelines).

Shared by `pipefb plan` and the coordinator's `plan: auto`; the search itself is
`pipefb.groups.search_groups` (the number of pipeline groups) over `pipefb.planner.search`
(one group's plan).
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
from pipefb.groups import GroupSearch, search_groups
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


def plan_job(job: JobConfig, profile: Profile, cluster: Cluster) -> GroupSearch:
    """Searches the plans `job` allows on `cluster`: the number of groups it names, or
    (groups 0) every count the training-time model ranks best (`pipefb.groups`)."""
    return search_groups(profile, cluster, job.batch_size, schedules=job_schedules(job),
                         mode=job.mode, staleness=job.staleness,
                         groups=[job.groups] if job.groups else None)


def summary(result: GroupSearch) -> dict[str, Any]:
    """The JSON `pipefb plan --json` prints and report.json keeps under `planner`.

    Peaks by rank cover the first group: every group runs the same program.
    """
    peaks = result.simulation.peak_memory
    return {"plan": result.plan.to_dict(),
            "predicted_step_seconds": result.best.step_seconds,
            "predicted_peak_memory_bytes": max(peaks.values(), default=0),
            "predicted_peak_memory_by_rank": {str(r): b for r, b in sorted(peaks.items())},
            "bubble_fraction": result.simulation.bubble_fraction,
            "groups": result.best.groups,
            "group_candidates": [c.row(result.plan.microbatch_size * result.plan.microbatches
                                       * result.plan.groups) for c in result.choices],
            "candidates": [c.row() for c in result.search.candidates],
            "timeline": result.simulation.timeline()}


def label(result: GroupSearch) -> str:
    """The chosen plan in a few words, e.g. `1f1b sync, M=4 x 2 groups`."""
    groups = result.best.groups
    return result.search.best.label + (f" x {groups} groups" if groups > 1 else "")


def groups_table(result: GroupSearch, batch_size: int) -> Table:
    """Every group count: the training-time model's time and, where searched, the
    simulated one."""
    table = Table(title="pipeline groups (data-parallel across groups)")
    for name in ("groups", "each group", "model ms", "simulated ms", "samples/s", "note"):
        table.add_column(name, justify="right" if "ms" in name or name in (
            "groups", "samples/s") else "left")
    for c in result.choices:
        row = c.row(batch_size)
        done = math.isfinite(c.step_seconds)
        table.add_row(str(c.groups), row["per_group"], f"{row['model_ms']:.2f}",
                      f"{row['simulated_ms']:.2f}" if done else "-",
                      f"{row['samples_per_second']:.1f}" if done else "-",
                      "chosen" if c.groups == result.best.groups else c.note or "slower")
    return table


def candidates_table(result: GroupSearch, batch_size: int, limit: int = 12) -> Table:
    """The chosen group count's candidates for one group as a rich table; the chosen one
    first (samples/s per group: `batch_size` is the group's share)."""
    table = Table(title=f"plans considered for one of {result.best.groups} group(s) "
                        "(simulated; best first)")
    for name in ("candidate", "step ms", "samples/s", "peak MiB", "bubble", "partition",
                 "policy", "note"):
        table.add_column(name, justify="right" if name in ("step ms", "samples/s",
                                                           "peak MiB", "bubble") else "left")
    for c in result.search.candidates[:limit]:
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


def write_timeline(result: GroupSearch, path: Path, measured: dict[str, Any] | None = None
                   ) -> Path:
    """The simulated timeline of the chosen plan (its first group), beside a measured one
    when given."""
    from pipefb.report import plot_timelines

    panels = [(f"simulated: {label(result)}, "
               f"{result.best.step_seconds * 1e3:.1f} ms/step", result.simulation.timeline())]
    if measured is not None:
        panels.append((f"measured: step {measured['step']}", measured))
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_timelines(panels, path)
    return path
