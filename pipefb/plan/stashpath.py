"""Where a rank's stash copies run: on its compute thread, or beside it through the
store's I/O thread and prefetch; and which ranks take a rank's stashes or stashed what it
takes (the rules the workers follow and the simulator mirrors)."""

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


def stash_consumers(plan: Plan, rank: int) -> dict[int, int]:
    """Layer -> the rank that takes rank `rank`'s stash of it: for each layer of the rank's
    forward stage, the rank of the backward stage in its group that holds the layer (the
    rank itself on a combined one); empty for a backward rank, which stashes nothing."""
    return _across(plan, rank, from_forward=True)


def stash_producers(plan: Plan, rank: int) -> dict[int, int]:
    """Layer -> the rank whose stash of it rank `rank` takes: for each layer of the rank's
    backward stage, the rank of the forward stage in its group that runs the layer (the
    rank itself on a combined one); empty for a forward rank, which takes nothing. The
    mirror of `stash_consumers`."""
    return _across(plan, rank, from_forward=False)


def _across(plan: Plan, rank: int, from_forward: bool) -> dict[int, int]:
    """For each layer of rank `rank`'s forward stage (`from_forward`) or backward stage,
    the rank of its group's stage on the other side that holds the layer; empty where the
    rank has no stage on its own side."""
    topology = plan.topology(plan.group_of(rank))
    forward = (topology.forward_workers, topology.layers_of_forward)
    backward = (topology.backward_workers, topology.layers_of_backward)
    (own, own_layers), (other, other_layers) = (
        (forward, backward) if from_forward else (backward, forward))
    if rank not in own:
        return {}
    stage = own.index(rank)
    holder = {layer: worker for s, worker in enumerate(other) for layer in other_layers(s)}
    return {layer: holder[layer] for layer in own_layers(stage)}


def fences_sends(topology: Topology, rank: int) -> bool:
    """Whether rank `rank`'s transfers leave only after the stashes it handed over before
    them are written: a forward-only rank (PipeFB's), so that the backward rank its loss
    or activations reach finds those stashes in the store (`GrpcTransport.fence_sends`;
    the simulator's [Note: fenced sends] in pipefb.sim.engine)."""
    return rank in topology.forward_workers and rank not in topology.backward_workers


def stash_partners(plan: Plan, rank: int) -> frozenset[int]:
    """The other ranks rank `rank` exchanges stashes with: those that take its stashes
    (`stash_consumers`) and those whose stashes it takes (`stash_producers`); empty for a
    rank that takes back only its own."""
    partners = {*stash_consumers(plan, rank).values(), *stash_producers(plan, rank).values()}
    return frozenset(partners - {rank})


__all__ = ["copies_on_compute_thread", "fences_sends", "stash_consumers", "stash_partners",
           "stash_producers", "takes_back_own_stash", "takes_back_own_stash_in"]
