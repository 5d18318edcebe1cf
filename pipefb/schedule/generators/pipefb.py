"""PipeFB: forward workers run only forwards, backward workers backwards and OPT."""

from __future__ import annotations

from pipefb.errors import ConfigError
from pipefb.schedule.generators.common import backwards, check, forwards
from pipefb.schedule.ir import Action, Kind, Schedule, Topology


def pipefb(topology: Topology, microbatches: int) -> Schedule:
    """PipeFB: forward workers run only forwards, backward workers backwards and OPT.

    Forward and backward stages may cover different layers. Timing with forward
    workers (0, 1), backward workers (2, 3) and 3 micro-batches (a compute takes one
    tick; hand-offs, stash, fetch and weight push none)::

        w0 | 0F0  0F1  0F2
        w1 |      1F0  1F1  1F2
        w2 |                0B0  0B1  0B2  0OPT
        w3 |           1B0  1B1  1B2  1OPT

    Args:
        topology: a split topology.
        microbatches: micro-batches per step, >= 1.

    Returns:
        Worker -> compute-only action list.

    Raises:
        ScheduleError: the topology is not split or `microbatches` < 1.
    """
    check(topology, microbatches, split=True, name="pipefb")
    mbs = range(microbatches)
    schedule: Schedule = {w: forwards(s, mbs) for s, w in enumerate(topology.forward_workers)}
    for s, worker in enumerate(topology.backward_workers):
        schedule[worker] = [*backwards(s, mbs), Action(s, Kind.OPT)]
    return dict(sorted(schedule.items()))


def split_stages(workers: int) -> tuple[int, int]:
    """(forward stages, backward stages) PipeFB makes of `workers` workers: the backward
    pass, about twice the forward's work, gets the larger half.

    Raises:
        ConfigError: fewer than 2 workers (one forward and one backward at least).
    """
    if workers < 2:
        raise ConfigError("schedule 'pipefb' needs at least 2 workers (forward and backward)")
    return workers // 2, workers - workers // 2
