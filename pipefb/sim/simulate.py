"""Discrete-event simulator: runs a plan's lowered action lists against a cost model.

The simulator executes exactly what the workers execute (`plan.schedule_for`, unrolled
by `ir.iteration`, dependencies from `deps.requirements`) with durations from a layer
profile and a cluster description, and predicts the step time, each worker's timeline,
the bubble fraction and each worker's peak memory as the runtime accounts it.

[Note: cost model]
- F, B, OPT run on the worker's host (see [Note: shared hosts]); their time is the
  profiled layer time over the worker's speed: F sums the stage's forwards (plus loading
  the micro-batch on the first stage and the loss's, `Profile.data_seconds`), B its
  backwards plus the forwards of its recomputed layers, OPT is the optimizer's fixed
  seconds plus its seconds per byte times the bytes it updates (none without parameters),
  plus the copy of those bytes where it keeps a weight version ([Note: weight versions]).
- SEND_F, SEND_B, SEND_L and PUSH_W cost the sender only the action overhead; the bytes
  then cross the link between the two workers, one transfer at a time per direction
  (FIFO), arriving `latency + bytes / bandwidth` after they start.
- STASH puts the stashed bytes into the store (the worker waits: latency + bytes over the
  store bandwidth); FETCH waits for every matching STASH, then takes the bytes back. On a
  combined worker, the fetch of the next micro-batch overlaps the backward before it
  (the runtime prefetches).
- RECV_* and RECV_W wait for the arrival; every action adds the cluster's action
  overhead, every iteration its step overhead (and, on a loopback host, its Step call's
  CPU beside it: [Note: step calls]). On a loopback host a send followed by compute
  starts later ([Note: busy senders]).

[Note: flush]
A rank ends each step by waiting until every transfer it sent has left
(`Transport.flush`: the caller may reuse those tensors after it), so its next iteration
starts no earlier than that: on a link, when its last byte is sent (latency not
included); on a loopback host, when the transfer's CPU job ends (the hand-off is work of
both processes, so it leaves as it arrives). This binds where a step ends with a send:
a backward-only worker's PUSH_W of the new weights after its OPT (measured on a 2-worker
`mlp` pipefb run here: 2.75 ms between its steps against 0.2-0.7 ms on ranks whose steps
end in OPT).

[Note: shared hosts]
A host with fewer cores than workers, or a loopback host (`Cluster.loopback_hosts`: one
machine whose workers talk over loopback gRPC and a local store), is simulated with
processor sharing, as an OS schedules threads: every busy action of its workers is a job,
and n jobs each progress at min(1, cores / n). On a loopback host a transfer between two
of its workers is a job too, the link's whole time (latency plus bytes over bandwidth):
copying and (de)serialising the bytes, and waking the threads that hand them on, all
need a core, so a hop on a busy host takes longer (measured here with back-to-back
probes: an echo's one-way 0.35 ms idle, about 1 ms with two other processes half busy on
the 2 cores; the calibration's latency is of a link idle before the hop, [Note: idle
links] in calibration.calibrate). Both ends
work at once, so a transfer keeps `Link.cpu` cores busy for its time, not one: a second
job of (cpu - 1) times the work runs beside it, and a STASH or FETCH on a loopback host
gets one for the local Redis's share (`store.cpu`). Measured here as the CPU of both
processes over the wall time: 1.2 at 1 KB, about 1.5 at 16 MiB for gRPC hops and store
puts and takes (the calibration's large probes set it). Events
then run in time order; otherwise every rank runs ahead as far as its inputs allow (same
times, faster).

[Note: oversubscribed cores]
With more busy threads than cores, the OS switches between them and each switch refills
the caches, so the cores do less work in all: a host's `oversubscribed` speed (measured
by the calibration) is what is left with twice as many threads as cores, and the rate of
n > cores jobs falls linearly in between and beyond, (1 - (1 - oversubscribed) (n -
cores) / cores), no lower than `MIN_OVERSUBSCRIBED`. Measured here with copies of one
`gpt` block's forward and backward in 1-5 processes on the 2 cores: 0.91 and 0.93 of
the two-process throughput with 4, 0.82-0.88 with 5.

[Note: step calls]
Each step of each worker is a Step call from the coordinator (`coordinator.stepping`):
the coordinator's end (the call, its reply parsed, the step's report) and the worker's
(its reply built and sent) cost CPU outside any action. On a loopback host the
coordinator runs there too, so the simulator starts a job of `Cluster.step_cpu` seconds
on the host beside each rank's first action of an iteration (the next call is already
waiting on the worker: the CPU overlaps the step, while `step_overhead` is the gap the
rank itself waits). Measured in a 4-worker `mlp` pipedream run here (about 110 steps a
second): the coordinator used 0.2 of a core, 0.44 ms per rank and step, and each worker
0.12 ms per Step call beyond its actions; the calibration measures the call on both ends.

[Note: busy senders]
A worker's gRPC threads hand its sends on under its process's Python lock (the GIL).
When the worker computes right after a send, torch drops and retakes that lock around
each operator, and CPython asks a holder to let go only after a switch interval in which
the lock never changed hands, so a waiting thread can wait out the whole compute.
Measured here with 64 KB on the calibration's stream, the sender then running 1-4 ms of a
512-wide Linear's forward and backward: one way 0.76-1.2 ms on average against 0.34 ms
idle, in two modes (most hops about 0.4 ms; 8-37% wait for the compute's end); the
receiver computing instead changed nothing (0.37 ms), nor did the switch interval
(0.02-5 ms). On a loopback host the simulator starts such a transfer `Cluster.busy_send`
later (the calibration's mean extra delay), or when that compute would end at full speed
if sooner; an early send ([Note: early sends]) is followed by its B's weight halves. A
step's last sends are not: its flush waits, the lock free, until they left.

[Note: early sends]
A rank of backward stage s > 0 in sync mode sends its input gradient before its weight
grads ([Note: input grads first] in pipefb.runtime.stage): its B sends the gradient after the
input halves (B's time less the profile's `weight_grad_seconds`), then runs the weight
halves of the micro-batches the runtime runs there (none for the first s, one each after,
all left at the last B; the saved tensors of a micro-batch are freed with its halves) and
its SEND_B only costs the overhead. A profile without `weight_grad_seconds` (analytic)
sends after the whole B.

[Note: weight versions]
An OPT that keeps the weights it replaces copies the stage's parameters first
(`WeightVersions.keep`, into fresh memory): on a combined rank whose list runs a forward
of the next step before its OPT (PipeDream: that forward's backward needs the old
weights), and on a backward rank of an async plan (staleness >= 1: later steps' forwards
ran on them). The profile's `weight_copy_seconds_per_byte` prices it. Measured here on a
3-worker `mlp` PipeDream run: the copy took 0.12-0.16 ms of the thread's CPU per OPT for
about 1.1 MB of a stage's parameters, and the in-situ fits of the bench's PipeDream runs
had put every OPT 1.6-3.2x over the profiled step (1.0-1.8x under the other schedules).

[Note: simulated memory]
After every action the simulator sums, per worker, the same kinds the runtime accounts
(`pipefb.memory.KINDS`) from the profile's bytes: parameters of the layers held;
gradients of the owned layers from a step's first backward to its OPT; optimizer state
(ratio x owned bytes); kept weight versions (PipeDream stashing, async PipeFB); in-flight
activations (received inputs until F, outputs until sent, gradients likewise); stashed
saved tensors (keep until B; offload until STASH and from FETCH to B; recompute: the
input of each run).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise
from operator import itemgetter
from typing import Any

from pipefb.errors import ScheduleError
from pipefb.memory import KINDS
from pipefb.plan.plan import Plan, lowered_schedule, recompute_runs, schedule_for
from pipefb.schedule import Action, Kind, Schedule, Topology, iteration
from pipefb.schedule.deps import requirements
from pipefb.schedule.ir import STAGE_KINDS
from pipefb.sim.cluster import MIN_OVERSUBSCRIBED, Cluster, Link, group_view, ring_link
from pipefb.sim.costs import Profile, kept_bytes, ring_allreduce_seconds

COMPUTE = frozenset({Kind.F, Kind.B, Kind.OPT})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.SEND_L})
STORE_KINDS = frozenset({Kind.STASH, Kind.FETCH})
LOSS_BYTES = 4  # a float32 scalar
_EPSILON = 1e-12  # seconds of work left that count as none
_TIMER = -2  # the rank field of a heap entry that runs a callback of `_Engine.timers`


@dataclass(slots=True)
class Span:
    """One simulated action."""

    rank: int
    iteration: int
    step: int
    action: Action
    start: float
    end: float

    @property
    def label(self) -> str:
        """The action as the runtime labels it: lead 1 when it belongs to the next step."""
        a = self.action
        return str(Action(a.stage, a.kind, a.microbatch, self.step - self.iteration))


#: One simulated action, compactly: (rank, iteration, step, position in the rank's list,
#: start, end). Atoms only, so Python's cyclic collector stops tracking them: a planner
#: holding many simulations does not rescan their spans ([Note: collector] in
#: pipefb.planner.search).
_Record = tuple[int, int, int, int, float, float]


@dataclass
class Simulation:
    """What the simulator predicts for a plan.

    Attributes:
        step_seconds: steady-state time per training step.
        iterations: simulated iterations of the step loop.
        compute_seconds: per rank, compute (F, B, OPT) time per step.
        peak_memory: per rank, the peak of accounted bytes.
        peak_memory_by_kind: per rank, the bytes by kind at that peak.
        roles: per rank, (role, stage) as in the plan's assignment.
        records: every simulated action as a `_Record`; `spans` reads them.
        schedule: the lowered lists the records' positions index.
    """

    step_seconds: float
    iterations: int
    compute_seconds: dict[int, float]
    peak_memory: dict[int, int]
    peak_memory_by_kind: dict[int, dict[str, int]]
    roles: dict[int, tuple[str, int]] = field(default_factory=dict)
    records: list[_Record] = field(default_factory=list, repr=False, compare=False)
    schedule: Schedule = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def spans(self) -> list[Span]:
        """Every simulated action, in order of start (then rank)."""
        return [Span(r, k, step, self.schedule[r][i].base, start, end)
                for r, k, step, i, start, end in sorted(self.records, key=itemgetter(4, 0))]

    @property
    def bubble_fraction(self) -> float:
        """Share of worker time not spent computing, over all workers, in steady state."""
        if not self.compute_seconds or self.step_seconds <= 0:
            return 0.0
        busy = sum(self.compute_seconds.values()) / len(self.compute_seconds)
        return max(0.0, 1.0 - busy / self.step_seconds)

    @property
    def max_peak_memory(self) -> int:
        """The largest per-worker peak."""
        return max(self.peak_memory.values(), default=0)

    def timeline(self, k: int | None = None) -> dict[str, Any]:
        """Iteration `k` (default: the last full one) in the report's timeline format."""
        k = max(0, self.iterations - 2) if k is None else k
        spans = [s for s in self.spans if s.iteration == k]
        t0 = min((s.start for s in spans), default=0.0)
        return {"step": k, "ranks": [
            {"rank": r, "role": role, "stage": stage,
             "spans": [[s.label, s.start - t0, s.end - t0] for s in spans if s.rank == r]}
            for r, (role, stage) in sorted(self.roles.items())]}


