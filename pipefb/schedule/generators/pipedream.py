"""PipeDream: 1F1B with no flush; the next step's warm-up forwards run before OPT."""

from __future__ import annotations

from pipefb.schedule.generators.common import check, per_stage
from pipefb.schedule.ir import Action, Kind, Schedule, Topology


def _stage(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    warmup = min(n_stages - 1 - stage, microbatches)
    order: list[Action] = []
    for i in range(microbatches):
        ahead = i + warmup  # the forward `warmup` micro-batches ahead in the stream
        order.append(Action(stage, Kind.F, ahead % microbatches, lead=ahead // microbatches))
        order.append(Action(stage, Kind.B, i))
    return [*order, Action(stage, Kind.OPT)]


def pipedream(topology: Topology, microbatches: int) -> Schedule:
    """PipeDream: 1F1B with no flush; the next step's warm-up forwards run before OPT.

    Over the endless stream of micro-batches, stage s keeps `w = min(n_stages - 1 - s, M)`
    forwards ahead of its backwards; the forwards of the next step carry lead 1 (see
    [Note: lead]) and therefore use the weights before this step's update, which the
    runtime stashes for their backward (weight stashing). Iteration k, 3 stages and
    4 micro-batches (a compute takes one tick, communication none; +1: step k+1)::

        w0 | 0F2      0B0  0F3      0B1  0F0+1    0B2  0F1+1    0B3  0OPT
        w1 | 1F1  1B0  1F2  1B1  1F3  1B2  1F0+1  1B3  1OPT
        w2 | 2F0  2B0  2F1  2B1  2F2  2B2  2F3  2B3  2OPT

    Iteration 0 first runs the warm-up forwards of step 0 (0F0 0F1 on w0, 1F0 on w1).

    Args:
        topology: a combined topology; stage s runs on `topology.forward_workers[s]`.
        microbatches: micro-batches per step, >= 1.

    Returns:
        Worker -> compute-only action list of one iteration.

    Raises:
        ScheduleError: the topology is not combined or `microbatches` < 1.
    """
    check(topology, microbatches, split=False, name="pipedream")
    return per_stage(topology, microbatches, _stage)
