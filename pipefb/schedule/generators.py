"""Generators: compute-only schedules (F, B, OPT) for one training step, per schedule kind."""

from __future__ import annotations

from collections.abc import Callable

from pipefb.errors import ScheduleError
from pipefb.schedule.ir import Action, Kind, Schedule, Topology

#: Schedule kinds `generate` knows, in the order the docs list them.
KINDS = ("gpipe", "1f1b", "pipedream", "pipefb")


def _check(topology: Topology, microbatches: int, *, split: bool, name: str) -> None:
    if microbatches < 1:
        raise ScheduleError(f"{name} needs >= 1 micro-batch, got {microbatches}")
    if split and not topology.is_split:
        raise ScheduleError(f"{name} needs a split topology (no worker in both passes)")
    if not split and not topology.is_combined:
        raise ScheduleError(f"{name} needs a combined topology (same workers and partitions)")


def _fwd(stage: int, mbs: range) -> list[Action]:
    return [Action(stage, Kind.F, m) for m in mbs]


def _bwd(stage: int, mbs: range) -> list[Action]:
    return [Action(stage, Kind.B, m) for m in mbs]


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
    _check(topology, microbatches, split=False, name="gpipe")
    mbs = range(microbatches)
    return {
        worker: [*_fwd(s, mbs), *_bwd(s, mbs), Action(s, Kind.OPT)]
        for s, worker in enumerate(topology.forward_workers)
    }


def _per_stage(topology: Topology, microbatches: int,
               stage_list: Callable[[int, int, int], list[Action]]) -> Schedule:
    """A combined schedule from `stage_list(stage, n_stages, microbatches)` per stage."""
    n = topology.n_forward_stages
    return {w: stage_list(s, n, microbatches) for s, w in enumerate(topology.forward_workers)}


def _one_f_one_b_stage(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    mbs = range(microbatches)
    fwd, bwd = _fwd(stage, mbs), _bwd(stage, mbs)
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
    _check(topology, microbatches, split=False, name="1f1b")
    return _per_stage(topology, microbatches, _one_f_one_b_stage)


def _pipedream_stage(stage: int, n_stages: int, microbatches: int) -> list[Action]:
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
    _check(topology, microbatches, split=False, name="pipedream")
    return _per_stage(topology, microbatches, _pipedream_stage)


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
    _check(topology, microbatches, split=True, name="pipefb")
    mbs = range(microbatches)
    schedule: Schedule = {w: _fwd(s, mbs) for s, w in enumerate(topology.forward_workers)}
    for s, worker in enumerate(topology.backward_workers):
        schedule[worker] = [*_bwd(s, mbs), Action(s, Kind.OPT)]
    return dict(sorted(schedule.items()))


_GENERATORS: dict[str, Callable[[Topology, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
    "pipefb": pipefb,
}


def generate(kind: str, topology: Topology, microbatches: int) -> Schedule:
    """Compute-only schedule of kind `kind` (one of `KINDS`).

    Raises:
        ScheduleError: unknown kind, or a topology the kind cannot run on.
    """
    generator = _GENERATORS.get(kind)
    if generator is None:
        raise ScheduleError(f"unknown schedule kind {kind!r}; known: {', '.join(KINDS)}")
    return generator(topology, microbatches)
