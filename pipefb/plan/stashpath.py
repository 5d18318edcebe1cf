"""Where a rank's stash copies run: on its compute thread, or beside it through the
store's I/O thread and prefetch (the rule the workers follow and the simulator mirrors)."""

from __future__ import annotations

from pipefb.plan.plan import Plan
from pipefb.schedule import Topology


def takes_back_own_stash(plan: Plan, rank: int) -> bool:
    """Whether rank `rank` takes back every stash it puts itself: a combined rank whose
    forward and backward stages hold the same layers (GPipe, 1F1B, PipeDream)."""
    return takes_back_own_stash_in(plan.topology(plan.group_of(rank)), rank)


def takes_back_own_stash_in(topology: Topology, rank: int) -> bool:
    """`takes_back_own_stash` of a rank of `topology` (its group's)."""
    if rank not in topology.forward_workers or rank not in topology.backward_workers:
        return False
    fwd = topology.forward_workers.index(rank)
    bwd = topology.backward_workers.index(rank)
    return list(topology.layers_of_forward(fwd)) == list(topology.layers_of_backward(bwd))


def copies_on_compute_thread(private: bool, local_tier: bool, device: str) -> bool:
    """Whether a rank puts and takes its stashes on its compute thread, with no I/O thread
    and no prefetch ([Note: copies on the compute thread] in offload_store/writer.py): on
    the CPU (`device`), a rank that takes back its own stashes (`private`: its store's
    index stays in the process, [Note: private index] in offload_store/shm.py) in front of
    a node-local tier (`local_tier`), where a put is one memcpy into a mapped segment and
    a take a view of it. Every other rank's copies leave the compute thread (the
    simulator's copy lane: [Note: copy lane] in pipefb.sim.copylane)."""
    return private and local_tier and device == "cpu"


__all__ = ["copies_on_compute_thread", "takes_back_own_stash", "takes_back_own_stash_in"]
