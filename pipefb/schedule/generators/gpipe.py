"""GPipe: all forwards, then all backwards, then the optimizer step."""

from __future__ import annotations

from pipefb.schedule.generators.common import backwards, check, forwards
from pipefb.schedule.ir import Action, Kind, Schedule, Topology


def gpipe(topology: Topology, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, then the optimizer step.

    Timing with 3 stages and 4 micro-batches once lowered, one column per clock tick
    (a compute takes one tick, communication none)::

        w0 | 0F0  0F1  0F2  0F3                      0B0  0B1  0B2  0B3  0OPT
        w1 |      1F0  1F1  1F2  1F3            1B0  1B1  1B2  1B3  1OPT
        w2 |           2F0  2F1  2F2  2F3  2B0  2B1  2B2  2B3  2OPT

    Args:
        topology: a combined topology; stage s runs on `topology.forward_workers[s]`.
        microbatches: micro-batches per step, >= 1.

    Returns:
        Worker -> compute-only action list.

    Raises:
        ScheduleError: the topology is not combined or `microbatches` < 1.
    """
    check(topology, microbatches, split=False, name="gpipe")
    mbs = range(microbatches)
    return {
        worker: [*forwards(s, mbs), *backwards(s, mbs), Action(s, Kind.OPT)]
        for s, worker in enumerate(topology.forward_workers)
    }