class _Costs:
    """Durations and byte counts of each action of a plan (see [Note: cost model])."""

    def __init__(self, plan: Plan, profile: Profile, cluster: Cluster) -> None:
        if profile.n_layers != plan.forward_partition[-1]:
            raise ScheduleError(f"profile has {profile.n_layers} layers, plan "
                                f"{plan.forward_partition[-1]}")
        if len(plan.assignment) > cluster.size:
            raise ScheduleError(f"plan needs {len(plan.assignment)} workers, cluster has "
                                f"{cluster.size}")
        self.plan, self.cluster = plan, group_view(cluster, plan.groups)
        self.links = cluster  # all groups' workers: the all-reduce crosses them
        self.profile = profile.at(plan.microbatch_size)
        self.topology = plan.topology()
        self.runs = recompute_runs(plan)
        self.split = self.topology.is_split
        self._compute: dict[tuple[int, Kind, int], float] = {}
        self._stash: dict[tuple[Kind, int], int] = {}

    def boundary_bytes(self, layer: int) -> int:
        """Bytes of the tensor entering `layer` from the layer before (0 for the data)."""
        return self.profile.layers[layer - 1].output_bytes if layer > 0 else 0

    def kept_bytes(self, layer: int) -> int:
        """What layer `layer` saves per micro-batch for its backward under its policy."""
        return kept_bytes(self.profile.layers[layer], self.plan.policy[layer],
                          self.runs.get(layer) == layer)

    def stashed_layers(self, layers: range) -> list[int]:
        """Layers of a stage whose saved tensors go through the store."""
        return [i for i in layers
                if self.split or self.plan.policy[i] == "offload"]

    def compute(self, rank: int, a: Action) -> float:
        """Seconds of an F, B or OPT on `rank`, overhead excluded; with several groups an
        OPT first sums the stage's gradients across them (a ring all-reduce)."""
        key = (rank, a.kind, a.stage)
        if key not in self._compute:
            seconds = self._compute_seconds(rank, a) / self.cluster.workers[rank].speed
            if a.kind is Kind.OPT and self.plan.groups > 1:
                seconds += self.allreduce_seconds(rank, a.stage)
            self._compute[key] = seconds
        return self._compute[key]

    def allreduce_seconds(self, rank: int, stage: int) -> float:
        """The ring all-reduce of backward stage `stage`'s gradients over the groups, at
        the pace of the ring's slowest hop (`cluster.ring_link`)."""
        owned = self.profile.param_bytes(self.topology.layers_of_backward(stage))
        link = ring_link(self.links, rank, self.plan.groups)
        return ring_allreduce_seconds(owned, self.plan.groups, link)

    def _compute_seconds(self, rank: int, a: Action) -> float:
        t = self.topology
        if a.kind is Kind.F:
            layers = t.layers_of_forward(a.stage)
            return self.profile.forward_seconds(layers) + self.profile.load_seconds(layers)
        if a.kind is Kind.B:
            layers = t.layers_of_backward(a.stage)
            recomputed = [i for i in layers if self.plan.policy[i] == "recompute"]
            return (self.profile.backward_seconds(layers)
                    + self.profile.forward_seconds(recomputed))
        owned = self.profile.param_bytes(t.layers_of_backward(a.stage))
        return self.profile.optimizer_seconds(owned)

    def weight_copy(self, rank: int, stage: int) -> float:
        """Seconds on `rank` to keep a copy of backward stage `stage`'s parameters."""
        owned = self.profile.param_bytes(self.topology.layers_of_backward(stage))
        return self.profile.weight_copy_seconds(owned) / self.cluster.workers[rank].speed

    def stash_bytes(self, a: Action) -> int:
        """Bytes a STASH puts into (a FETCH takes from) the store per micro-batch."""
        key = (a.kind, a.stage)
        if key not in self._stash:
            self._stash[key] = self._stash_bytes(a)
        return self._stash[key]

    def _stash_bytes(self, a: Action) -> int:
        layers = (self.topology.layers_of_forward(a.stage) if a.kind is Kind.STASH
                  else self.topology.layers_of_backward(a.stage))
        return sum(self.kept_bytes(i) for i in self.stashed_layers(layers))

    def send_bytes(self, a: Action) -> int:
        t = self.topology
        if a.kind is Kind.SEND_F:
            return self.boundary_bytes(t.forward_partition[a.stage + 1])
        if a.kind is Kind.SEND_B:
            return self.boundary_bytes(t.backward_partition[a.stage])
        return LOSS_BYTES

    def push_bytes(self, bwd_stage: int, fwd_stage: int) -> int:
        t = self.topology
        layers = set(t.layers_of_backward(bwd_stage)) & set(t.layers_of_forward(fwd_stage))
        return self.profile.param_bytes(sorted(layers))


