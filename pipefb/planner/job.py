"""Planning a job: which schedules it may use, its cluster with measured speeds and caps, the
search, and its result as JSON (tables and timelines: `pipefb.app.planview`).

Shared by `pipefb plan` and the coordinator's `plan: auto`; the search itself is
`pipefb.planner.groups.search_groups` (the number of pipeline groups) over
`pipefb.planner.search.search` (one group's plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipefb.errors import ConfigError
from pipefb.job.config import AUTO, JobConfig
from pipefb.planner.groups import GroupSearch, search_groups
from pipefb.schedule import KINDS
from pipefb.sim.cluster import Cluster, WorkerSpec
from pipefb.sim.costs import Profile


def job_schedules(job: JobConfig) -> tuple[str, ...]:
    """The schedule kinds the planner may pick for `job`: all, or the one it names."""
    return KINDS if job.schedule == AUTO else (job.schedule,)


def job_cluster(cluster: Cluster, workers: int, speeds: Sequence[float] | None = None,
                memory_cap: int = 0, device: str = "") -> Cluster:
    """The first `workers` workers of `cluster`, with measured relative speeds multiplied in,
    every cap lowered to `memory_cap` (0: unchanged), computing on the job's `device` (""
    keeps the cluster's; it decides where a rank's stash copies run, [Note: tier copies]
    in pipefb.sim.costmodel). Under a cap, as without one,
    stashes go through the copy lane and their bytes in flight count in each rank's peak
    ([Note: copy lane] in pipefb.sim.copylane), as the workers write them
    ([Note: background stash] in offload_store/writer.py), but for a CPU rank that copies
    them on its compute thread ([Note: tier copies]).

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
    return replace(cluster, workers=tuple(specs), device=device or cluster.device)


def plan_job(job: JobConfig, profile: Profile, cluster: Cluster) -> GroupSearch:
    """Searches the plans `job` allows on `cluster`: the number of groups it names, or
    (groups 0) every count the training-time model ranks best (`pipefb.planner.groups`)."""
    return search_groups(profile, cluster, job.batch_size, schedules=job_schedules(job),
                         mode=job.mode, staleness=job.staleness,
                         groups=[job.groups] if job.groups else None,
                         stale_microbatches=job.stale_microbatches())


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
