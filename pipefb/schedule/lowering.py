"""Lowering: pure passes that add communication, stash/fetch and weight actions."""

from __future__ import annotations

from collections.abc import Callable

from pipefb.schedule.ir import Action, Kind, Schedule, Topology

# [Note: lowered order]
# Around F(s,m):  RECV_F(s,m) if s > 0 | F | STASH if stage s stashes (every forward
#                 stage of a split topology; a combined stage with an `offload` layer) |
#                 SEND_F if s < last, else SEND_L on split topologies; all carry F's
#                 lead. STASH precedes the send, so the stash
#                 happens-before the backward that the send (or hand-off) unblocks.
# Around B(s,m):  RECV_B if s < last, else RECV_L (split) | FETCH (if it stashes) | B |
#                 SEND_B if s > 0.
# Weights (split): OPT(s) | PUSH_W(s) on backward workers; RECV_W(s) first on forward
#                 workers. Sends are buffered; RECV_*, FETCH and RECV_W block.

Expansion = Callable[[Action], list[Action]]


def _expand(schedule: Schedule, rule: Expansion) -> Schedule:
    """Replaces every action by `rule(action)`; the input is left untouched."""
    return {w: [new for a in actions for new in rule(a)] for w, actions in schedule.items()}


def stashing_stages(topology: Topology, offloaded: frozenset[int]) -> frozenset[int]:
    """Forward stages whose F puts saved tensors in the offload store.

    Args:
        topology: the topology.
        offloaded: stages of a combined topology that hold an `offload` layer.
    """
    if topology.is_split:
        return frozenset(range(topology.n_forward_stages))
    return offloaded


def _forward_rule(topology: Topology, stashing: frozenset[int]) -> Expansion:
    last = topology.n_forward_stages - 1
    split = topology.is_split

    def rule(a: Action) -> list[Action]:
        if a.kind is not Kind.F:
            return [a]
        s, m, lead = a.stage, a.microbatch, a.lead
        before = [Action(s, Kind.RECV_F, m, lead)] if s > 0 else []
        after = [Action(s, Kind.STASH, m, lead)] if s in stashing else []
        if s < last:
            after.append(Action(s, Kind.SEND_F, m, lead))
        elif split:
            after.append(Action(s, Kind.SEND_L, m))
        return [*before, a, *after]

    return rule


def _backward_rule(topology: Topology, stashing: frozenset[int]) -> Expansion:
    last = topology.n_backward_stages - 1
    split = topology.is_split

    def rule(a: Action) -> list[Action]:
        if a.kind is not Kind.B:
            return [a]
        s, m = a.stage, a.microbatch
        before = []
        if s < last:
            before.append(Action(s, Kind.RECV_B, m))
        elif split:
            before.append(Action(s, Kind.RECV_L, m))
        if split or s in stashing:
            before.append(Action(s, Kind.FETCH, m))
        after = [Action(s, Kind.SEND_B, m)] if s > 0 else []
        return [*before, a, *after]

    return rule


def _push_rule(a: Action) -> list[Action]:
    return [a, Action(a.stage, Kind.PUSH_W)] if a.kind is Kind.OPT else [a]


def _add_weight_waits(schedule: Schedule, topology: Topology) -> Schedule:
    """Puts RECV_W(s) first on the worker of each forward stage s."""
    out = dict(schedule)
    for s, worker in enumerate(topology.forward_workers):
        out[worker] = [Action(s, Kind.RECV_W), *schedule.get(worker, [])]
    return out


def lower(schedule: Schedule, topology: Topology, offloaded: frozenset[int] = frozenset()
          ) -> Schedule:
    """Adds every non-compute action to a compute-only schedule (see [Note: lowered order]).

    Lowered 1F1B, stage 1 of 2 (worker 1), 2 micro-batches::

        1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1OPT

    Args:
        schedule: worker -> compute-only actions (F, B, OPT), e.g. from `generate`.
        topology: the topology the schedule was generated for.
        offloaded: stages of a combined topology holding an `offload` layer (they get
            STASH and FETCH); ignored on split topologies, where every stage stashes.

    Returns:
        A new schedule; `schedule` is not modified.
    """
    stashing = stashing_stages(topology, offloaded)
    lowered = _expand(schedule, _forward_rule(topology, stashing))
    lowered = _expand(lowered, _backward_rule(topology, stashing))
    if topology.is_split:
        lowered = _expand(lowered, _push_rule)
        lowered = _add_weight_waits(lowered, topology)
    return lowered