class _Memory:
    """One rank's accounted bytes by kind, updated per action (see [Note: simulated memory])."""

    def __init__(self, costs: _Costs, rank: int, staleness: int) -> None:
        t = costs.topology
        self.costs, self.staleness = costs, staleness
        self.fwd = _stage_of(t.forward_workers, rank)
        self.bwd = _stage_of(t.backward_workers, rank)
        held = set(t.layers_of_forward(self.fwd) if self.fwd is not None else ())
        owned = t.layers_of_backward(self.bwd) if self.bwd is not None else range(0)
        self.owned_bytes = costs.profile.param_bytes(owned)
        self.combined = self.fwd is not None and self.bwd is not None
        self.now = dict.fromkeys(KINDS, 0)
        self.now["parameters"] = costs.profile.param_bytes(sorted(held | set(owned)))
        self.now["optimizer_state"] = round(costs.profile.optimizer_state_ratio
                                            * self.owned_bytes)
        self.total = sum(self.now.values())  # kept equal to it by `_set` and `apply`
        self.peak, self.at_peak = 0, dict(self.now)
        self.version = 0
        self.forward_versions: dict[tuple[int, int], int] = {}
        self.kept: set[int] = set()
        self._note()

    def deltas(self, a: Action) -> tuple[tuple[str, int], ...]:
        """What running `a` adds to each kind (gradients and versions aside)."""
        c, t = self.costs, self.costs.topology
        out: list[tuple[str, int]] = []
        if a.kind is Kind.RECV_F:
            out.append(("activations", c.boundary_bytes(t.forward_partition[a.stage])))
        elif a.kind is Kind.F:
            layers = t.layers_of_forward(a.stage)
            if a.stage > 0:
                out.append(("activations", -c.boundary_bytes(layers[0])))
            if a.stage < t.n_forward_stages - 1:
                out.append(("activations", c.boundary_bytes(layers[-1] + 1)))
            out.append(("stashed", sum(c.kept_bytes(i) for i in layers)))
        elif a.kind is Kind.SEND_F:
            out.append(("activations", -c.send_bytes(a)))
        elif a.kind in (Kind.STASH, Kind.FETCH):
            out.append(("stashed", c.stash_bytes(a) * (-1 if a.kind is Kind.STASH else 1)))
        elif a.kind is Kind.RECV_B:
            out.append(("activations", c.boundary_bytes(t.backward_partition[a.stage + 1])))
        elif a.kind is Kind.B:
            layers = t.layers_of_backward(a.stage)
            out.append(("stashed", -sum(c.kept_bytes(i) for i in layers)))
            if a.stage < t.n_backward_stages - 1:
                out.append(("activations", -c.boundary_bytes(layers[-1] + 1)))
            if a.stage > 0:
                out.append(("activations", c.boundary_bytes(layers[0])))
        elif a.kind is Kind.SEND_B:
            out.append(("activations", -c.send_bytes(a)))
        return tuple(out)

    def _set(self, kind: str, nbytes: int) -> None:
        self.total += nbytes - self.now[kind]
        self.now[kind] = nbytes

    def _note(self) -> None:
        self._set("weight_versions", len(self.kept) * self.owned_bytes)
        self._peak()

    def _peak(self) -> None:
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.now)

    def apply(self, step: int, op: _Op) -> None:
        """Runs the memory effect of one action of training step `step`."""
        for kind, delta in op.deltas:
            self.now[kind] += delta
            self.total += delta
        a = op.action
        if a.kind is Kind.B:
            self._set("gradients", self.owned_bytes)
            if self.combined:
                self.forward_versions.pop((step, op.microbatch), None)
                self.kept &= set(self.forward_versions.values())
            self._note()
        elif a.kind is Kind.OPT:
            self._optimizer(step)
            self._note()
        else:
            if a.kind is Kind.F and self.combined:
                self.forward_versions[(step, op.microbatch)] = self.version
            self._peak()  # the kept versions change only at a B or an OPT

    def _optimizer(self, step: int) -> None:
        if self.combined:
            needed = set(self.forward_versions.values())
        else:
            lag = self.staleness
            needed = {max(0, s - lag) for s in range(step + 1, step + lag + 1)}
        if self.version in needed:
            self.kept.add(self.version)
        self.version += 1
        self.kept &= needed
        self._set("gradients", 0)


