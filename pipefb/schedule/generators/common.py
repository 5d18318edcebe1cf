"""What the generators share: argument checks, per-stage action lists, combined stage counts."""

from __future__ import annotations

from collections.abc import Callable

from pipefb.errors import ScheduleError
from pipefb.schedule.ir import Action, Kind, Schedule, Topology


def check(topology: Topology, microbatches: int, *, split: bool, name: str) -> None:
    """Refuses a micro-batch count below 1, or a topology of the wrong shape for `name`.

    Raises:
        ScheduleError: naming the kind and what it needs.
    """
    if microbatches < 1:
        raise ScheduleError(f"{name} needs >= 1 micro-batch, got {microbatches}")
    if split and not topology.is_split:
        raise ScheduleError(f"{name} needs a split topology (no worker in both passes)")
    if not split and not topology.is_combined:
        raise ScheduleError(f"{name} needs a combined topology (same workers and partitions)")


def forwards(stage: int, mbs: range) -> list[Action]:
    """The forwards of `stage` for micro-batches `mbs`, in order."""
    return [Action(stage, Kind.F, m) for m in mbs]


def backwards(stage: int, mbs: range) -> list[Action]:
    """The backwards of `stage` for micro-batches `mbs`, in order."""
    return [Action(stage, Kind.B, m) for m in mbs]


def per_stage(topology: Topology, microbatches: int,
              stage_list: Callable[[int, int, int], list[Action]]) -> Schedule:
    """A combined schedule from `stage_list(stage, n_stages, microbatches)` per stage."""
    n = topology.n_forward_stages
    return {w: stage_list(s, n, microbatches) for s, w in enumerate(topology.forward_workers)}


def combined_stages(workers: int) -> tuple[int, int]:
    """(forward stages, backward stages) of a combined kind: one stage per worker, each
    running both passes of its layers."""
    return workers, workers
