"""Moving layers between a running job's ranks: the repartitioned plan, and what moves.

A migration keeps every rank's role and the number of stages; only the stage boundaries
change. The layers whose weights (forward holders) or weights and optimizer state
(owners: backward and combined ranks) land on another rank are what a migration moves;
their bytes are what it reports. `takeover` says, for one rank, which layers it keeps and
which it takes from which rank of the paused attempt: summed over the ranks, what they
take is exactly what `moved_bytes` counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipefb.errors import ConfigError
from pipefb.plan.plan import Plan, schedule_for
from pipefb.schedule.kinds import schedule_kind


def repartitioned(plan: Plan, forward: Sequence[int], backward: Sequence[int]) -> Plan:
    """`plan` with new stage boundaries (empty: keep that partition). Combined schedules
    have one partition: a new forward partition is also the backward one.

    Raises:
        ConfigError: a partition that is malformed, covers other layers, changes the
            number of stages, or makes a schedule that fails validation.
    """
    separate = schedule_kind(plan.schedule).separate_partitions
    fwd = tuple(forward) or plan.forward_partition
    bwd = tuple(backward) or (plan.backward_partition if separate else fwd)
    if not separate and bwd != fwd:
        raise ConfigError(f"schedule {plan.schedule!r} has one partition; the backward "
                          f"{list(bwd)} must equal the forward {list(fwd)}")
    for name, new, old in (("forward", fwd, plan.forward_partition),
                           ("backward", bwd, plan.backward_partition)):
        if len(new) != len(old):
            raise ConfigError(f"the {name} partition {list(new)} has {len(new) - 1} stages; "
                              f"the job runs {len(old) - 1}")
    new_plan = replace(plan, forward_partition=fwd, backward_partition=bwd,
                       predicted_step_seconds=0.0, predicted_peak_memory_bytes=())
    schedule_for(new_plan)  # refuses a schedule that fails validation or deadlocks
    return new_plan


def holders(plan: Plan) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """(group, layer) -> the rank running its forward, and -> the rank owning its weights
    and optimizer state (the backward or combined rank)."""
    forward: dict[tuple[int, int], int] = {}
    owner: dict[tuple[int, int], int] = {}
    for group in range(plan.groups):
        topo = plan.topology(group)
        for stage, rank in enumerate(topo.forward_workers):
            for layer in range(topo.forward_partition[stage], topo.forward_partition[stage + 1]):
                forward[(group, layer)] = rank
        for stage, rank in enumerate(topo.backward_workers):
            for layer in range(topo.backward_partition[stage],
                               topo.backward_partition[stage + 1]):
                owner[(group, layer)] = rank
    return forward, owner


def moved_bytes(old: Plan, new: Plan, sizes: Mapping[int, tuple[int, int]]) -> int:
    """Bytes a migration from `old` to `new` moves: the weights of each layer whose
    forward rank changes (when that rank is not its owner), and the weights and optimizer
    state of each layer whose owner changes, per group (`sizes`: layer -> (weight bytes,
    optimizer state bytes))."""
    (old_fwd, old_own), (new_fwd, new_own) = holders(old), holders(new)
    total = 0
    for key, owner in new_own.items():
        weights, state = sizes.get(key[1], (0, 0))
        if old_own.get(key) != owner:
            total += weights + state
        if new_fwd.get(key, owner) != owner and old_fwd.get(key) != new_fwd[key]:
            total += weights
    return total


@dataclass(frozen=True)
class Takeover:
    """What one rank needs from the paused attempt to run the new plan."""

    owned: tuple[int, ...]  # layers it owned before and still owns: weights and state kept
    kept: tuple[int, ...]  # forward layers it held before: the version it would install
    #: old owner rank -> (layers whose weights it sends, layers whose optimizer state too)
    pulls: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: old forward rank, where it is not the old owner -> the forward layers whose buffers
    #: it sends ([Note: buffer owners] in pipefb.runtime.state: a PipeFB backward rank's
    #: copy of BatchNorm's statistics never changes)
    buffers: dict[int, tuple[int, ...]] = field(default_factory=dict)


def takeover(old: Plan, new: Plan, rank: int) -> Takeover:
    """Where `rank` takes each layer it holds under `new` from (see `Takeover`): an owned
    layer from its old owner (itself, or a peer's weights and optimizer state), a forward
    layer from itself if it held it before, else the old owner's weights and the old
    forward rank's buffers. Each group takes from its own ranks.

    Raises:
        ConfigError: `rank` is not in `new`, or the plans differ in ranks or roles.
    """
    roles = [(a.rank, a.role, a.group) for a in old.assignment]
    if roles != [(a.rank, a.role, a.group) for a in new.assignment]:
        raise ConfigError("a migration keeps every rank, role and group; the plans differ")
    mine = [a for a in new.assignment if a.rank == rank]
    if not mine:
        raise ConfigError(f"rank {rank} is not in the plan")
    group = mine[0].group
    (old_fwd, old_own), (new_fwd, new_own) = holders(old), holders(new)
    owned = {layer for (g, layer), r in new_own.items() if (g, r) == (group, rank)}
    forward = {layer for (g, layer), r in new_fwd.items() if (g, r) == (group, rank)}
    stays, kept = [], []
    pulls: dict[int, tuple[list[int], list[int]]] = {}
    for layer in sorted(owned | forward):
        source = old_own[(group, layer)]
        if layer in owned and source == rank:
            stays.append(layer)
        elif layer not in owned and old_fwd.get((group, layer)) == rank:
            kept.append(layer)
        else:
            weights, state = pulls.setdefault(source, ([], []))
            weights.append(layer)
            if layer in owned:
                state.append(layer)
    buffers: dict[int, list[int]] = {}
    for layer in sorted(forward):
        source = old_fwd.get((group, layer), rank)
        if source not in (rank, old_own[(group, layer)]):
            buffers.setdefault(source, []).append(layer)
    return Takeover(tuple(stays), tuple(kept),
                    {r: (tuple(w), tuple(o)) for r, (w, o) in sorted(pulls.items())},
                    {r: tuple(b) for r, b in sorted(buffers.items())})