def _stage_of(workers: tuple[int, ...], rank: int) -> int | None:
    return workers.index(rank) if rank in workers else None


def _role(topology: Topology, rank: int) -> tuple[str, int]:
    fwd, bwd = _stage_of(topology.forward_workers, rank), _stage_of(topology.backward_workers,
                                                                      rank)
    if fwd is not None and bwd is not None:
        return "combined", fwd
    return ("forward", fwd) if fwd is not None else ("backward", bwd or 0)


@dataclass(frozen=True, slots=True)
class _Op:
    """One action of a rank's list with everything the event loop needs, computed once.

    Keys number what consumers wait for: one per producing action, and one per
    (PUSH_W stage, destination) pair; `needs` holds (step offset, key) pairs.
    """

    action: Action
    index: int  # position in the rank's list
    microbatch: int
    compute: bool
    seconds: float  # busy time, overhead included (FETCH on combined: before overlap)
    needs: tuple[tuple[int, int], ...]
    key: int  # what this action makes available (-1: nothing)
    sends: tuple[tuple[int, int, int], ...]  # (destination rank, bytes, key) of transfers
    deltas: tuple[tuple[str, int], ...]
    prefetched: bool  # FETCH on a combined rank (overlaps the backward before it)
    tail: float = 0.0  # seconds at the end that run after `sends` left ([Note: early sends])


@dataclass(frozen=True, slots=True)
class _Shape:
    """What every micro-batch's action of one kind and stage on one rank shares, its keys
    by family (see `_Program`)."""

    seconds: float
    deltas: tuple[tuple[str, int], ...]
    needs: tuple[tuple[int, int, bool], ...]  # (step offset, family, per micro-batch)
    sends: tuple[tuple[int, int, int], ...]  # (destination, bytes, family)
    family: int  # of what the action makes available; -1 if it sends instead
    early: tuple[float, int, int, int, int] | None  # [Note: early sends]: a B's weight
    #: halves' seconds, its stashed bytes, and its SEND_B's destination, bytes and family


