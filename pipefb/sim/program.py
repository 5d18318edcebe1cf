"""The program: every rank's action list compiled once into what the event loop runs."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from pipefb.schedule import Action, Kind, Schedule, Topology
from pipefb.schedule.deps import requirements
from pipefb.schedule.ir import STAGE_KINDS
from pipefb.sim.costmodel import COMPUTE, SENDS, STORE_KINDS, Costs, stage_of
from pipefb.sim.memorymodel import RankMemory


@dataclass(frozen=True, slots=True)
class Op:
    """One action of a rank's list with everything the event loop needs, computed once.

    Keys number what consumers wait for: one per producing action, and one per
    (PUSH_W stage, destination) pair; `needs` holds (step offset, key) pairs.
    """

    action: Action
    index: int  # position in the rank's list
    microbatch: int
    compute: bool
    seconds: float  # compute-lane time, overhead included
    needs: tuple[tuple[int, int], ...]
    key: int  # what this action makes available (-1: nothing)
    sends: tuple[tuple[int, int, int], ...]  # (destination rank, bytes, key) of transfers
    deltas: tuple[tuple[str, int], ...]
    lane_bytes: int  # bytes a STASH or FETCH moves on the copy lane ([Note: copy lane])
    tail: float = 0.0  # seconds at the end that run after `sends` left ([Note: early sends])
    #: bytes a private rank's STASH puts or FETCH takes on its compute lane, through the
    #: node-local tier or past its cap the store ([Note: tier cap] in pipefb.sim.tierslots)
    tier_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Shape:
    """What every micro-batch's action of one kind and stage on one rank shares, its keys
    by family (see `Program`)."""

    seconds: float
    deltas: tuple[tuple[str, int], ...]
    needs: tuple[tuple[int, int, bool], ...]  # (step offset, family, per micro-batch)
    sends: tuple[tuple[int, int, int], ...]  # (destination, bytes, family)
    family: int  # of what the action makes available; -1 if it sends instead
    early: tuple[float, int, int, int, int] | None  # [Note: early sends]: a B's weight
    #: halves' seconds, its stashed bytes, and its SEND_B's destination, bytes and family


class Program:
    """Every rank's list as `Op`s ([Note: cost model] in pipefb.sim.costmodel).

    A key is `family * width + micro-batch + 1` (+ 0 for per-stage kinds), where a family
    is a (kind, stage) pair, or a (PUSH_W stage, "push", destination) triple: arithmetic
    on the micro-batch, so each (rank, kind, stage) shape is costed once (`Shape`)."""

    def __init__(self, schedule: Schedule, costs: Costs, memory: dict[int, RankMemory],
                 staleness: int, stale_microbatches: int = 0) -> None:
        self.costs, self.topology, self.staleness = costs, costs.topology, staleness
        self.stale = stale_microbatches  # [Note: micro-batch staleness]; 0: all stale
        self.families: dict[tuple[Any, ...], int] = {}
        self.width = 2 + max((a.microbatch for actions in schedule.values() for a in actions
                             if a.microbatch is not None), default=-1)
        self.shapes: dict[tuple[int, Kind, int, bool], Shape] = {}
        self.needs: dict[tuple[Kind, int, bool], list[tuple[int, Kind, int]]] = {}
        self.runs_weights = {r: _weight_halves_run(costs, r, actions)
                             for r, actions in schedule.items()}
        self.keeps_versions = {r: _keeps_versions(r, actions, costs.topology, staleness)
                               for r, actions in schedule.items()}
        self.back_to_back = {r: _back_to_back(actions) for r, actions in schedule.items()}
        self.ops = {r: [self._op(r, i, a, memory[r]) for i, a in enumerate(actions)]
                    for r, actions in schedule.items()}
        self.index = {r: {a.base: i for i, a in enumerate(actions)}
                      for r, actions in schedule.items()}

    @property
    def n_keys(self) -> int:
        """How many keys a step may make available (the stride between steps' keys)."""
        return len(self.families) * self.width

    def family(self, *what: Any) -> int:
        """The number of a key family, numbering a new one."""
        return self.families.setdefault(what, len(self.families))

    def name(self, key: int) -> tuple[Any, ...]:
        """The (kind, stage, micro-batch) or (stage, "push", destination) of a key."""
        family, mb = divmod(key, self.width)
        what = next(k for k, v in self.families.items() if v == family)
        return what if len(what) == 3 else (*what, mb - 1 if mb else None)

    def _needs(self, a: Action) -> list[tuple[int, Kind, int]]:
        """(step offset, kind, stage) of what `a` waits for: the same for every micro-batch
        of its kind and stage (a need's micro-batch is `a`'s, or none for per-stage kinds),
        so `requirements` runs once per (kind, stage)."""
        shape = (a.kind, a.stage, self._fresh(a))
        if shape not in self.needs:
            self.needs[shape] = [(offset, need.kind, need.stage) for offset, need in
                                 requirements(a, self.topology, self.staleness, self.stale)]
        return self.needs[shape]

    def _fresh(self, a: Action) -> bool:
        """Whether `a` is a forward that waits for the newer version ([Note: micro-batch
        staleness]): its needs differ from its stage's stale forwards'."""
        return a.kind is Kind.F and 0 < self.stale <= (a.microbatch or 0)

    def _shape(self, r: int, a: Action, memory: RankMemory) -> Shape:
        """What every micro-batch's `a` on rank `r` shares: seconds, deltas, keys by family."""
        c, t = self.costs, self.topology
        seconds = c.cluster.action_overhead
        if a.kind in COMPUTE:
            seconds += c.compute(r, a)
            if a.kind is Kind.OPT and self.keeps_versions[r]:
                seconds += c.weight_copy(r, a.stage)
        elif a.kind is Kind.RECV_W:
            seconds += c.install(r, a.stage)  # [Note: weight installs]
        elif a.kind in STORE_KINDS and r in c.on_compute:
            seconds += c.tier_seconds(a)  # [Note: tier copies]
        elif a.kind is Kind.STASH and not c.cluster.stash_in_flight_bytes:
            seconds += c.copy_links[r].seconds(c.stash_bytes(a))  # on the compute lane
        # local needs too: an unvalidated list may put them after (a deadlock)
        needs = tuple((offset, self.family(stage, "push", r), False) if kind is Kind.PUSH_W
                      else (offset, self.family(kind, stage), kind not in STAGE_KINDS)
                      for offset, kind, stage in self._needs(a))
        sends: tuple[tuple[int, int, int], ...] = ()
        if a.kind in SENDS:
            sends = ((_destination(t, a), c.send_bytes(a), self.family(a.kind, a.stage)),)
        elif a.kind is Kind.PUSH_W:
            sends = tuple((t.forward_workers[f], c.push_bytes(a.stage, f),
                           self.family(a.stage, "push", t.forward_workers[f]))
                          for f in t.forward_stages_overlapping(a.stage))
        family = -1 if sends else self.family(a.kind, a.stage)
        early = None
        if a.kind is Kind.B and self.runs_weights[r] is not None:
            layers = t.layers_of_backward(a.stage)
            send = Action(a.stage, Kind.SEND_B, 0)  # stage > 0 here
            early = (c.profile.weight_grad_seconds(layers) / c.cluster.workers[r].speed,
                     sum(c.kept_bytes(i) for i in layers), _destination(t, send),
                     c.send_bytes(send), self.family(Kind.SEND_B, a.stage))
        return Shape(seconds, memory.deltas(a), needs, sends, family, early)

    def _op(self, r: int, i: int, a: Action, memory: RankMemory) -> Op:
        shape = self.shapes.get((r, a.kind, a.stage, self._fresh(a)))
        if shape is None:
            shape = self.shapes[(r, a.kind, a.stage, self._fresh(a))] = self._shape(r, a, memory)
        width, mb = self.width, a.microbatch if a.microbatch is not None else -1
        needs = tuple([(offset, family * width + (mb + 1 if per_mb else 0))
                       for offset, family, per_mb in shape.needs])
        sends = tuple([(dst, nbytes, family * width + mb + 1)
                       for dst, nbytes, family in shape.sends])
        key = -1 if shape.family < 0 else shape.family * width + mb + 1
        runs = self.runs_weights[r]
        if i in self.back_to_back[r]:  # [Note: back-to-back stash]: nothing moves
            return Op(a.base, i, mb, False, self.costs.cluster.action_overhead, needs, key,
                      sends, (), 0)
        if runs is not None and a.kind is Kind.SEND_B:  # [Note: early sends]: the B sent
            sends, key = (), -1
        elif runs is not None and shape.early is not None:
            return self._early(a, i, mb, shape, needs, runs.get(mb, 0))
        private = r in self.costs.on_compute
        lane = not private and (
            a.kind is Kind.FETCH or (a.kind is Kind.STASH
                                     and bool(self.costs.cluster.stash_in_flight_bytes)))
        tier = private and a.kind in STORE_KINDS  # [Note: tier cap]
        nbytes = self.costs.stash_bytes(a) if lane or tier else 0
        return Op(a.base, i, mb, a.kind in COMPUTE, shape.seconds, needs, key, sends,
                  shape.deltas, nbytes if lane else 0, tier_bytes=nbytes if tier else 0)

    def _early(self, a: Action, i: int, mb: int, shape: Shape,
               needs: tuple[tuple[int, int], ...], halves: int) -> Op:
        """A B on a rank that sends input grads first ([Note: early sends]): the B sends,
        then runs `halves` micro-batches' weight-grad halves and frees their saved
        tensors; the SEND_B only costs its overhead."""
        assert shape.early is not None
        weights, stashed, dst, nbytes, family = shape.early
        deltas = tuple((k, -halves * stashed if k == "stashed" else d)
                       for k, d in shape.deltas)
        key, sent = (f * self.width + mb + 1 for f in (shape.family, family))
        return Op(a.base, i, mb, True, shape.seconds + (halves - 1) * weights, needs, key,
                  ((dst, nbytes, sent),), deltas, 0, tail=halves * weights)


# [Note: early sends]
# A rank of backward stage s > 0 (sync mode, or any backward-only rank) sends its input
# gradient before its weight grads ([Note: input grads first] in pipefb.runtime.stage):
# its B sends the gradient
# after the input halves (B's time less the profile's `weight_grad_seconds`), then runs
# the weight halves of the micro-batches the runtime runs there (none for the first s, one
# each after, all left at the last B; the saved tensors of a micro-batch are freed with
# its halves) and its SEND_B only costs the overhead. A profile without
# `weight_grad_seconds` (analytic) sends after the whole B.


def _back_to_back(actions: list[Action]) -> set[int]:
    """Positions of the STASHes whose FETCH comes right after them, and of those
    FETCHes: the runtime skips both, the saved tensors stay ([Note: back-to-back stash]
    in pipefb.runtime.exchange)."""
    out: set[int] = set()
    for i, (a, b) in enumerate(pairwise(actions)):
        if (a.kind is Kind.STASH and b.kind is Kind.FETCH and a.stage == b.stage
                and a.microbatch == b.microbatch and a.lead == b.lead):
            out |= {i, i + 1}
    return out


def _weight_halves_run(costs: Costs, r: int, actions: list[Action]) -> dict[int, int] | None:
    """For a rank that sends input grads first, how many micro-batches' weight-grad halves
    each B (by micro-batch) runs; None for other ranks. Mirrors the runtime: backward
    stage s > 0 in sync mode, or on a backward-only rank, lets s wait, its last B of a step
    runs all that are left."""
    t = costs.topology
    stage = stage_of(t.backward_workers, r)
    if not stage or (costs.plan.mode != "sync" and r in t.forward_workers):
        return None
    order = [a.microbatch for a in actions if a.kind is Kind.B]
    runs = {m: 1 if k >= stage else 0 for k, m in enumerate(order) if m is not None}
    if order and order[-1] is not None:
        runs[order[-1]] = min(len(order) - 1, stage) + 1
    return runs


# [Note: weight versions]
# An OPT that keeps the weights it replaces copies the stage's parameters first
# (`WeightVersions.keep`, into fresh memory): on a combined rank whose list runs a forward
# of the next step before its OPT (PipeDream: that forward's backward needs the old
# weights), and on a backward rank of an async plan (staleness >= 1: later steps' forwards
# ran on them). The profile's `weight_copy_seconds_per_byte` prices it (`Costs.weight_copy`).


def _keeps_versions(r: int, actions: list[Action], t: Topology, staleness: int) -> bool:
    """Whether rank r's OPT copies the weights it replaces ([Note: weight versions])."""
    if r not in t.backward_workers:
        return False
    if r not in t.forward_workers:
        return staleness > 0
    for a in actions:
        if a.kind is Kind.OPT:
            return False
        if a.kind is Kind.F and a.lead:
            return True
    return False


def _destination(t: Topology, a: Action) -> int:
    """The rank a SEND_F, SEND_B or SEND_L sends to."""
    if a.kind is Kind.SEND_F:
        return t.forward_workers[a.stage + 1]
    if a.kind is Kind.SEND_B:
        return t.backward_workers[a.stage - 1]
    return t.backward_workers[-1]



__all__ = ["Op", "Program", "Shape"]
