"""The plan: schedule kind, partitions, per-layer policy, roles; and its lowered schedule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from typing import Any

from pipefb.errors import ConfigError
from pipefb.job.config import MAX_STALENESS, MAXIMA, MODES, POLICIES
from pipefb.schedule import KINDS, Schedule, Topology, generate, lower, validate

ROLES = ("forward", "backward", "combined")


def _check_partition(name: str, bounds: Sequence[int]) -> None:
    """Stage boundaries: 0 first, then strictly increasing.

    Raises:
        ConfigError: naming the partition.
    """
    if len(bounds) < 2 or bounds[0] != 0 or any(
            not isinstance(b, int) or isinstance(b, bool) for b in bounds) or any(
            b <= a for a, b in pairwise(bounds)):
        raise ConfigError(f"{name} {list(bounds)} must start at 0 and increase strictly")


@dataclass(frozen=True)
class WorkerAssignment:
    """One job rank's place in the plan."""

    rank: int  # job-local worker index
    role: str  # forward, backward or combined
    stage: int  # forward stage (forward, combined) or backward stage (backward)
    group: int = 0  # pipeline group; 0 while there is one group


def plan_stale_microbatches(staleness: int, stale_microbatches: int, microbatches: int) -> int:
    """A plan's `stale_microbatches`: the job's K (`JobConfig.stale_microbatches`) where the
    plan's forwards run stale (`staleness` > 0) and K leaves some of its `microbatches`
    fresh, else 0 (all stale, or none)."""
    return stale_microbatches if staleness and 0 < stale_microbatches < microbatches else 0