class _Program:
    """Every rank's list as `_Op`s (see [Note: cost model]).

    A key is `family * width + micro-batch + 1` (+ 0 for per-stage kinds), where a family
    is a (kind, stage) pair, or a (PUSH_W stage, "push", destination) triple: arithmetic
    on the micro-batch, so each (rank, kind, stage) shape is costed once (`_Shape`)."""

    def __init__(self, schedule: Schedule, costs: _Costs, memory: dict[int, _Memory],
                 staleness: int) -> None:
        self.costs, self.topology, self.staleness = costs, costs.topology, staleness
        self.families: dict[tuple[Any, ...], int] = {}
        self.width = 2 + max((a.microbatch for actions in schedule.values() for a in actions
                             if a.microbatch is not None), default=-1)
        self.shapes: dict[tuple[int, Kind, int], _Shape] = {}
        self.needs: dict[tuple[Kind, int], list[tuple[int, Kind, int]]] = {}
        self.runs_weights = {r: _weight_halves_run(costs, r, actions)
                             for r, actions in schedule.items()}
        self.keeps_versions = {r: _keeps_versions(r, actions, costs.topology, staleness)
                               for r, actions in schedule.items()}
        self.ops = {r: [self._op(r, i, a, memory[r]) for i, a in enumerate(actions)]
                    for r, actions in schedule.items()}
        self.index = {r: {a.base: i for i, a in enumerate(actions)}
                      for r, actions in schedule.items()}

    @property
    def n_keys(self) -> int:
        return len(self.families) * self.width

    def family(self, *what: Any) -> int:
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
        shape = (a.kind, a.stage)
        if shape not in self.needs:
            self.needs[shape] = [(offset, need.kind, need.stage) for offset, need
                                 in requirements(a, self.topology, self.staleness)]
        return self.needs[shape]

    def _shape(self, r: int, a: Action, memory: _Memory) -> _Shape:
        c, t = self.costs, self.topology
        seconds = c.cluster.action_overhead
        if a.kind in COMPUTE:
            seconds += c.compute(r, a)
            if a.kind is Kind.OPT and self.keeps_versions[r]:
                seconds += c.weight_copy(r, a.stage)
        elif a.kind in STORE_KINDS:
            seconds += c.cluster.store.seconds(c.stash_bytes(a))
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
        return _Shape(seconds, memory.deltas(a), needs, sends, family, early)

    def _op(self, r: int, i: int, a: Action, memory: _Memory) -> _Op:
        shape = self.shapes.get((r, a.kind, a.stage))
        if shape is None:
            shape = self.shapes[(r, a.kind, a.stage)] = self._shape(r, a, memory)
        width, mb = self.width, a.microbatch if a.microbatch is not None else -1
        needs = tuple([(offset, family * width + (mb + 1 if per_mb else 0))
                       for offset, family, per_mb in shape.needs])
        sends = tuple([(dst, nbytes, family * width + mb + 1)
                       for dst, nbytes, family in shape.sends])
        key = -1 if shape.family < 0 else shape.family * width + mb + 1
        runs = self.runs_weights[r]
        if runs is not None and a.kind is Kind.SEND_B:  # [Note: early sends]: the B sent
            sends, key = (), -1
        elif runs is not None and shape.early is not None:
            return self._early(a, i, mb, shape, needs, runs.get(mb, 0))
        return _Op(a.base, i, mb, a.kind in COMPUTE, shape.seconds, needs, key, sends,
                   shape.deltas, a.kind is Kind.FETCH and self.topology.is_combined)

    def _early(self, a: Action, i: int, mb: int, shape: _Shape,
               needs: tuple[tuple[int, int], ...], halves: int) -> _Op:
        """A B on a rank that sends input grads first ([Note: early sends]): the B sends,
        then runs `halves` micro-batches' weight-grad halves and frees their saved
        tensors; the SEND_B only costs its overhead."""
        assert shape.early is not None
        weights, stashed, dst, nbytes, family = shape.early
        deltas = tuple((k, -halves * stashed if k == "stashed" else d)
                       for k, d in shape.deltas)
        key, sent = (f * self.width + mb + 1 for f in (shape.family, family))
        return _Op(a.base, i, mb, True, shape.seconds + (halves - 1) * weights, needs, key,
                   ((dst, nbytes, sent),), deltas, False, tail=halves * weights)


def _weight_halves_run(costs: _Costs, r: int, actions: list[Action]) -> dict[int, int] | None:
    """For a rank that sends input grads first, how many micro-batches' weight-grad halves
    each B (by micro-batch) runs; None for other ranks. Mirrors the runtime: backward
    stage s > 0 in sync mode lets s wait, its last B of a step runs all that are left."""
    t = costs.topology
    stage = _stage_of(t.backward_workers, r)
    if not stage or costs.plan.mode != "sync":
        return None
    order = [a.microbatch for a in actions if a.kind is Kind.B]
    runs = {m: 1 if k >= stage else 0 for k, m in enumerate(order) if m is not None}
    if order and order[-1] is not None:
        runs[order[-1]] = min(len(order) - 1, stage) + 1
    return runs


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
    if a.kind is Kind.SEND_F:
        return t.forward_workers[a.stage + 1]
    if a.kind is Kind.SEND_B:
        return t.backward_workers[a.stage - 1]
    return t.backward_workers[-1]


def _nothing(end: float) -> None:
    """The end of a job nothing waits for (the other end's share of a transfer)."""


@dataclass(slots=True)
class _Job:
    """Work left on a shared host (seconds at full speed) and what to do when it ends."""

    work: float
    on_finish: Callable[[float], None]


