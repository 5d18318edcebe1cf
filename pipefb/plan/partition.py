"""Partitions: contiguous stages balanced by cost and speed, and the placeholder balanced plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pipefb.errors import ConfigError
from pipefb.plan.plan import Plan, WorkerAssignment, plan_stale_microbatches, replicate
from pipefb.schedule.kinds import schedule_kind


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
    stale_microbatches: int = 0,
) -> Plan:
    """The placeholder planner: contiguous stages balanced by `layer_costs`.

    Combined kinds put stage r on rank r; split kinds (PipeFB) put the forward stages on
    the first ranks and the backward stages on the rest. `policy` (per layer) defaults to
    the kind's default policy; `staleness` counts only where the kind runs stale forwards
    in async mode (`ScheduleKind.plan_staleness`), `stale_microbatches` (the job's K)
    where they do and K is fewer than a group's micro-batches. With `groups`
    G > 1, group g is the same pipeline on ranks g*W .. (g+1)*W - 1 (W = workers / G),
    running `microbatches / G` of the step's micro-batches.
    """
    if workers % groups or microbatches % groups:
        raise ConfigError(f"groups {groups} must divide workers {workers} and "
                          f"microbatches {microbatches}")
    one = _one_group_plan(schedule, workers // groups, layer_costs, batch_size, microbatches,
                          policy, mode, staleness)
    return replace(one, groups=groups, microbatches=microbatches // groups,
                   assignment=replicate(one.assignment, groups),
                   stale_microbatches=plan_stale_microbatches(
                       one.staleness, stale_microbatches, microbatches // groups))


def _one_group_plan(schedule: str, workers: int, layer_costs: Sequence[float], batch_size: int,
                    microbatches: int, policy: Sequence[str] | None, mode: str, staleness: int
                    ) -> Plan:
    kind = schedule_kind(schedule)
    n_fwd, n_bwd = kind.stage_counts(workers)
    fwd = partition(layer_costs, n_fwd)
    if kind.split:
        bwd = partition(layer_costs, n_bwd)
        assignment = tuple(WorkerAssignment(r, "forward", r) for r in range(n_fwd)) + tuple(
            WorkerAssignment(n_fwd + s, "backward", s) for s in range(n_bwd)
        )
    else:
        bwd = fwd
        assignment = tuple(WorkerAssignment(r, "combined", r) for r in range(workers))
    return Plan(
        schedule=schedule,
        microbatches=microbatches,
        microbatch_size=batch_size // microbatches,
        forward_partition=fwd,
        backward_partition=bwd,
        policy=(tuple(policy) if policy is not None
                else (kind.default_policy,) * len(layer_costs)),
        assignment=assignment,
        mode=mode,
        staleness=kind.plan_staleness(mode, staleness),
    )
