"""Group hybrid parallelism planning: how many pipeline groups, and each group's plan.

N workers form G groups of N/G; each group is a whole pipeline over its workers and
takes 1/G of the step's samples; after the backward pass every stage's gradients are
summed across the groups (a ring all-reduce) before the optimizer step.

[Note: training-time model] For each G dividing the workers (and the batch), the model
takes the best analytic step time of one group's pipeline on its share of the cluster at
batch B/G (`planner.best_estimate`: compute, fill-and-drain bubble, activation transfer
and stash traffic) and adds the ring all-reduce of the largest stage's gradients over G
ranks on the link between groups. It simulates nothing, so ranking every G is cheap;
the planner then runs the full search (partition, policy under the caps, simulation) for
the model's shortlist and keeps the fastest simulated one. The shortlist is the best
`TOP_BY_MODEL` values of G by the model and every other G within `MODEL_SLACK` of the
model's best: the model errs by different amounts for different G (its fill-and-drain
term is pessimistic for deep 1F1B pipelines, by an amount that depends on G), so
near-ties in the model are not trusted to rank.
`exhaustive=True` runs the full search for every G instead: the reference the model's
choice is measured against (tests/test_groups_planner.py, bench/groups.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipefb.errors import ConfigError, ScheduleError
from pipefb.plan.plan import Plan, replicate
from pipefb.planner.candidates import PlanSearch
from pipefb.planner.search import best_estimate, search
from pipefb.schedule import KINDS
from pipefb.sim.cluster import Cluster, group_view, ring_link
from pipefb.sim.costs import Profile, ring_allreduce_seconds
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

TOP_BY_MODEL = 3  # values of G the planner searches and simulates in full, at least
MODEL_SLACK = 0.10  # and every G whose model time is within this fraction of the best's


@dataclass(frozen=True)
class GroupChoice:
    """One group count: its model time, and its simulated plan if it was searched."""

    groups: int
    model_seconds: float  # the training-time model's step time
    step_seconds: float = math.inf  # simulated; inf when not searched or nothing fits
    plan: Plan | None = None  # over all groups, when searched
    note: str = ""

    def row(self, batch_size: int) -> dict[str, Any]:
        """A table row: G, the group's schedule, model and simulated ms, samples/s."""
        plan = self.plan
        return {
            "groups": self.groups,
            "per_group": (f"{plan.schedule} {plan.mode} {len(plan.assignment) // self.groups} "
                          f"workers, {plan.microbatches} x {plan.microbatch_size}"
                          if plan else ""),
            "model_ms": self.model_seconds * 1e3,
            "simulated_ms": self.step_seconds * 1e3,
            "samples_per_second": batch_size / self.step_seconds if self.step_seconds else 0.0,
            "note": self.note,
        }


@dataclass(frozen=True)
class GroupSearch:
    """The chosen group count, its per-group search and every count considered."""

    best: GroupChoice
    search: PlanSearch  # the chosen G's per-group search: its candidates and timeline
    simulation: Simulation  # of the chosen plan over all groups
    choices: tuple[GroupChoice, ...]  # by group count

    @property
    def by_model(self) -> GroupChoice:
        """The fastest simulated in the model's shortlist: what the planner picks without
        `exhaustive` (with it, compare this with `best`)."""
        top = set(shortlist({c.groups: c.model_seconds for c in self.choices}))
        return min((c for c in self.choices if c.groups in top), key=lambda c: c.step_seconds)

    @property
    def plan(self) -> Plan:
        """The chosen plan over all groups, with its predicted step time."""
        assert self.best.plan is not None
        return self.best.plan


