"""What the simulator returns: the step time, peaks by rank, and every action's span."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import Any

from pipefb.schedule import Action, Schedule


@dataclass(slots=True)
class Span:
    """One simulated action."""

    rank: int
    iteration: int
    step: int
    action: Action
    start: float
    end: float

    @property
    def label(self) -> str:
        """The action as the runtime labels it: lead 1 when it belongs to the next step."""
        a = self.action
        return str(Action(a.stage, a.kind, a.microbatch, self.step - self.iteration))


#: One simulated action, compactly: (rank, iteration, step, position in the rank's list,
#: start, end). Atoms only, so Python's cyclic collector stops tracking them: a planner
#: holding many simulations does not rescan their spans ([Note: collector] in
#: pipefb.planner.search).
Record = tuple[int, int, int, int, float, float]


@dataclass
class Simulation:
    """What the simulator predicts for a plan.

    Attributes:
        step_seconds: steady-state time per training step.
        iterations: simulated iterations of the step loop.
        compute_seconds: per rank, compute (F, B, OPT) time per step.
        peak_memory: per rank, the peak of accounted bytes.
        peak_memory_by_kind: per rank, the bytes by kind at that peak.
        peak_node_tier: per rank, the peak of its bytes in the node-local tier (the kind
            `node_tier`, beside `peak_memory` and not in it).
        roles: per rank, (role, stage) as in the plan's assignment.
        records: every simulated action as a `Record`; `spans` reads them.
        schedule: the lowered lists the records' positions index.
    """

    step_seconds: float
    iterations: int
    compute_seconds: dict[int, float]
    peak_memory: dict[int, int]
    peak_memory_by_kind: dict[int, dict[str, int]]
    roles: dict[int, tuple[str, int]] = field(default_factory=dict)
    peak_node_tier: dict[int, int] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list, repr=False, compare=False)
    schedule: Schedule = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def spans(self) -> list[Span]:
        """Every simulated action, in order of start (then rank)."""
        return [Span(r, k, step, self.schedule[r][i].base, start, end)
                for r, k, step, i, start, end in sorted(self.records, key=itemgetter(4, 0))]

    @property
    def bubble_fraction(self) -> float:
        """Share of worker time not spent computing, over all workers, in steady state."""
        if not self.compute_seconds or self.step_seconds <= 0:
            return 0.0
        busy = sum(self.compute_seconds.values()) / len(self.compute_seconds)
        return max(0.0, 1.0 - busy / self.step_seconds)

    @property
    def max_peak_memory(self) -> int:
        """The largest per-worker peak."""
        return max(self.peak_memory.values(), default=0)

    def timeline(self, k: int | None = None) -> dict[str, Any]:
        """Iteration `k` (default: the last full one) in the report's timeline format."""
        k = max(0, self.iterations - 2) if k is None else k
        spans = [s for s in self.spans if s.iteration == k]
        t0 = min((s.start for s in spans), default=0.0)
        return {"step": k, "ranks": [
            {"rank": r, "role": role, "stage": stage,
             "spans": [[s.label, s.start - t0, s.end - t0] for s in spans if s.rank == r]}
            for r, (role, stage) in sorted(self.roles.items())]}


__all__ = ["Record", "Simulation", "Span"]
