"""The plan (schedule kind, partitions, policy, roles) and the placeholder balanced planner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from typing import Any

import torch

from pipefb.config import MAX_STALENESS, MAXIMA, MODES, POLICIES, SCHEDULES
from pipefb.errors import ConfigError
from pipefb.schedule import Schedule, Topology, generate, lower, validate

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


@dataclass(frozen=True)
class Plan:
    """The planner's output, plain data; every worker derives its actions from it."""

    schedule: str  # gpipe, 1f1b, pipedream or pipefb
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
        if self.schedule not in SCHEDULES[1:]:
            raise ConfigError(f"plan schedule {self.schedule!r} is not one of {SCHEDULES[1:]}")
        if self.mode not in MODES:
            raise ConfigError(f"plan mode {self.mode!r} is not one of {MODES}")
        for name, low, high in (("microbatches", 1, MAXIMA["microbatches"]),
                                ("microbatch_size", 1, MAXIMA["batch_size"]),
                                ("groups", 1, MAXIMA["workers"]),
                                ("staleness", 0, MAX_STALENESS)):
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


def layer_costs(layers: Sequence[torch.nn.Module]) -> list[float]:
    """The placeholder planner's cost of each layer: 1 + its parameter count."""
    return [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]


def stage_counts(schedule: str, workers: int) -> tuple[int, int]:
    """(forward stages, backward stages) a schedule kind makes of `workers` workers.

    PipeFB gives the backward pass, about twice the forward's work, the larger half.
    """
    if schedule == "pipefb":
        if workers < 2:
            raise ConfigError("schedule 'pipefb' needs at least 2 workers (forward and backward)")
        return workers // 2, workers - workers // 2
    return workers, workers


def partition(costs: Sequence[float], stages: int, speeds: Sequence[float] | None = None,
              cuts: Sequence[float] | None = None) -> tuple[int, ...]:
    """Splits `costs` into `stages` contiguous ranges minimising the largest range time.

    A range's time is its cost sum over its stage's speed (`speeds[k]`, default 1.0 each),
    so a twice-as-fast worker gets about twice the work, plus the seconds of the cuts at
    its two ends (`cuts[c]`: what a stage next to a boundary before layer c spends moving
    the tensors that cross it, per micro-batch; the ends of the model cost nothing).

    Dynamic programming over (stages, prefix): `best[k][e]` is the smallest bottleneck of
    the first `e` layers in `k` stages. With non-negative costs, `best[k-1][c]` does not
    decrease in the cut `c` and the last range's sum does not increase, so their maximum is
    valley-shaped in `c` and its minimum sits where they cross: a binary search per state.
    O(k * n * log n) time and O(k * n) space for n layers and k stages (200 layers on 64
    stages: about 100k state updates). Of the two cuts around the crossing, a tie goes to
    the earlier. With unequal speeds `best[k-1][c]` need not be monotone (a stage may not
    be empty, so one more layer can let a slow stage take a cheap layer), and each state
    scans every cut: O(k * n^2). Cut costs break the same monotonicity (a cheap cut may sit
    next to a dear one), so with any cut cost > 0 every state scans every cut too, as one
    n x n tensor operation per stage count (`_scan_rows`).

    Returns:
        Boundaries `(0, b1, ..., n)`.

    Raises:
        ConfigError: `stages` outside 1..n, a negative cost, a speed that is not > 0, or
            cut costs that are negative or not n + 1 of them.
    """
    if speeds is not None and len(speeds) != stages:
        raise ConfigError(f"need {stages} stage speeds > 0, got {speeds}")
    return partitions(costs, stages, speeds, cuts)[stages - 1]


