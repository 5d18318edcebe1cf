"""Dry run: executes a lowered schedule tick by tick and refuses it when it deadlocks."""

from __future__ import annotations

from pipefb.errors import ScheduleError
from pipefb.schedule.deps import Requirement, requirements
from pipefb.schedule.grid import Trace, format_grid
from pipefb.schedule.ir import Action, Schedule, Topology, iteration

# [Note: dry-run semantics]
# Every worker runs its list once per iteration, `steps` times in a row, leads unrolled
# as the runtime does (`ir.iteration`). Sends, STASH and
# PUSH_W never block (buffered); an action runs only once every requirement in
# `deps.requirements` has run (RECV_* wait for the matching send, FETCH for the STASH of
# every overlapping forward stage, RECV_W for the previous step's PUSH_W of every
# overlapping backward stage, computes for their receives). Per tick, every worker whose
# next action is ready runs it; what a tick produces is visible from the next tick on.


def _requirements_of(schedule: Schedule, topology: Topology, staleness: int
                     ) -> dict[int, list[list[Requirement]]]:
    table: dict[int, list[list[Requirement]]] = {}
    for worker, actions in schedule.items():
        table[worker] = []
        for i, action in enumerate(actions):
            try:
                table[worker].append(requirements(action, topology, staleness))
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
        lines.append(f"  worker {worker}, step {step}: {schedule[worker][i].base} waits for "
                     f"{waits}")
    marks = {(w, i) for w, (_, i, _) in blocked.items()}
    return ScheduleError("\n".join(lines), format_grid(schedule, marks))


def dry_run(schedule: Schedule, topology: Topology, steps: int = 2, staleness: int = 0) -> Trace:
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
        staleness: weight versions a forward may lag (async PipeFB); 0 for sync.

    Returns:
        (worker, tick, action) for every action run, in order of tick then worker.

    Raises:
        ScheduleError: `steps` < 1, or no worker can progress before all finish
            ("deadlock ..."); the grid marks each stuck worker's blocked action.
    """
    if steps < 1:
        raise ScheduleError(f"dry run needs >= 1 step, got {steps}")
    reqs = _requirements_of(schedule, topology, staleness)
    runs = {w: _unrolled(actions, steps) for w, actions in schedule.items()}
    pos = dict.fromkeys(schedule, 0)
    done: set[tuple[int, Action]] = set()
    trace: Trace = []
    tick = 0
    while any(pos[w] < len(run) for w, run in runs.items()):
        ran, blocked = [], {}
        for worker, run in sorted(runs.items()):
            if pos[worker] >= len(run):
                continue
            step, action, i = run[pos[worker]]
            missing = _missing(reqs[worker][i], step, done)
            if missing:
                blocked[worker] = (step, i, missing)
            else:
                ran.append((worker, step, action))
        if not ran:
            raise _deadlock(schedule, topology, blocked, tick)
        for worker, step, action in ran:
            done.add((step, action))
            pos[worker] += 1
            trace.append((worker, tick, action))
        tick += 1
    return trace


def _unrolled(actions: list[Action], steps: int) -> list[tuple[int, Action, int]]:
    """(training step, base action, index in `actions`) in the order the worker runs them."""
    where = {a.base: i for i, a in enumerate(actions)}
    return [(step, a, where[a]) for k in range(steps) for step, a in iteration(actions, k, steps)]
