"""Online re-planning: when to move layers, decided from live step measurements.

[Note: online re-planning] After each step every rank's compute seconds are set against
what the plan's layer costs predict for its layers on a speed-1 worker; that ratio,
exponentially smoothed (`alpha`), is the rank's measured speed. A fresh partition for
those speeds (the planner's dynamic program, `pipefb.plan.partition`) predicts a new
bottleneck, the slowest rank's compute per step. Moving pays when the seconds per step it
saves, less the move's cost (a fixed part, re-assigning every rank, as the last moves
measured it, plus the bytes `pipefb.migration.moved_bytes` counts over `bandwidth`)
spread over `horizon` steps (or the steps left, when fewer), exceed `threshold` of the
current bottleneck for `patience` consecutive steps. Hysteresis against churn: the
smoothing, the threshold, the patience, and after a move a fresh start of the speeds and
`cooldown` steps without any new decision. Speeds are per rank: a layer that costs more
than its estimate makes its rank look slow, and later decisions, measured on the new
partition, correct that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipefb.errors import ConfigError
from pipefb.migration import holders, moved_bytes, repartitioned
from pipefb.plan import Plan, partition


@dataclass(frozen=True)
class ReplanSettings:
    """How eagerly layers move (see the module's note)."""

    alpha: float = 0.3  # weight of the newest step in the smoothed speeds
    threshold: float = 0.10  # net saving, as a fraction of the current bottleneck
    patience: int = 3  # consecutive steps the saving must hold
    horizon: int = 100  # steps a move's cost is spread over
    cooldown: int = 10  # steps after a move before the next may be decided
    bandwidth: float = 1e9  # bytes per second a move runs at
    fixed_seconds: float = 2.0  # a move's cost beyond its bytes (re-assigning every rank);
    # replaced by what moves measure (`moved`)


@dataclass(frozen=True)
class Decision:
    """A move worth making: the plan to move to and the numbers that justify it."""

    plan: Plan
    current_seconds: float  # the measured bottleneck (smoothed), seconds per step
    new_seconds: float  # the new partition's predicted bottleneck
    move_seconds: float  # the move's estimated cost


class Replanner:
    """Watches a job's steps and proposes a new partition when one pays (one group's
    ranks; every group runs the same partition).

    Args:
        plan: the running plan.
        forward_costs: each layer's forward cost on a speed-1 worker (any unit).
        backward_costs: each layer's backward cost, same unit.
        sizes: layer -> (weight bytes, optimizer state bytes), for the move's cost.
        settings: how eagerly to move.
    """

    def __init__(self, plan: Plan, forward_costs: Sequence[float],
                 backward_costs: Sequence[float], sizes: Mapping[int, tuple[int, int]],
                 settings: ReplanSettings | None = None) -> None:
        if len(forward_costs) != plan.forward_partition[-1] or len(backward_costs) != len(
                forward_costs):
            raise ConfigError(f"{len(forward_costs)} forward and {len(backward_costs)} "
                              f"backward costs for {plan.forward_partition[-1]} layers")
        self.forward, self.backward = list(forward_costs), list(backward_costs)
        self.sizes, self.settings = dict(sizes), settings or ReplanSettings()
        self.fixed_seconds = self.settings.fixed_seconds
        self.reset(plan)

    def moved(self, seconds: float) -> None:
        """A move took `seconds` in all: later decisions count that as its fixed cost."""
        self.fixed_seconds = seconds

    def reset(self, plan: Plan) -> None:
        """Starts over on `plan` (after a move): fresh speeds, then the cooldown."""
        self.plan = plan
        self.speeds: dict[int, float] = {}
        self.streak = 0
        self.quiet = self.settings.cooldown

    def predicted(self, plan: Plan) -> dict[int, float]:
        """Each rank's compute cost under `plan` on a speed-1 worker (group 0)."""
        forward, owner = holders(plan)
        cost: dict[int, float] = {}
        for (group, layer), rank in forward.items():
            if group == 0:
                cost[rank] = cost.get(rank, 0.0) + self.forward[layer]
        for (group, layer), rank in owner.items():
            if group == 0:
                cost[rank] = cost.get(rank, 0.0) + self.backward[layer]
        return cost

    def observe(self, compute: Mapping[int, float], steps_left: int | None = None
                ) -> Decision | None:
        """Takes one step's compute seconds by rank; a Decision when a move pays over the
        horizon (or the `steps_left`, when fewer)."""
        predicted = self.predicted(self.plan)
        alpha = self.settings.alpha
        for rank, cost in predicted.items():
            seconds = compute.get(rank, 0.0)
            if seconds <= 0 or cost <= 0:
                continue
            speed = cost / seconds
            old = self.speeds.get(rank)
            self.speeds[rank] = speed if old is None else alpha * speed + (1 - alpha) * old
        if self.quiet > 0:
            self.quiet -= 1
            return None
        horizon = min(self.settings.horizon, steps_left or self.settings.horizon)
        decision = self._best(max(1, horizon))
        self.streak = self.streak + 1 if decision is not None else 0
        if decision is None or self.streak < self.settings.patience:
            return None
        return decision

    def _seconds(self, plan: Plan) -> float:
        """The bottleneck of `plan` at the measured speeds."""
        return max(cost / self.speeds.get(rank, 1.0)
                   for rank, cost in self.predicted(plan).items())

    def _best(self, horizon: int) -> Decision | None:
        if len(self.speeds) < len(self.predicted(self.plan)):
            return None
        new = self._rebalanced()
        if new is None:
            return None
        current, after = self._seconds(self.plan), self._seconds(new)
        move = (self.fixed_seconds
                + moved_bytes(self.plan, new, self.sizes) / self.settings.bandwidth)
        saving = current - after - move / horizon
        if saving <= self.settings.threshold * current:
            return None
        return Decision(new, current, after, move)

    def _rebalanced(self) -> Plan | None:
        """The partition balanced for the measured speeds, or None if it is the same."""
        topo = self.plan.topology(0)
        if self.plan.schedule == "pipefb":
            fwd = self._split(self.forward, topo.forward_workers)
            bwd = self._split(self.backward, topo.backward_workers)
        else:
            both = [f + b for f, b in zip(self.forward, self.backward, strict=True)]
            fwd = bwd = self._split(both, topo.forward_workers)
        if fwd == self.plan.forward_partition and bwd == self.plan.backward_partition:
            return None
        try:
            return repartitioned(self.plan, fwd, bwd)
        except ConfigError:  # e.g. a schedule the new partition cannot run
            return None

    def _split(self, costs: list[float], ranks: Sequence[int]) -> tuple[int, ...]:
        return tuple(partition(costs, len(ranks), [self.speeds[r] for r in ranks]))