class _Host:
    """Processor sharing on a host's cores: each of its n running jobs (one thread each)
    progresses at min(1, cores / n) seconds of work per second, times the speed left to
    oversubscribed cores ([Note: oversubscribed cores])."""

    def __init__(self, cores: int, oversubscribed: float = 1.0) -> None:
        self.cores, self.oversubscribed = cores, oversubscribed
        self.jobs: list[_Job] = []
        self.clock = 0.0
        self.version = 0  # bumped when the running set changes: older finish events are void

    def rate(self) -> float:
        n = len(self.jobs)
        if n <= self.cores:
            return 1.0
        lost = (1.0 - self.oversubscribed) * (n - self.cores) / self.cores
        return self.cores / n * max(MIN_OVERSUBSCRIBED, 1.0 - lost)

    def advance(self, t: float) -> None:
        """Runs the jobs until `t`."""
        if t > self.clock and self.jobs:
            done = (t - self.clock) * self.rate()
            for job in self.jobs:
                job.work -= done
        self.clock = max(self.clock, t)

    def next_finish(self) -> float:
        return self.clock + min(job.work for job in self.jobs) / self.rate()

    def finished(self) -> list[Callable[[float], None]]:
        """Removes and returns the callbacks of the jobs with no work left."""
        done = [job for job in self.jobs if job.work <= _EPSILON]
        self.jobs = [job for job in self.jobs if job.work > _EPSILON]
        return [job.on_finish for job in done]


