"""The search space and its answers: what a search tries (kinds, micro-batch counts, role
splits) and what it reports (each candidate, the best plan)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipefb.errors import ConfigError
from pipefb.plan.plan import Plan
from pipefb.schedule import KINDS, schedule_kind
from pipefb.sim.cluster import Cluster
from pipefb.sim.costs import Profile
from pipefb.sim.result import Simulation

MAX_MICROBATCH_CHOICES = 6  # micro-batch counts a search tries when the caller names none


@dataclass(frozen=True)
class SearchSpace:
    """What one search plans for."""

    profile: Profile  # at the job's micro-batch size
    cluster: Cluster
    batch_size: int
    staleness: int  # of the candidates of kinds that run stale forwards in async mode
    stale_microbatches: int = 0  # the job's K (`JobConfig.stale_microbatches`); 0: all


@dataclass(frozen=True)
class Candidate:
    """One plan the search considered, with its simulated outcome."""

    plan: Plan
    step_seconds: float  # simulated; inf when refused or not simulated
    estimate_seconds: float  # the analytic estimate that ranked it
    peak_memory: dict[int, int] = field(default_factory=dict)  # by rank, simulated
    bubble_fraction: float = 0.0
    note: str = ""  # why it lost or was refused ("" for the best)

    @property
    def label(self) -> str:
        """e.g. `pipefb sync 2F+2B x8` or `1f1b x4`: the mode where the kind runs in
        several, the role split where it splits the passes."""
        p = self.plan
        kind = schedule_kind(p.schedule)
        roles = (f" {len(p.forward_partition) - 1}F+{len(p.backward_partition) - 1}B"
                 if kind.split else "")
        mode = (f" {p.mode}" + (f" S={p.staleness}" if p.mode == "async" else "")
                if len(kind.modes) > 1 else "")
        return f"{p.schedule}{mode}{roles} x{p.microbatches}"

    def row(self) -> dict[str, Any]:
        """The candidate as one JSON-able table row."""
        return {"candidate": self.label, "step_seconds": self.step_seconds,
                "estimate_seconds": self.estimate_seconds,
                "peak_memory_bytes": max(self.peak_memory.values(), default=0),
                "bubble_fraction": self.bubble_fraction, "note": self.note,
                "forward_partition": list(self.plan.forward_partition),
                "backward_partition": list(self.plan.backward_partition),
                "policy": _policy_summary(self.plan.policy)}


@dataclass(frozen=True)
class PlanSearch:
    """The planner's answer: the best plan, its simulation, and every candidate."""

    best: Candidate
    simulation: Simulation
    candidates: tuple[Candidate, ...]  # best first, then by simulated, then estimated time
    simulated_actions: int = 0  # the work the search did: actions it simulated in all

    @property
    def plan(self) -> Plan:
        """The chosen plan, with its predicted step time."""
        return self.best.plan


def microbatch_choices(batch_size: int, workers: int, limit: int = MAX_MICROBATCH_CHOICES
                       ) -> list[int]:
    """Divisors of the batch size up to 4x the workers, at most `limit`, spread out."""
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    useful = [d for d in divisors if d <= max(4 * workers, 1)] or [1]
    if len(useful) <= limit:
        return useful
    step = (len(useful) - 1) / (limit - 1)
    return sorted({useful[round(i * step)] for i in range(limit)})


def kinds_in_mode(schedules: Sequence[str], mode: str) -> list[tuple[str, str]]:
    """(kind, mode) of each of `schedules` that runs in `mode`.

    Raises:
        ConfigError: a name that is no pipeline kind, or no kind runs in `mode`.
    """
    out = []
    for kind in schedules:
        if kind not in KINDS:
            raise ConfigError(f"unknown schedule {kind!r}; the planner knows {KINDS}")
        if mode in schedule_kind(kind).modes:
            out.append((kind, mode))
    if not out:
        raise ConfigError(f"no schedule among {list(schedules)} runs in mode {mode!r}")
    return out


def forward_splits(workers: int, profile: Profile) -> list[int]:
    """Forward worker counts to try for a kind that splits the passes (PipeFB): all for
    small clusters, else around the forward share of the work."""
    if workers < 2:
        return []
    if workers <= 8:
        return list(range(1, workers))
    fwd = sum(x.forward_seconds for x in profile.layers)
    total = fwd + sum(x.backward_seconds for x in profile.layers)
    centre = round(workers * fwd / total) if total > 0 else workers // 2
    return sorted({min(workers - 1, max(1, centre + d)) for d in range(-2, 3)})


def _policy_summary(policy: Sequence[str]) -> str:
    """`keep` for uniform policies, else counts, e.g. `offload 10, recompute 2`."""
    counts = {p: policy.count(p) for p in dict.fromkeys(policy)}
    return next(iter(counts)) if len(counts) == 1 else ", ".join(
        f"{p} {n}" for p, n in counts.items())
