"""The simulator's entry point: `simulate` a plan on a cluster and read off its prediction."""

from __future__ import annotations

import statistics
from collections import defaultdict
from itertools import pairwise

from pipefb.plan.plan import Plan, lowered_schedule, schedule_for
from pipefb.schedule import Schedule, Topology
from pipefb.sim.cluster import Cluster
from pipefb.sim.costmodel import Costs, stage_of
from pipefb.sim.costs import Profile
from pipefb.sim.engine import Engine
from pipefb.sim.result import Simulation


def _role(topology: Topology, rank: int) -> tuple[str, int]:
    """(role, stage) of `rank`: combined, forward or backward, as in the plan's assignment."""
    fwd = stage_of(topology.forward_workers, rank)
    bwd = stage_of(topology.backward_workers, rank)
    if fwd is not None and bwd is not None:
        return "combined", fwd
    return ("forward", fwd) if fwd is not None else ("backward", bwd or 0)


def simulate(plan: Plan, profile: Profile, cluster: Cluster, iterations: int = 0, *,
             schedule: Schedule | None = None, check: bool = True) -> Simulation:
    """Simulates `iterations` iterations of the plan's step loop ([Note: cost model] in
    pipefb.sim.costmodel).

    Args:
        plan: the plan; rank r runs on `cluster.workers[r]`.
        profile: layer costs (rescaled to the plan's micro-batch size).
        cluster: the workers, links, store and overheads.
        iterations: iterations to run; 0 picks enough to reach the steady state (2 for
            sync plans, 4 + staleness for async ones, one more when forwards lead).
        schedule: a lowered schedule to run instead of the plan's own (not validated).
        check: validate the plan's schedule (with its dry run) first; the planner skips
            it for speed, since the simulation itself finds deadlocks.

    Returns:
        The prediction; `step_seconds` is the median gap between the ends of consecutive
        iterations, leaving out the first when async and the last when forwards lead.

    Raises:
        ScheduleError: the plan fails validation, does not fit the profile or cluster, or
            deadlocks (the message names each stuck worker and what it waits for).
    """
    costs = Costs(plan, profile, cluster)
    if schedule is None:
        schedule = schedule_for(plan) if check else lowered_schedule(plan)
    if plan.groups > 1:  # [Note: groups]: every group runs the same program; simulate one
        schedule = {r: schedule[r] for r in plan.group_ranks()[0] if r in schedule}
    leads = any(a.lead for actions in schedule.values() for a in actions)
    n = iterations or (2 if plan.mode == "sync" and not leads
                       else 4 + plan.staleness + leads)
    engine = Engine(plan, costs, schedule, n)
    engine.run()
    return _prediction(engine, schedule, n, leads)


def _prediction(engine: Engine, schedule: Schedule, n: int, leads: bool) -> Simulation:
    """The `Simulation` of `n` iterations that `engine` ran (see `simulate`'s Returns)."""
    plan = engine.plan
    ends = [0.0] * n
    for _, k, _, _, _, end in engine.records:
        ends[k] = max(ends[k], end)
    steady = ends[1:-1] if leads and n > 3 else ends[1:] if plan.mode == "async" else ends
    gaps = [b - a for a, b in pairwise(steady)] or [ends[-1] / n]
    step_seconds = statistics.median(gaps)
    compute: dict[int, float] = defaultdict(float)
    last = max(0, n - 2)
    ops = engine.program.ops
    for r, k, _, i, start, end in engine.records:
        if k == last and ops[r][i].compute:
            compute[r] += end - start
    return Simulation(
        step_seconds=step_seconds, iterations=n, records=engine.records, schedule=schedule,
        compute_seconds={r: compute.get(r, 0.0) for r in engine.runs},
        peak_memory={r: m.peak for r, m in engine.memory.items()},
        peak_memory_by_kind={r: m.at_peak for r, m in engine.memory.items()},
        peak_node_tier={r: m.tier_peak for r, m in engine.memory.items()},
        roles={r: _role(engine.costs.topology, r) for r in engine.runs})


__all__ = ["simulate"]
