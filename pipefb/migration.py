"""Moving layers between a running job's ranks: the repartitioned plan, and what moves.

A migration keeps every rank's role and the number of stages; only the stage boundaries
change. The layers whose weights (forward holders) or weights and optimizer state
(owners: backward and combined ranks) land on another rank are what a migration moves;
their bytes are what it reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from pipefb.checkpoint import OPTIMIZER_PREFIX
from pipefb.errors import ConfigError
from pipefb.plan import Plan, schedule_for


def repartitioned(plan: Plan, forward: Sequence[int], backward: Sequence[int]) -> Plan:
    """`plan` with new stage boundaries (empty: keep that partition). Combined schedules
    have one partition: a new forward partition is also the backward one.

    Raises:
        ConfigError: a partition that is malformed, covers other layers, changes the
            number of stages, or makes a schedule that fails validation.
    """
    fwd = tuple(forward) or plan.forward_partition
    bwd = tuple(backward) or (plan.backward_partition if plan.schedule == "pipefb" else fwd)
    if plan.schedule != "pipefb" and bwd != fwd:
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


def layer_sizes(saved: Mapping[int, Mapping[str, int]]) -> dict[int, tuple[int, int]]:
    """Layer -> (weight bytes, optimizer state bytes) from rank files' tensor sizes
    (`saved`: rank -> tensor name -> bytes, `pipefb.checkpoint.tensor_bytes`)."""
    sizes: dict[int, tuple[int, int]] = {}
    for tensors in saved.values():
        for name, nbytes in tensors.items():
            optim = name.startswith(OPTIMIZER_PREFIX)
            layer = int(name.removeprefix(OPTIMIZER_PREFIX if optim else "layers.")
                        .split(".", 1)[0])
            weights, state = sizes.get(layer, (0, 0))
            sizes[layer] = (weights, state + nbytes) if optim else (weights + nbytes, state)
    return sizes


def moved_bytes(old: Plan, new: Plan, sizes: Mapping[int, tuple[int, int]]) -> int:
    """Bytes a migration from `old` to `new` moves: the weights of each layer whose
    forward rank changes (when that rank is not its owner), and the weights and optimizer
    state of each layer whose owner changes, per group (`sizes`: layer -> (weight bytes,
    optimizer state bytes), e.g. `layer_sizes`)."""
    (old_fwd, old_own), (new_fwd, new_own) = holders(old), holders(new)
    total = 0
    for key, owner in new_own.items():
        weights, state = sizes.get(key[1], (0, 0))
        if old_own.get(key) != owner:
            total += weights + state
        if new_fwd.get(key, owner) != owner and old_fwd.get(key) != new_fwd[key]:
            total += weights
    return total