class _Engine:
    """The event loop: each rank runs its unrolled list; an action starts when the rank is
    free and its inputs have arrived (see [Note: shared hosts])."""

    def __init__(self, plan: Plan, costs: _Costs, schedule: Schedule, iterations: int
                 ) -> None:
        self.plan, self.costs, self.cluster = plan, costs, costs.cluster
        self.memory = {r: _Memory(costs, r, plan.staleness) for r in schedule}
        self.program = _Program(schedule, costs, self.memory, plan.staleness)
        index = self.program.index
        self.runs = {r: [(k, step, index[r][a]) for k in range(iterations)
                         for step, a in iteration(actions, k, iterations)]
                     for r, actions in schedule.items()}
        self.stride = max(1, self.program.n_keys)
        self.pos = dict.fromkeys(self.runs, 0)
        self.free = dict.fromkeys(self.runs, 0.0)
        self.reached = dict.fromkeys(self.runs, 0.0)  # when the rank got to its next action
        self.avail: dict[int, float] = {}  # step * stride + key -> when consumers may use it
        self.links: dict[tuple[int, int], float] = defaultdict(float)
        self.link_of: dict[tuple[int, int], Link] = {}
        self.host = {r: self.cluster.cores_of(r) for r in self.runs}
        self.hosts = {name: _Host(n, self.cluster.oversubscribed_of(name))
                      for name, n in self.host.values()}
        self.waiting: dict[int, list[int]] = defaultdict(list)
        # [Note: flush]: a rank's transfers still on their way, and when the last left
        self.sending: dict[int, int] = defaultdict(int)
        self.flushed: dict[int, float] = defaultdict(float)
        self.flushing: set[int] = set()  # ranks whose next step waits for those transfers
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.timers: dict[int, Callable[[float], None]] = {}  # by heap sequence number
        self.records: list[_Record] = []
        self.last_b: dict[int, float] = {}
        self.seq = 0

    def shared(self) -> bool:
        """Whether some host has fewer cores than ranks, or moves bytes on its cores."""
        on: dict[str, int] = defaultdict(int)
        for name, _ in self.host.values():
            on[name] += 1
        return any(on[name] > host.cores or name in self.cluster.loopback_hosts
                   for name, host in self.hosts.items())

    def run(self) -> None:
        if self.shared():
            self._run_in_time_order()
        else:
            self._run_greedy()
        stuck = {r: self.runs[r][p] for r, p in self.pos.items() if p < len(self.runs[r])}
        if stuck:
            raise self._deadlock(stuck)

    def _run_greedy(self) -> None:
        """Without shared hosts, each rank's actions only wait for their inputs, and links
        carry one sender's transfers in that sender's order: every rank may run ahead as
        far as its inputs allow, in any order, and the times come out the same."""
        ops, runs = self.program.ops, self.runs
        ready_ranks = list(self.runs)
        while ready_ranks:
            r = ready_ranks.pop()
            run, rank_ops = runs[r], ops[r]
            while self.pos[r] < len(run):
                p = self.pos[r]
                k, step, i = run[p]
                op = rank_ops[i]
                missing, ready = self._missing(step, op)
                if missing >= 0:
                    self.waiting[missing].append(r)
                    break
                start = max(self._reach(r, p == 0 or run[p - 1][0] != k), ready)
                ready_ranks += self._execute(r, k, step, op, start, schedule=False)

    def _run_in_time_order(self) -> None:
        """Events in time order: a rank's next action may start, or a host's job ends."""
        for r in self.runs:
            self._schedule(r)
        ops = self.program.ops
        while self.heap:
            t, seq, r, name, version = heapq.heappop(self.heap)
            if r == _TIMER:
                self.timers.pop(seq)(t)
                continue
            if r < 0:
                host = self.hosts[name]
                if version == host.version:
                    host.advance(t)
                    for on_finish in host.finished():
                        on_finish(t)
                    self._host_changed(name)
                continue
            p = self.pos[r]
            k, step, i = self.runs[r][p]
            op = ops[r][i]
            if p == 0 or self.runs[r][p - 1][0] != k:
                self._step_calls(r, t)
            if op.prefetched:  # runs beside the backward: see _execute
                self._execute(r, k, step, op, t)
                continue
            self.free[r] = math.inf  # busy until the job ends
            if op.tail:  # [Note: early sends]: sends, then the rest as a second job
                self._start_job(self.host[r][0], t, op.seconds - op.tail,
                                self._sender(r, k, step, op, t))
            else:
                self._start_job(self.host[r][0], t, op.seconds,
                                self._finisher(r, k, step, op, t))
            if op.action.kind in STORE_KINDS:
                self._store_side(r, t, op.seconds - self.cluster.action_overhead)

    def _finisher(self, r: int, k: int, step: int, op: _Op, start: float
                  ) -> Callable[[float], None]:
        def on_finish(end: float) -> None:
            self._finish(r, k, step, op, start, end)
        return on_finish

    def _sender(self, r: int, k: int, step: int, op: _Op, start: float
                ) -> Callable[[float], None]:
        def on_sent(at: float) -> None:
            for waiter in self._send(r, step, op, at):
                self._schedule(waiter)

            def on_finish(end: float) -> None:
                self._finish(r, k, step, op, start, end, sent=True)
            self._start_job(self.host[r][0], at, op.tail, on_finish)
        return on_sent

    def _start_job(self, name: str, t: float, work: float,
                   on_finish: Callable[[float], None]) -> None:
        host = self.hosts[name]
        host.advance(t)
        host.jobs.append(_Job(work, on_finish))
        self._host_changed(name)

    def _host_changed(self, name: str) -> None:
        host = self.hosts[name]
        host.version += 1
        if host.jobs:
            self.seq += 1
            heapq.heappush(self.heap, (host.next_finish(), self.seq, -1, name, host.version))

    def _step_calls(self, r: int, t: float) -> None:
        """The CPU of rank `r`'s Step call on a loopback host, beside its first action
        ([Note: step calls])."""
        name = self.host[r][0]
        if self.cluster.step_cpu > 0 and name in self.cluster.loopback_hosts:
            self._start_job(name, t, self.cluster.step_cpu, _nothing)

    def _store_side(self, r: int, t: float, seconds: float) -> None:
        """The local Redis's share of a STASH or FETCH on a loopback host."""
        name = self.host[r][0]
        if name in self.cluster.loopback_hosts:
            self._other_end(name, t, self.cluster.store, seconds)

    def _other_end(self, name: str, t: float, link: Link, seconds: float) -> None:
        """Beside a transfer of `seconds` on host `name`, a job of (link.cpu - 1) times that
        work: the other end's share of the cores ([Note: shared hosts])."""
        if link.cpu > 1.0:
            self._start_job(name, t, (link.cpu - 1.0) * max(0.0, seconds), _nothing)

    def _push(self, t: float, r: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, r, "", 0))

    def _after(self, t: float, callback: Callable[[float], None]) -> None:
        """Runs `callback(t)` at time `t`."""
        self.seq += 1
        self.timers[self.seq] = callback
        heapq.heappush(self.heap, (t, self.seq, _TIMER, "", 0))

    def _busy_send(self, r: int, op: _Op) -> float:
        """How much later rank `r`'s transfers from `op` start on a loopback host: the
        compute right after them holds the sender's Python lock ([Note: busy senders])."""
        if self.cluster.busy_send <= 0:
            return 0.0
        if op.tail:  # an early send: the B's weight halves follow
            return min(self.cluster.busy_send, op.tail)
        run, ops, p = self.runs[r], self.program.ops[r], self.pos[r] + 1
        while p < len(run) and ops[run[p][2]].action.kind in SENDS:
            p += 1  # further sends only queue their bytes
        if p == len(run) or run[p][0] != run[self.pos[r]][0]:
            return 0.0  # the step ends: its flush waits, the lock free, until they left
        after = ops[run[p][2]]
        return min(self.cluster.busy_send, after.seconds) if after.action.kind in COMPUTE else 0.0

    def _missing(self, step: int, op: _Op) -> tuple[int, float]:
        """The first awaited key not yet available (-1: none) and when all are."""
        ready = 0.0
        for offset, key in op.needs:
            at = step + offset
            if at < 0:
                continue
            when = self.avail.get(at * self.stride + key)
            if when is None:
                return at * self.stride + key, 0.0
            ready = max(ready, when)
        return -1, ready

    def _schedule(self, r: int) -> None:
        p = self.pos[r]
        if p >= len(self.runs[r]):
            return
        k, step, i = self.runs[r][p]
        missing, ready = self._missing(step, self.program.ops[r][i])
        if missing >= 0:
            self.waiting[missing].append(r)
            return
        first = p == 0 or self.runs[r][p - 1][0] != k
        if first and self.sending[r]:
            self.flushing.add(r)  # the step's flush: the last arrival schedules it again
            return
        self._push(max(self._reach(r, first), ready), r)

    def _reach(self, r: int, first: bool) -> float:
        """When rank `r` gets to its next action: when it is free, or, for an iteration's
        first, its step overhead after its transfers have left ([Note: flush])."""
        free = self.free[r]
        self.reached[r] = (max(free, self.flushed[r]) + self.cluster.step_overhead if first
                           else free)
        return self.reached[r]

    def _execute(self, r: int, k: int, step: int, op: _Op, start: float,
                 schedule: bool = True) -> list[int]:
        """Runs one action on a host of its own; schedules the ranks it wakes, or returns
        them."""
        seconds = op.seconds
        if op.prefetched:
            overhead = self.cluster.action_overhead
            seconds = overhead + max(0.0, seconds - overhead - self.last_b.get(r, 0.0))
        return self._finish(r, k, step, op, start, start + seconds, schedule)

    def _finish(self, r: int, k: int, step: int, op: _Op, start: float, end: float,
                schedule: bool = True, sent: bool = False) -> list[int]:
        """Ends one action: its span (from when the rank reached it: a receive's span holds
        its wait, as the runtime times it), memory, transfers (unless `sent` already) and
        what it makes available."""
        if op.action.kind is Kind.B:
            self.last_b[r] = end - start
        self.free[r] = end
        self.records.append((r, k, step, op.index, min(self.reached[r], start), end))
        self.memory[r].apply(step, op)
        base = step * self.stride
        woken = self._send(r, step, op, end - op.tail) if op.sends and not sent else []
        if op.key >= 0:
            self.avail[base + op.key] = end
            woken += self.waiting.pop(base + op.key, [])
        self.pos[r] += 1
        if not schedule:
            return woken
        self._schedule(r)
        for waiter in woken:
            self._schedule(waiter)
        return []

    def _send(self, r: int, step: int, op: _Op, at: float) -> list[int]:
        """Starts the action's transfers at `at`; returns the ranks their arrival wakes."""
        base = step * self.stride
        woken: list[int] = []
        wait = self._busy_send(r, op) if op.sends else 0.0
        for dst, nbytes, key in op.sends:
            if self.cluster.on_loopback(r, dst):
                self._loopback_transfer(r, dst, nbytes, base + key, at, wait)
                continue
            self.avail[base + key] = self._transfer(r, dst, nbytes, at)
            self.flushed[r] = max(self.flushed[r], self.links[(r, dst)])  # last byte sent
            woken += self.waiting.pop(base + key, [])
        return woken

    def _transfer(self, src: int, dst: int, nbytes: int, sent: float) -> float:
        """Arrival time of `nbytes` sent at `sent` over the src->dst link (FIFO)."""
        link = self._link(src, dst)
        begin = max(sent, self.links[(src, dst)])
        self.links[(src, dst)] = begin + nbytes / link.bandwidth
        return begin + link.seconds(nbytes)

    def _link(self, src: int, dst: int) -> Link:
        link = self.link_of.get((src, dst))
        if link is None:
            link = self.link_of[(src, dst)] = self.cluster.link(src, dst)
        return link

    def _loopback_transfer(self, src: int, dst: int, nbytes: int, slot: int, sent: float,
                           wait: float = 0.0) -> None:
        """Bytes between ranks of a loopback host: CPU work on the host's cores, the
        link's latency plus the bytes over its bandwidth (see [Note: shared hosts]),
        starting `wait` after `sent` ([Note: busy senders])."""
        def arrived(end: float) -> None:
            self.avail[slot] = end
            self.sending[src] -= 1
            self.flushed[src] = max(self.flushed[src], end)
            for waiter in self.waiting.pop(slot, []):
                self._schedule(waiter)
            if not self.sending[src] and src in self.flushing:
                self.flushing.discard(src)
                self._schedule(src)

        def start(at: float) -> None:
            link, name = self._link(src, dst), self.host[src][0]
            self._start_job(name, at, link.seconds(nbytes), arrived)
            self._other_end(name, at, link, link.seconds(nbytes))

        self.sending[src] += 1
        if wait > 0:
            self._after(sent + wait, start)
        else:
            start(sent)

    def _deadlock(self, stuck: dict[int, tuple[int, int, int]]) -> ScheduleError:
        lines = ["deadlock in simulation: no worker can progress"]
        for r, (_, step, i) in sorted(stuck.items()):
            op = self.program.ops[r][i]
            missing, _ = self._missing(step, op)
            at, key = divmod(missing, self.stride)
            what = self.program.name(key)
            label = (f"PUSH_W of backward stage {what[0]}" if what[1] == "push"
                     else str(Action(what[1], what[0], what[2])))
            lines.append(f"  worker {r}, step {step}: {op.action} waits for {label} of "
                         f"step {at}")
        return ScheduleError("\n".join(lines))