@dataclass(frozen=True)
class Plan:
    """The planner's output, plain data; every worker derives its actions from it."""

    schedule: str  # a pipeline kind (pipefb.schedule.KINDS)
    microbatches: int  # micro-batches per step
    microbatch_size: int  # samples per micro-batch
    forward_partition: tuple[int, ...]  # stage boundaries over layers, 0 .. n_layers
    backward_partition: tuple[int, ...]  # equal to forward_partition for combined kinds
    policy: tuple[str, ...]  # per layer: keep, offload or recompute
    assignment: tuple[WorkerAssignment, ...]  # one per rank, by rank
    groups: int = 1  # pipeline groups
    predicted_step_seconds: float = 0.0  # simulator's prediction; 0 when not predicted
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # planner notes
    mode: str = "sync"  # sync or async
    staleness: int = 0  # async pipefb: the forward of step k uses weight version k - staleness
    predicted_peak_memory_bytes: tuple[int, ...] = ()  # simulator's peak per rank; () if none
    stale_microbatches: int = 0  # async pipefb: the step's first micro-batches whose forward
    # uses version k - staleness, the rest wait for k - staleness + 1 ([Note: micro-batch
    # staleness] in pipefb.runtime.place); 0: all of them

    def __post_init__(self) -> None:
        """Checks the plan's structure (a plan may come off the wire): what every worker
        derives its actions from must be consistent before anything is built from it.

        Raises:
            ConfigError: naming the first inconsistency.
        """
        self._check_scalars()
        for name in ("forward_partition", "backward_partition"):
            _check_partition(name, getattr(self, name))
        if self.forward_partition[-1] != self.backward_partition[-1]:
            raise ConfigError(f"the forward partition covers {self.forward_partition[-1]} "
                              f"layers, the backward {self.backward_partition[-1]}")
        if any(p not in POLICIES for p in self.policy):
            raise ConfigError(f"policy {self.policy} has a value outside {POLICIES}")
        if len(self.policy) != self.forward_partition[-1]:
            raise ConfigError(
                f"policy has {len(self.policy)} entries for {self.forward_partition[-1]} layers"
            )
        if self.groups < 1 or {a.group for a in self.assignment} != set(range(self.groups)):
            raise ConfigError(f"groups {self.groups}: every group 0..{self.groups - 1} needs "
                              f"ranks, got groups {sorted({a.group for a in self.assignment})}")

        self._check_assignment()

    def _check_scalars(self) -> None:
        if self.schedule not in KINDS:
            raise ConfigError(f"plan schedule {self.schedule!r} is not one of {KINDS}")
        if self.mode not in MODES:
            raise ConfigError(f"plan mode {self.mode!r} is not one of {MODES}")
        for name, low, high in (("microbatches", 1, MAXIMA["microbatches"]),
                                ("microbatch_size", 1, MAXIMA["batch_size"]),
                                ("groups", 1, MAXIMA["workers"]),
                                ("staleness", 0, MAX_STALENESS),
                                ("stale_microbatches", 0, self.microbatches)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    low <= value <= high):
                raise ConfigError(f"plan {name} {value!r} is not in {low}..{high}")

    def _check_assignment(self) -> None:
        """One assignment per rank 0..n-1, in order, each with a known role, a stage of
        its role's partition and a group in 0..groups-1."""
        if [a.rank for a in self.assignment] != list(range(len(self.assignment))):
            raise ConfigError(f"plan ranks {[a.rank for a in self.assignment]} are not "
                              f"0..{len(self.assignment) - 1} in order")
        for a in self.assignment:
            bounds = self.backward_partition if a.role == "backward" else self.forward_partition
            if a.role not in ROLES:
                raise ConfigError(f"rank {a.rank} has role {a.role!r}, not one of {ROLES}")
            if not 0 <= a.stage < len(bounds) - 1:
                raise ConfigError(f"rank {a.rank} has {a.role} stage {a.stage}; the plan has "
                                  f"{len(bounds) - 1}")
            if not 0 <= a.group < self.groups:
                raise ConfigError(f"rank {a.rank} is in group {a.group}; the plan has "
                                  f"{self.groups}")

    def offloaded_stages(self) -> frozenset[int]:
        """Stages of a combined plan holding an `offload` layer (they STASH and FETCH)."""
        bounds = self.forward_partition
        return frozenset(s for s in range(len(bounds) - 1)
                         if "offload" in self.policy[bounds[s]:bounds[s + 1]])

    def topology(self, group: int = 0) -> Topology:
        """Stage boundaries and the rank of each forward and backward stage of one group
        (every group runs the same partitions on its own ranks)."""
        mine = [a for a in self.assignment if a.group == group]
        fwd = sorted((a.stage, a.rank) for a in mine if a.role != "backward")
        bwd = sorted((a.stage, a.rank) for a in mine if a.role != "forward")
        return Topology(
            forward_partition=self.forward_partition,
            backward_partition=self.backward_partition,
            forward_workers=tuple(rank for _, rank in fwd),
            backward_workers=tuple(rank for _, rank in bwd),
        )

    def group_of(self, rank: int) -> int:
        """The pipeline group of `rank`.

        Raises:
            ConfigError: the rank is not in the plan.
        """
        for a in self.assignment:
            if a.rank == rank:
                return a.group
        raise ConfigError(f"rank {rank} is not in the plan")

    def group_ranks(self) -> list[list[int]]:
        """The ranks of each group, by group."""
        return [sorted(a.rank for a in self.assignment if a.group == g)
                for g in range(self.groups)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; inverse of `from_dict`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Builds a plan from `to_dict` output."""
        data = dict(data)
        data.setdefault("predicted_peak_memory_bytes", ())
        data["assignment"] = tuple(WorkerAssignment(**a) for a in data["assignment"])
        for key in ("forward_partition", "backward_partition", "policy",
                    "predicted_peak_memory_bytes"):
            data[key] = tuple(data[key])
        return cls(**data)


def recompute_runs(plan: Plan) -> dict[int, int]:
    """First layer of the recomputed run of each `recompute` layer.

    A run is a maximal stretch of recompute layers inside one forward stage and one
    backward stage, so the worker that re-runs it holds all its layers.
    """
    starts = set(plan.forward_partition) | set(plan.backward_partition)
    out: dict[int, int] = {}
    for i, policy in enumerate(plan.policy):
        if policy == "recompute":
            fresh = i in starts or i == 0 or plan.policy[i - 1] != "recompute"
            out[i] = i if fresh else out[i - 1]
    return out


def replicate(assignment: Sequence[WorkerAssignment], groups: int) -> tuple[WorkerAssignment, ...]:
    """One group's assignment repeated for `groups` groups on consecutive blocks of ranks."""
    width = len(assignment)
    return tuple(replace(a, rank=g * width + a.rank, group=g)
                 for g in range(groups) for a in assignment)


def lowered_schedule(plan: Plan) -> Schedule:
    """The plan's generated and lowered schedule, every group's ranks, not validated (see
    `schedule_for`)."""
    out: Schedule = {}
    for group in range(plan.groups):
        topology = plan.topology(group)
        compute = generate(plan.schedule, topology, plan.microbatches)
        out.update(lower(compute, topology, plan.offloaded_stages()))
    return out


def schedule_for(plan: Plan) -> Schedule:
    """The lowered, validated schedule of a plan: what every rank executes each step.

    Raises:
        ScheduleError: the schedule fails validation or deadlocks in the dry run.
    """
    lowered = lowered_schedule(plan)
    for group, ranks in enumerate(plan.group_ranks()):
        validate({r: lowered[r] for r in ranks if r in lowered}, plan.topology(group),
                 plan.microbatches, plan.staleness)
    return lowered