def group_counts(workers: int, batch_size: int, n_layers: int) -> list[int]:
    """Group counts that divide the workers and the batch, each group holding at most one
    stage per layer."""
    return [g for g in range(1, workers + 1)
            if workers % g == 0 and batch_size % g == 0 and workers // g <= n_layers]


def shortlist(modelled: dict[int, float]) -> list[int]:
    """The group counts searched in full, best model time first: the best `TOP_BY_MODEL`
    and every other within `MODEL_SLACK` of the best ([Note: training-time model])."""
    ranked = sorted(modelled, key=lambda g: modelled[g])
    bound = (1 + MODEL_SLACK) * modelled[ranked[0]]
    return [g for i, g in enumerate(ranked) if i < TOP_BY_MODEL or modelled[g] <= bound]


def grouped(plan: Plan, groups: int) -> Plan:
    """One group's plan repeated on `groups` consecutive blocks of ranks."""
    return replace(plan, groups=groups, assignment=replicate(plan.assignment, groups))


def allreduce_seconds(plan: Plan, profile: Profile, cluster: Cluster) -> float:
    """The slowest stage's ring all-reduce of its gradients over the plan's groups."""
    if plan.groups == 1:
        return 0.0
    topology = plan.topology(0)
    return max(ring_allreduce_seconds(profile.param_bytes(topology.layers_of_backward(s)),
                                      plan.groups, ring_link(cluster, rank, plan.groups))
               for s, rank in enumerate(topology.backward_workers))


def model_seconds(profile: Profile, cluster: Cluster, batch_size: int, groups: int, *,
                  schedules: Sequence[str] = KINDS, mode: str = "sync", staleness: int = 1
                  ) -> float:
    """The training-time model's step time with `groups` groups ([Note: training-time
    model])."""
    one, estimate = best_estimate(profile, group_view(cluster, groups), batch_size // groups,
                                  schedules=schedules, mode=mode, staleness=staleness)
    return estimate + allreduce_seconds(grouped(one, groups), profile, cluster)


def search_groups(profile: Profile, cluster: Cluster, batch_size: int, *,
                  schedules: Sequence[str] = KINDS, mode: str = "sync", staleness: int = 1,
                  stale_microbatches: int = 0,
                  groups: Sequence[int] | None = None, exhaustive: bool = False
                  ) -> GroupSearch:
    """Picks the group count and each group's plan ([Note: training-time model]).

    Args:
        profile, cluster, batch_size, schedules, mode, staleness, stale_microbatches: as
            `planner.search`.
        groups: the group counts to consider (default: `group_counts`).
        exhaustive: search and simulate every count, not only the model's best ones.

    Raises:
        ConfigError: a count that does not divide the workers or the batch, or no count
            with a plan that fits (the message gives the reason of the model's best).
    """
    counts = list(groups or group_counts(cluster.size, batch_size, profile.n_layers))
    bad = [g for g in counts if g < 1 or cluster.size % g or batch_size % g]
    if bad:
        raise ConfigError(f"groups {bad[0]} must divide the workers ({cluster.size}) and "
                          f"the batch size ({batch_size})")
    options: dict[str, Any] = {"schedules": schedules, "mode": mode, "staleness": staleness}
    modelled: dict[int, float] = {}
    notes: dict[int, str] = {}
    for g in counts:  # a count whose groups no plan fits (PipeFB on one worker) is out
        try:
            modelled[g] = model_seconds(profile, cluster, batch_size, g, **options)
        except ConfigError as error:
            notes[g] = f"refused: {error}"
    if not modelled:
        raise ConfigError(f"no group count has a plan: {notes[counts[0]]}")
    ranked = sorted(modelled, key=lambda g: modelled[g])
    chosen = ranked if exhaustive else shortlist(modelled)
    searched: dict[int, tuple[GroupChoice, PlanSearch, Simulation]] = {}
    for g in chosen:
        try:
            searched[g] = _search_one(profile, cluster, batch_size, g, modelled[g],
                                      {**options, "stale_microbatches": stale_microbatches})
        except (ConfigError, ScheduleError) as error:
            notes[g] = f"refused: {error}"
    if not searched:
        raise ConfigError(f"no group count has a plan that fits: {notes[ranked[0]]}")
    best_g = min(searched, key=lambda g: searched[g][0].step_seconds)
    choices = tuple(searched[g][0] if g in searched else
                    GroupChoice(g, modelled.get(g, math.inf),
                                note=notes.get(g, "ranked out by the model"))
                    for g in counts)
    best, per_group, sim = searched[best_g]
    return GroupSearch(best, per_group, sim, choices)


def _search_one(profile: Profile, cluster: Cluster, batch_size: int, groups: int,
                modelled: float, options: dict[str, Any]
                ) -> tuple[GroupChoice, PlanSearch, Simulation]:
    """The full search for one group count, simulated over the whole cluster."""
    per_group = search(profile, group_view(cluster, groups), batch_size // groups, **options)
    plan = grouped(per_group.plan, groups)
    sim = simulate(plan, profile, cluster, check=False)
    plan = replace(plan, predicted_step_seconds=sim.step_seconds,
                   predicted_peak_memory_bytes=tuple(
                       sim.peak_memory[r] for r in sorted(sim.peak_memory)) * groups,
                   extra={**plan.extra, "bubble_fraction": sim.bubble_fraction})
    return GroupChoice(groups, modelled, sim.step_seconds, plan), per_group, sim
