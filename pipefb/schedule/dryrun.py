"""Dry run: executes a lowered schedule tick by tick and refuses it when it deadlocks."""

from __future__ import annotations

from pipefb.errors import ScheduleError
from pipefb.schedule.deps import Requirement, requirements
from pipefb.schedule.grid import Trace, format_grid
from pipefb.schedule.ir import Action, Schedule, Topology

# [Note: dry-run semantics]
# Every worker runs its list once per step, `steps` times in a row. Sends, STASH and
# PUSH_W never block (buffered); an action runs only once every requirement in
# `deps.requirements` has run (RECV_* wait for the matching send, FETCH for the STASH of
# every overlapping forward stage, RECV_W for the previous step's PUSH_W of every
# overlapping backward stage, computes for their receives). Per tick, every worker whose
# next action is ready runs it; what a tick produces is visible from the next tick on.


def _requirements_of(schedule: Schedule, topology: Topology) -> dict[int, list[list[Requirement]]]:
    table: dict[int, list[list[Requirement]]] = {}
    for worker, actions in schedule.items():
        table[worker] = []
        for i, action in enumerate(actions):
            try:
                table[worker].append(requirements(action, topology))
            except ScheduleError as err:
                raise ScheduleError(str(err), format_grid(schedule, {(worker, i)})) from None
    return table


def _missing(reqs: list[Requirement], step: int, done: set[tuple[int, Action]]) -> list[Action]:
    return [a for off, a in reqs if step + off >= 0 and (step + off, a) not in done]


def _deadlock(
    schedule: Schedule,
    topology: Topology,
    blocked: dict[int, tuple[int, int, list[Action]]],
    tick: int,
) -> ScheduleError:
    lines = [f"deadlock at tick {tick}: no worker can progress"]
    for worker, (step, i, missing) in sorted(blocked.items()):
        waits = ", ".join(f"{a} (worker {topology.worker_of(a)})" for a in missing)
        lines.append(f"  worker {worker}, step {step}: {schedule[worker][i]} waits for {waits}")
    marks = {(w, i) for w, (_, i, _) in blocked.items()}
    return ScheduleError("\n".join(lines), format_grid(schedule, marks))


def dry_run(schedule: Schedule, topology: Topology, steps: int = 2) -> Trace:
    """Runs `steps` consecutive training steps of `schedule` (see [Note: dry-run semantics]).

    Lowered GPipe, 2 stages, 1 micro-batch, 1 step: the trace as `format_grid` shows it::

        worker | 0        1        2        3        4        5        6        7        8
        -------+--------------------------------------------------------------------------
        w0     | 0F0      0SEND_F0                                     0RECV_B0 0B0      0OPT
        w1     |                   1RECV_F0 1F0      1B0      1SEND_B0 1OPT

    Args:
        schedule: a lowered schedule (every receive present).
        topology: the topology it runs on.
        steps: consecutive training steps to run, >= 1.

    Returns:
        (worker, tick, action) for every action run, in order of tick then worker.

    Raises:
        ScheduleError: `steps` < 1, or no worker can progress before all finish
            ("deadlock ..."); the grid marks each stuck worker's blocked action.
    """
    if steps < 1:
        raise ScheduleError(f"dry run needs >= 1 step, got {steps}")
    reqs = _requirements_of(schedule, topology)
    pos = {w: 0 for w in schedule}
    done: set[tuple[int, Action]] = set()
    trace: Trace = []
    tick = 0
    while any(pos[w] < len(a) * steps for w, a in schedule.items()):
        ran, blocked = [], {}
        for worker, actions in sorted(schedule.items()):
            if pos[worker] >= len(actions) * steps:
                continue
            step, i = divmod(pos[worker], len(actions))
            missing = _missing(reqs[worker][i], step, done)
            if missing:
                blocked[worker] = (step, i, missing)
            else:
                ran.append((worker, step, actions[i]))
        if not ran:
            raise _deadlock(schedule, topology, blocked, tick)
        for worker, step, action in ran:
            done.add((step, action))
            pos[worker] += 1
            trace.append((worker, tick, action))
        tick += 1
    return trace