def simulate(plan: Plan, profile: Profile, cluster: Cluster, iterations: int = 0, *,
             schedule: Schedule | None = None, check: bool = True) -> Simulation:
    """Simulates `iterations` iterations of the plan's step loop (see [Note: cost model]).

    Args:
        plan: the plan; rank r runs on `cluster.workers[r]`.
        profile: layer costs (rescaled to the plan's micro-batch size).
        cluster: the workers, links, store and overheads.
        iterations: iterations to run; 0 picks enough to reach the steady state (2 for
            sync plans, 4 + staleness for async ones, one more when forwards lead).
        schedule: a lowered schedule to run instead of the plan's own (not validated).
        check: validate the plan's schedule (with its dry run) first; the planner skips
            it for speed, since the simulation itself finds deadlocks.

    Returns:
        The prediction; `step_seconds` is the median gap between the ends of consecutive
        iterations, leaving out the first when async and the last when forwards lead.

    Raises:
        ScheduleError: the plan fails validation, does not fit the profile or cluster, or
            deadlocks (the message names each stuck worker and what it waits for).
    """
    costs = _Costs(plan, profile, cluster)
    if schedule is None:
        schedule = schedule_for(plan) if check else lowered_schedule(plan)
    if plan.groups > 1:  # [Note: groups]: every group runs the same program; simulate one
        schedule = {r: schedule[r] for r in plan.group_ranks()[0] if r in schedule}
    leads = any(a.lead for actions in schedule.values() for a in actions)
    n = iterations or (2 if plan.mode == "sync" and not leads
                       else 4 + plan.staleness + leads)
    engine = _Engine(plan, costs, schedule, n)
    engine.run()
    ends = [0.0] * n
    for _, k, _, _, _, end in engine.records:
        ends[k] = max(ends[k], end)
    steady = ends[1:-1] if leads and n > 3 else ends[1:] if plan.mode == "async" else ends
    gaps = [b - a for a, b in pairwise(steady)] or [ends[-1] / n]
    step_seconds = statistics.median(gaps)
    compute: dict[int, float] = defaultdict(float)
    last = max(0, n - 2)
    ops = engine.program.ops
    for r, k, _, i, start, end in engine.records:
        if k == last and ops[r][i].compute:
            compute[r] += end - start
    return Simulation(
        step_seconds=step_seconds, iterations=n, records=engine.records, schedule=schedule,
        compute_seconds={r: compute.get(r, 0.0) for r in engine.runs},
        peak_memory={r: m.peak for r, m in engine.memory.items()},
        peak_memory_by_kind={r: m.at_peak for r, m in engine.memory.items()},
        roles={r: _role(costs.topology, r) for r in engine.runs})


__all__ = ["Simulation", "Span", "simulate"]
