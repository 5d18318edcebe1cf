"""What each action waits for: the one dependency table that validation and the dry run share."""

from __future__ import annotations

from pipefb.schedule.ir import Action, Kind, Topology

#: (step offset, action): the action of step `k + offset` that must have run first.
Requirement = tuple[int, Action]


def _peer_requirements(a: Action, topology: Topology, staleness: int) -> list[Requirement]:
    """Requirements on other workers: the matching send, stash or weight push."""
    s, m = a.stage, a.microbatch
    if a.kind is Kind.RECV_F:
        return [(0, Action(s - 1, Kind.SEND_F, m))]
    if a.kind is Kind.RECV_B:
        return [(0, Action(s + 1, Kind.SEND_B, m))]
    if a.kind is Kind.RECV_L:
        return [(0, Action(topology.n_forward_stages - 1, Kind.SEND_L, m))]
    if a.kind is Kind.FETCH:
        return [(0, Action(f, Kind.STASH, m)) for f in topology.forward_stages_overlapping(s)]
    if a.kind is Kind.RECV_W:
        # step k's forward uses weight version k - staleness, pushed after step k-1-staleness
        return [(-1 - staleness, Action(b, Kind.PUSH_W))
                for b in topology.backward_stages_overlapping(s)]
    return []


def _local_requirements(a: Action, topology: Topology) -> list[Requirement]:
    """Requirements on the same worker: the inputs of a compute, the compute of a send."""
    s, m, split = a.stage, a.microbatch, topology.is_split
    if a.kind is Kind.F:
        need = [Action(s, Kind.RECV_F, m)] if s > 0 else []
        return [(0, x) for x in need + ([Action(s, Kind.RECV_W)] if split else [])]
    if a.kind in (Kind.SEND_F, Kind.STASH):
        return [(0, Action(s, Kind.F, m))]
    if a.kind is Kind.SEND_L:
        return [(0, Action(s, Kind.F, m)), (0, Action(s, Kind.STASH, m))]
    if a.kind is Kind.B:
        return [(0, x) for x in _backward_inputs(s, m, topology)]
    if a.kind is Kind.SEND_B:
        return [(0, Action(s, Kind.B, m))]
    if a.kind is Kind.PUSH_W:
        return [(0, Action(s, Kind.OPT))]
    return []


def _backward_inputs(s: int, m: int | None, topology: Topology) -> list[Action]:
    if topology.is_combined:
        need = [Action(s, Kind.F, m)]
        return need + ([Action(s, Kind.RECV_B, m)] if s < topology.n_backward_stages - 1 else [])
    if s < topology.n_backward_stages - 1:
        return [Action(s, Kind.RECV_B, m), Action(s, Kind.FETCH, m)]
    return [Action(s, Kind.RECV_L, m), Action(s, Kind.FETCH, m)]


def requirements(action: Action, topology: Topology, staleness: int = 0,
                 stale_microbatches: int = 0) -> list[Requirement]:
    """Every action that must have run before `action` may run.

    A requirement with a negative offset refers to an earlier training step (RECV_W of
    step k waits for the PUSH_W of step k - 1 - staleness); before step 0 it is satisfied.
    Offsets count training steps, not iterations (see [Note: lead] in `ir`).

    Args:
        action: an action whose stage exists in `topology` (its lead is ignored).
        topology: the topology the schedule runs on.
        staleness: how many versions a forward may lag (0: sync).
        stale_microbatches: the first K micro-batches of a step lag `staleness` versions,
            the rest one less (`_fresh_weights`); 0: all of them.

    Returns:
        (step offset, action) pairs; the peers of receives first, then local inputs.
    """
    base = action.base
    return (_peer_requirements(base, topology, staleness)
            + _fresh_weights(base, topology, staleness, stale_microbatches)
            + _local_requirements(base, topology))


def _fresh_weights(a: Action, topology: Topology, staleness: int, stale_microbatches: int
                   ) -> list[Requirement]:
    """[Note: micro-batch staleness] in pipefb.runtime.place: on a split topology the
    forward of micro-batch m >= K (0 < K) of step k uses version k - staleness + 1, so it
    waits for the weight push that follows step k - staleness's OPT."""
    if (a.kind is not Kind.F or not topology.is_split or not staleness
            or not 0 < stale_microbatches <= (a.microbatch or 0)):
        return []
    return [(-staleness, Action(b, Kind.PUSH_W))
            for b in topology.backward_stages_overlapping(a.stage)]
