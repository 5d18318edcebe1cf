"""Validation: structural checks of a lowered schedule, then a deadlock-free dry run."""

from __future__ import annotations

from pipefb.errors import ScheduleError
from pipefb.schedule.deps import requirements
from pipefb.schedule.dryrun import dry_run
from pipefb.schedule.grid import Trace, format_grid, format_table
from pipefb.schedule.ir import PRODUCER_KINDS, SPLIT_KINDS, Action, Kind, Schedule, Topology

__all__ = ["Trace", "dry_run", "format_grid", "format_table", "validate"]

#: (worker, index) of every action in a schedule.
Index = dict[Action, tuple[int, int]]


def _fail(schedule: Schedule, message: str, *cells: tuple[int, int]) -> ScheduleError:
    return ScheduleError(message, format_grid(schedule, set(cells)))


def _stage_allowed(a: Action, topology: Topology) -> bool:
    last_f, last_b = topology.n_forward_stages - 1, topology.n_backward_stages - 1
    rules = {
        Kind.RECV_F: a.stage > 0,
        Kind.SEND_F: a.stage < last_f,
        Kind.SEND_L: a.stage == last_f,
        Kind.SEND_B: a.stage > 0,
        Kind.RECV_B: a.stage < last_b,
        Kind.RECV_L: a.stage == last_b,
    }
    return rules.get(a.kind, True)


def _check_action(a: Action, worker: int, topology: Topology, microbatches: int) -> str | None:
    """The reason `a` may not stand on `worker`, or None."""
    try:
        owner = topology.worker_of(a)
    except ScheduleError as err:
        return str(err)
    if owner != worker:
        return f"{a} must run on worker {owner}, found on worker {worker}"
    if a.microbatch is not None and a.microbatch >= microbatches:
        return f"{a}: micro-batch {a.microbatch} out of range 0..{microbatches - 1}"
    if a.kind in SPLIT_KINDS and not topology.is_split:
        return f"{a}: {a.kind} exists only on split topologies"
    if not _stage_allowed(a, topology):
        return f"{a}: stage {a.stage} has no peer for {a.kind}"
    return None


def _index(schedule: Schedule, topology: Topology, microbatches: int) -> Index:
    """Checks workers, placement and uniqueness; returns where each action stands."""
    known = set(topology.workers())
    index: Index = {}
    for worker, actions in sorted(schedule.items()):
        if worker not in known:
            raise _fail(schedule, f"worker {worker} is not in the topology {sorted(known)}")
        for i, a in enumerate(actions):
            reason = _check_action(a, worker, topology, microbatches)
            if reason is not None:
                raise _fail(schedule, reason, (worker, i))
            if a.base in index:
                raise _fail(schedule, f"{a} appears twice", index[a.base], (worker, i))
            index[a.base] = (worker, i)
    return index


def _compute_actions(topology: Topology, microbatches: int) -> list[Action]:
    mbs = range(microbatches)
    fwd = [Action(s, Kind.F, m) for s in range(topology.n_forward_stages) for m in mbs]
    bwd = [Action(s, Kind.B, m) for s in range(topology.n_backward_stages) for m in mbs]
    return fwd + bwd + [Action(s, Kind.OPT) for s in range(topology.n_backward_stages)]


def _check_compute(schedule: Schedule, index: Index, topology: Topology, mbs: int) -> None:
    """Every F, B and OPT once; OPT after its Bs; combined: B after its F."""
    for a in _compute_actions(topology, mbs):
        if a not in index:
            raise _fail(schedule, f"{a} is missing (worker {topology.worker_of(a)})")
    for a, (worker, i) in index.items():
        if a.kind is Kind.OPT:
            late = [index[Action(a.stage, Kind.B, m)] for m in range(mbs)]
            for cell in late:
                if cell[1] > i:
                    raise _fail(schedule, f"{a} before {schedule[worker][cell[1]]}", (worker, i))
        if a.kind is Kind.B and topology.is_combined:
            f_cell = index[Action(a.stage, Kind.F, a.microbatch)]
            ahead = schedule[worker][f_cell[1]].lead  # a forward led in the iteration before
            if f_cell[1] > i and not ahead:
                raise _fail(schedule, f"{a} before its forward on worker {worker}", (worker, i))


def _check_matching(schedule: Schedule, index: Index, topology: Topology) -> None:
    """Every requirement is scheduled; every send, stash and push has a consumer."""
    consumed: set[Action] = set()
    for a, cell in index.items():
        for _, need in requirements(a, topology, 0):
            if need not in index:
                raise _fail(schedule, f"{a} needs {need}, which is not in the schedule", cell)
            consumed.add(need)
    for a, cell in index.items():
        if a.kind in PRODUCER_KINDS and a not in consumed:
            raise _fail(schedule, f"{a} has no matching receive", cell)


def validate(schedule: Schedule, topology: Topology, microbatches: int, staleness: int = 0
             ) -> None:
    """Refuses a lowered schedule that is malformed or deadlocks.

    Checks, in order: placement (each action on the worker of its stage, stages and
    micro-batches in range), uniqueness, every F/B/OPT exactly once, OPT after all Bs of
    its stage, B after F on combined workers, matched sends and receives (SEND_F(s,m) <->
    RECV_F(s+1,m), SEND_B(s,m) <-> RECV_B(s-1,m), SEND_L <-> RECV_L, STASH <-> FETCH and
    PUSH_W <-> RECV_W over overlapping layers), then a `dry_run` of enough steps to cross
    every step boundary the schedule's leads and `staleness` reach.

    Args:
        schedule: a lowered schedule.
        topology: the topology it runs on.
        microbatches: micro-batches per step.
        staleness: weight versions a forward may lag (async PipeFB); 0 for sync.

    Raises:
        ScheduleError: the first problem found; `.grid` marks the cell at fault.
    """
    if microbatches < 1:
        raise ScheduleError(f"need >= 1 micro-batch, got {microbatches}")
    index = _index(schedule, topology, microbatches)
    _check_compute(schedule, index, topology, microbatches)
    _check_matching(schedule, index, topology)
    if staleness < 0:
        raise ScheduleError(f"staleness must be >= 0, got {staleness}")
    dry_run(schedule, topology, steps=3 + staleness, staleness=staleness)
