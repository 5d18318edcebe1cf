"""Online re-planning: when to move layers, decided from live step measurements.

[Note: online re-planning] Every step each rank reports its compute seconds and the
seconds it spent on each of its layers. Each (role, layer) item's seconds per unit of its
prior cost (the profile's, or the placeholder's) are exponentially smoothed (`alpha`);
the first `cooldown` steps calibrate, assuming every worker ran at the same speed then:
their ratios become the items' base. From then on each item's ratio over its base says
how much slower it got. What slows a whole device slows every layer on it; what slows one
layer (a grown input) slows that layer alone and moves with it: a rank's slowness comes
from the items it has been running at its pace (`Replanner._slowness`), and an item more
than `CHANGE` off it carries a factor of its own, kept after it moves. An item's cost is
its measured time over its rank's slowness; a fresh partition for those costs on ranks of
those speeds (the planner's dynamic program, `pipefb.plan.partition.partition`) predicts a new
bottleneck, the slowest rank's seconds per step (its layers plus what it spends beyond
them). Moving pays when the seconds per step it saves, less the move's cost (a fixed
part, re-assigning every rank, as the last moves measured it, plus the bytes
`pipefb.plan.migration.moved_bytes` counts over `bandwidth`) spread over `horizon` steps (or
the steps left, when fewer), exceed `threshold` of the current bottleneck for `patience`
consecutive steps. Hysteresis against churn: the smoothing, the threshold, the patience,
`cooldown` steps without a decision after a move, and costs that travel with the layers,
so a move does not make the layers it moved look cheap again. A slowdown that predates
the calibration counts as the cost of the layers it slowed.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipefb.errors import ConfigError
from pipefb.plan.migration import holders, moved_bytes, repartitioned
from pipefb.plan.partition import partition
from pipefb.plan.plan import Plan
from pipefb.schedule.kinds import schedule_kind


@dataclass(frozen=True)
class ReplanSettings:
    """How eagerly layers move (see the module's note)."""

    alpha: float = 0.3  # weight of the newest step in the smoothed speeds
    threshold: float = 0.10  # net saving, as a fraction of the current bottleneck
    patience: int = 3  # consecutive steps the saving must hold
    horizon: int = 100  # steps a move's cost is spread over
    cooldown: int = 10  # steps after a move before the next may be decided
    bandwidth: float = 1e9  # bytes per second a move runs at
    fixed_seconds: float = 1.0  # a move's cost beyond its bytes (re-assigning every
    # rank) until a move measures it (`moved`)


@dataclass(frozen=True)
class Decision:
    """A move worth making: the plan to move to and the numbers that justify it."""

    plan: Plan
    current_seconds: float  # the measured bottleneck (smoothed), seconds per step
    new_seconds: float  # the new partition's predicted bottleneck
    move_seconds: float  # the move's estimated cost


Item = tuple[str, int]  # (F: a forward rank's, B: a backward rank's, C: combined, layer)
CHANGE = 1.5  # an item this far off its rank's slowness changed cost itself


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
        self.ratio: dict[Item, float] = {}  # smoothed seconds per unit of prior cost
        self.base: dict[Item, float] = {}  # the ratios at calibration
        self.overhead: dict[int, float] = {}  # smoothed compute beyond the rank's layers
        self.factor: dict[Item, float] = {}  # how much costlier a layer got (absent: 1)
        self.slow: dict[int, float] = {}  # each rank's slowness, last estimated
        self.residents: dict[int, set[Item]] = {}  # items known to run at the rank's pace
        self.plan = plan
        self.reset(plan)

    def moved(self, seconds: float) -> None:
        """A move took `seconds` in all: later decisions count that as its fixed cost."""
        self.fixed_seconds = seconds

    def reset(self, plan: Plan) -> None:
        """Goes on with `plan` (after a move): the cooldown, then decisions again; each
        rank's residents are the items it keeps."""
        before = self.items(self.plan)
        self.residents = {rank: set(its) & set(before.get(rank, ()))
                          for rank, its in self.items(plan).items()}
        self.plan = plan
        self.streak = 0
        self.quiet = self.settings.cooldown

    def items(self, plan: Plan) -> dict[int, list[Item]]:
        """Each rank's items under `plan` (group 0)."""
        forward, owner = holders(plan)
        out: dict[int, list[Item]] = {}
        split = schedule_kind(plan.schedule).split
        for kind, holder in (("F", forward), ("B", owner)) if split else (("C", owner),):
            for (group, layer), rank in holder.items():
                if group == 0:
                    out.setdefault(rank, []).append((kind, layer))
        return out

    def prior(self, item: Item) -> float:
        """The item's cost from the costs given (never 0)."""
        kind, layer = item
        forward, backward = self.forward[layer], self.backward[layer]
        cost = forward if kind == "F" else backward if kind == "B" else forward + backward
        return max(cost, 1e-12)

    def predicted(self, plan: Plan) -> dict[int, float]:
        """Each rank's prior cost under `plan` on a speed-1 worker (group 0)."""
        return {rank: sum(self.prior(i) for i in its) for rank, its in self.items(plan).items()}

    def observe(self, compute: Mapping[int, float], steps_left: int | None = None,
                layers: Mapping[int, Mapping[int, float]] | None = None) -> Decision | None:
        """Takes one step's compute seconds by rank (and seconds by rank and layer, when
        measured; else a rank's compute is spread over its layers by prior cost); a
        Decision when a move pays over the horizon (or the `steps_left`, when fewer)."""
        for rank, its in self.items(self.plan).items():
            self._measure(rank, its, compute.get(rank, 0.0), (layers or {}).get(rank) or {})
        if self.quiet > 0:
            self.quiet -= 1
            if self.quiet == 0 and not self.base:
                self.base = dict(self.ratio)  # calibration: equal speeds until now
            return None
        horizon = min(self.settings.horizon, steps_left or self.settings.horizon)
        decision = self._best(max(1, horizon))
        self.streak = self.streak + 1 if decision is not None else 0
        if decision is None or self.streak < self.settings.patience:
            return None
        return decision

    def _measure(self, rank: int, its: list[Item], total: float,
                 measured: Mapping[int, float]) -> None:
        if total <= 0:
            return
        weight = sum(self.prior(i) for i in its)
        seconds = {i: measured.get(i[1], 0.0) if measured else total * self.prior(i) / weight
                   for i in its}
        for item, t in seconds.items():
            if t > 0:
                self.ratio[item] = self._smooth(self.ratio.get(item), t / self.prior(item))
        self.overhead[rank] = self._smooth(self.overhead.get(rank),
                                           max(0.0, total - sum(seconds.values())))

    def _smooth(self, old: float | None, new: float) -> float:
        alpha = self.settings.alpha
        return new if old is None else alpha * new + (1 - alpha) * old

    def _slowness(self) -> dict[int, float]:
        """Each rank's slowness since calibration (1: as fast as then), and the layer
        factors it implies. A rank's slowness is the median ratio-over-base of its
        resident items without a factor (those it held before the last move, or has been
        seen to run at its pace since); with none, its slowness before, unless its items
        all run faster than that. An item off its rank's slowness by more than `CHANGE`
        either way gets the factor that explains it (at least 1). Factors persist and
        travel with the items: a costly layer alone on a rank reads as a costly layer."""
        out = {}
        for rank, its in self.items(self.plan).items():
            rho = {i: self.ratio[i] / self.base[i] for i in its}
            resident = self.residents.setdefault(rank, set(its))
            plain = [rho[i] for i in its if i in resident and i not in self.factor]
            fit = min(rho[i] / self.factor.get(i, 1.0) for i in its)
            before = self.slow.get(rank)
            slow = (statistics.median(plain) if plain
                    else fit if before is None or fit < before / CHANGE else before)
            for i in its:
                off = rho[i] / (self.factor.get(i, 1.0) * slow)
                if off > CHANGE or off < 1 / CHANGE:
                    factor = rho[i] / slow
                    if factor > CHANGE:
                        self.factor[i] = factor
                    else:
                        self.factor.pop(i, None)
                if i not in self.factor:
                    resident.add(i)
            out[rank] = self.slow[rank] = slow
        return out

    def _costs(self, slow: Mapping[int, float]) -> dict[Item, float]:
        """Each item's seconds per step on a rank as fast as at calibration."""
        return {item: self.prior(item) * self.ratio[item] / slow[rank]
                for rank, its in self.items(self.plan).items() for item in its}

    def _seconds(self, plan: Plan, costs: Mapping[Item, float], slow: Mapping[int, float]
                 ) -> float:
        """The bottleneck of `plan`: its slowest rank's seconds per step."""
        return max(sum(costs[i] for i in its) * slow[rank] + self.overhead.get(rank, 0.0)
                   for rank, its in self.items(plan).items())

    def _best(self, horizon: int) -> Decision | None:
        if not self.base or any(i not in self.ratio for its in self.items(self.plan).values()
                                for i in its):
            return None
        slow = self._slowness()
        costs = self._costs(slow)
        new = self._rebalanced(costs, slow)
        if new is None:
            return None
        current, after = self._seconds(self.plan, costs, slow), self._seconds(new, costs, slow)
        move = (self.fixed_seconds
                + moved_bytes(self.plan, new, self.sizes) / self.settings.bandwidth)
        saving = current - after - move / horizon
        if saving <= self.settings.threshold * current:
            return None
        return Decision(new, current, after, move)

    def _rebalanced(self, costs: Mapping[Item, float], slow: Mapping[int, float]
                    ) -> Plan | None:
        """The partition balanced for the measured costs and speeds, or None if it is the
        same."""
        topo = self.plan.topology(0)
        n = len(self.forward)
        if schedule_kind(self.plan.schedule).separate_partitions:
            fwd = self._split([costs[("F", i)] for i in range(n)], topo.forward_workers, slow)
            bwd = self._split([costs[("B", i)] for i in range(n)], topo.backward_workers, slow)
        else:
            fwd = bwd = self._split([costs[("C", i)] for i in range(n)], topo.forward_workers,
                                    slow)
        if fwd == self.plan.forward_partition and bwd == self.plan.backward_partition:
            return None
        try:
            return repartitioned(self.plan, fwd, bwd)
        except ConfigError:  # e.g. a schedule the new partition cannot run
            return None

    @staticmethod
    def _split(costs: list[float], ranks: Sequence[int], slow: Mapping[int, float]
               ) -> tuple[int, ...]:
        return tuple(partition(costs, len(ranks), [1.0 / slow[r] for r in ranks]))