def partitions(costs: Sequence[float], stages: int, speeds: Sequence[float] | None = None,
               cuts: Sequence[float] | None = None) -> list[tuple[int, ...]]:
    """`partition` for every stage count 1..`stages` from one dynamic program: the rows
    for k stages use the first k speeds, so with equal speeds each entry is optimal."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(f"cannot split {n} layers into {stages} stages")
    if any(c < 0 for c in costs):
        raise ConfigError(f"layer costs must be >= 0, got {min(costs)}")
    speed = [1.0] * stages if speeds is None else [float(x) for x in speeds]
    if len(speed) < stages or not all(x > 0 for x in speed):
        raise ConfigError(f"need {stages} stage speeds > 0, got {speeds}")
    edge = _cut_costs(cuts, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    where = (_scan_rows(prefix, speed[:stages], edge) if any(edge) else
             _search_rows(prefix, speed[:stages]))
    out = []
    for total in range(1, stages + 1):
        bounds = [n]
        for k in range(total, 1, -1):
            bounds.append(where[k - 1][bounds[-1]])
        out.append((0, *reversed(bounds)))
    return out


def _cut_costs(cuts: Sequence[float] | None, n: int) -> list[float]:
    """The n + 1 cut costs with both ends zero (no cut there); all zero when None."""
    if cuts is None:
        return [0.0] * (n + 1)
    if len(cuts) != n + 1 or any(not c >= 0 for c in cuts):
        raise ConfigError(f"need {n + 1} cut costs >= 0 for {n} layers, got {list(cuts)}")
    return [0.0, *(float(c) for c in cuts[1:n]), 0.0]


def _search_rows(prefix: list[float], speed: list[float]) -> list[list[int]]:
    """The dynamic program without cut costs: `where[k-1][e]` is the last cut of the best
    k-stage split of the first e layers (a binary search per state when speeds are equal)."""
    n, uniform = len(prefix) - 1, len(set(speed)) == 1
    best = [p / speed[0] for p in prefix]  # one stage: the whole prefix
    where: list[list[int]] = [[0] * (n + 1)]
    for k in range(2, len(speed) + 1):
        row, cut = [float("inf")] * (n + 1), [0] * (n + 1)
        for end in range(k, n + 1):
            row[end], cut[end] = (_best_cut(best, prefix, k - 1, end, speed[k - 1]) if uniform
                                  else _scan_cut(best, prefix, k - 1, end, speed[k - 1]))
        best = row
        where.append(cut)
    return where


def _scan_rows(prefix: list[float], speed: list[float], edge: list[float]
               ) -> list[list[int]]:
    """The dynamic program with cut costs, every cut of every state tried at once:
    time(c, e) = (prefix[e] - prefix[c]) / speed + edge[c] + edge[e]; a tie goes to the
    earlier cut (`min` returns the first)."""
    n = len(prefix) - 1
    p = torch.tensor(prefix, dtype=torch.float64)
    e = torch.tensor(edge, dtype=torch.float64)
    index = torch.arange(n + 1)
    before = index[:, None] < index[None, :]  # [c, end]: c < end
    best = p / speed[0] + e  # one stage: the whole prefix and the cut at its end
    where: list[list[int]] = [[0] * (n + 1)]
    spans: dict[float, torch.Tensor] = {}  # [c, end] time of a stage, per stage speed
    for k in range(2, len(speed) + 1):
        if speed[k - 1] not in spans:
            spans[speed[k - 1]] = ((p[None, :] - p[:, None]) / speed[k - 1]
                                   + e[:, None] + e[None, :])
        times = torch.maximum(best[:, None], spans[speed[k - 1]])
        allowed = before & (index[:, None] >= k - 1)  # k - 1 stages need k - 1 layers
        best, cut = times.masked_fill(~allowed, float("inf")).min(dim=0)
        where.append([int(c) for c in cut])
    return where


def _scan_cut(left: list[float], prefix: list[float], lo: int, end: int, speed: float
              ) -> tuple[float, int]:
    """`_best_cut` by trying every cut (for unequal stage speeds)."""
    return min((max(left[c], (prefix[end] - prefix[c]) / speed), c) for c in range(lo, end))


def _best_cut(left: list[float], prefix: list[float], lo: int, end: int, speed: float
              ) -> tuple[float, int]:
    """min over cuts c in [lo, end) of max(left[c], (prefix[end] - prefix[c]) / speed),
    and that c."""
    a, b = lo, end - 1
    while a < b:  # first cut where the left part is at least the last range
        mid = (a + b) // 2
        if left[mid] >= (prefix[end] - prefix[mid]) / speed:
            b = mid
        else:
            a = mid + 1
    options = [(max(left[c], (prefix[end] - prefix[c]) / speed), c) for c in (a - 1, a)
               if lo <= c < end]
    return min(options)


def balanced_plan(
    schedule: str,
    workers: int,
    layer_costs: Sequence[float],
    batch_size: int,
    microbatches: int,
    policy: Sequence[str] | None = None,
    mode: str = "sync",
    staleness: int = 0,
    groups: int = 1,
) -> Plan:
    """The placeholder planner: contiguous stages balanced by `layer_costs`.

    Combined kinds put stage r on rank r; PipeFB puts the forward stages on the first ranks
    and the backward stages on the rest. `policy` (per layer) defaults to keep on combined
    kinds and offload on PipeFB; `staleness` counts only for async PipeFB. With `groups`
    G > 1, group g is the same pipeline on ranks g*W .. (g+1)*W - 1 (W = workers / G),
    running `microbatches / G` of the step's micro-batches.
    """
    if workers % groups or microbatches % groups:
        raise ConfigError(f"groups {groups} must divide workers {workers} and "
                          f"microbatches {microbatches}")
    one = _one_group_plan(schedule, workers // groups, layer_costs, batch_size, microbatches,
                          policy, mode, staleness)
    return replace(one, groups=groups, microbatches=microbatches // groups,
                   assignment=replicate(one.assignment, groups))


def replicate(assignment: Sequence[WorkerAssignment], groups: int) -> tuple[WorkerAssignment, ...]:
    """One group's assignment repeated for `groups` groups on consecutive blocks of ranks."""
    width = len(assignment)
    return tuple(replace(a, rank=g * width + a.rank, group=g)
                 for g in range(groups) for a in assignment)


def _one_group_plan(schedule: str, workers: int, layer_costs: Sequence[float], batch_size: int,
                    microbatches: int, policy: Sequence[str] | None, mode: str, staleness: int
                    ) -> Plan:
    n_fwd, n_bwd = stage_counts(schedule, workers)
    fwd = partition(layer_costs, n_fwd)
    if schedule == "pipefb":
        bwd = partition(layer_costs, n_bwd)
        assignment = tuple(WorkerAssignment(r, "forward", r) for r in range(n_fwd)) + tuple(
            WorkerAssignment(n_fwd + s, "backward", s) for s in range(n_bwd)
        )
        default = "offload"
    else:
        bwd = fwd
        assignment = tuple(WorkerAssignment(r, "combined", r) for r in range(workers))
        default = "keep"
    lag = staleness if schedule == "pipefb" and mode == "async" else 0
    return Plan(
        schedule=schedule,
        microbatches=microbatches,
        microbatch_size=batch_size // microbatches,
        forward_partition=fwd,
        backward_partition=bwd,
        policy=tuple(policy) if policy is not None else (default,) * len(layer_costs),
        assignment=assignment,
        mode=mode,
        staleness=lag,
    )


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
