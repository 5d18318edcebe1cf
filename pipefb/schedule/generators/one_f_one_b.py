"""1F1B with a flush (PipeDream-flush): warm-up forwards, then one F one B, cool-down."""

from __future__ import annotations

from pipefb.schedule.generators.common import backwards, check, forwards, per_stage
from pipefb.schedule.ir import Action, Kind, Schedule, Topology


def _stage(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    mbs = range(microbatches)
    fwd, bwd = forwards(stage, mbs), backwards(stage, mbs)
    warmup = min(n_stages - 1 - stage, microbatches)
    order = fwd[:warmup]
    for i in range(microbatches - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[microbatches - warmup :] + [Action(stage, Kind.OPT)]


def one_f_one_b(topology: Topology, microbatches: int) -> Schedule:
    """1F1B with a flush (PipeDream-flush): warm-up forwards, then one F one B, cool-down.

    Stage s runs `min(n_stages - 1 - s, M)` warm-up forwards, alternates one forward and
    one backward, drains the remaining backwards and steps the optimizer. Timing with
    3 stages and 4 micro-batches (a compute takes one tick, communication none)::

        w0 | 0F0  0F1  0F2            0B0  0F3  0B1       0B2       0B3  0OPT
        w1 |      1F0  1F1       1B0  1F2  1B1  1F3  1B2       1B3  1OPT
        w2 |           2F0  2B0  2F1  2B1  2F2  2B2  2F3  2B3  2OPT

    Args:
        topology: a combined topology; stage s runs on `topology.forward_workers[s]`.
        microbatches: micro-batches per step, >= 1.

    Returns:
        Worker -> compute-only action list.

    Raises:
        ScheduleError: the topology is not combined or `microbatches` < 1.
    """
    check(topology, microbatches, split=False, name="1f1b")
    return per_stage(topology, microbatches, _stage)
