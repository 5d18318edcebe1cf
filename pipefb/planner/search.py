"""The planner: picks schedule kind, micro-batch count, roles, partitions and per-layer
activation policy for a cluster, by simulated step time under each worker's memory cap.

A pure function of a layer profile and a cluster description (`search`); it returns the
best plan, the runners-up and why each lost.

[Note: search]
For every schedule kind the job's mode allows, every micro-batch count (divisors of the
batch size), and for PipeFB every split of the workers into forward and backward roles:
1. partition: `plan.partitions` balances each pass's per-layer time (at the profile's
   micro-batch size, one table for every stage count) over its workers' speeds (forward
   + backward on combined kinds; PipeFB's forward stages by forward time plus the stash
   put, its backward stages by backward time plus the fetch), each stage also paying the
   bytes that cross its two boundaries over the pass's slowest link (`cut_seconds`: the
   activation forward, its gradient backward, both on combined kinds), so a cut avoids a
   layer with a large output (a head's logits) when a cheaper one balances as well;
2. policy: combined kinds keep everything; PipeFB offloads each layer unless re-running
   its forward is cheaper than moving its saved tensors through the store; while a worker's
   simulated peak exceeds its cap, its layers switch to offload or recompute, whichever
   frees more bytes per second of extra time, the partition is re-balanced, and the plan
   simulated again;
3. an analytic estimate ranks the candidates; the best ones are simulated (as many as an
   event budget allows, and at least the best of each schedule kind: the estimate ignores
   the caps, so a kind's best estimate may lose most to fitting its memory);
4. the `FINALISTS` fastest simulated candidates have their stage boundaries moved one
   layer at a time while the simulated step time improves, and the fastest refined plan
   wins; refined plans within `TIE` of it count as equally fast, and the one with the
   lowest peak memory among them wins (the highest rank's peak, then the sum of all).
   The simulator does not price a larger footprint (allocation, caches): on this
   machine a 4-worker `gpt` ran 15% slower under GPipe, with several times 1F1B's peak,
   while the two simulated within 1-3% of each other, an order profile noise flips.
A candidate whose simulation deadlocks, or which cannot fit a cap, is refused with the
reason.

Cost: partitions are O(k n^2) each with boundary costs (n layers, k stages; one n x n
tensor operation per stage count, about 15 ms for 200 layers on 64 stages) and cached per
(pass, stage speeds, boundary costs); 200 layers on 64 workers plan in about 1 second,
nearly all of it simulation (see [Note: collector]).

[Note: collector]
A search allocates a few hundred thousand small objects (simulated actions, the lowered
lists its simulations keep), and each of CPython's full collections rescans every object
of the process: with torch imported, about 170k before a search starts. On 200 layers and
64 workers the full collections took 0.17-0.25 s of 1.2 s, so `search` pauses the cyclic
collector while it runs (reference counting still frees everything at once); the last of
searches running at once in several threads restores it as the first found it. The
simulator's spans are atoms-only tuples (`simulate._Record`) for the same reason: the
collector stops tracking them.
"""

from __future__ import annotations

import gc
import itertools
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from pipefb.errors import ConfigError, ScheduleError
from pipefb.plan.partition import partitions
from pipefb.plan.plan import Plan, WorkerAssignment, recompute_runs
from pipefb.schedule import KINDS, Topology, schedule_kind
from pipefb.sim.cluster import Cluster, Link, slowest_hop
from pipefb.sim.costs import Profile, kept_bytes
from pipefb.sim.simulate import Simulation, simulate

MEMORY_MARGIN = 0.9  # plans use at most this share of a cap: the model is not exact
FINALISTS = 3  # the fastest simulated candidates whose stage boundaries are refined
TIE = 0.01  # simulated step times this close are equal: the lower peak memory wins
EVENT_BUDGET = 30_000  # simulated actions the search may spend on ranking candidates
MAX_MICROBATCH_CHOICES = 6


@dataclass(frozen=True)
class Candidate:
    """One plan the search considered, with its simulated outcome."""

    plan: Plan
    step_seconds: float  # simulated; inf when refused or not simulated
    estimate_seconds: float  # the analytic estimate that ranked it
    peak_memory: dict[int, int] = field(default_factory=dict)  # by rank, simulated
    bubble_fraction: float = 0.0
    note: str = ""  # why it lost or was refused ("" for the best)

    @property
    def label(self) -> str:
        """e.g. `pipefb 2F+2B x8` or `1f1b x4`."""
        p = self.plan
        kind = schedule_kind(p.schedule)
        roles = (f" {len(p.forward_partition) - 1}F+{len(p.backward_partition) - 1}B"
                 if kind.split else "")
        mode = (f" {p.mode}" + (f" S={p.staleness}" if p.mode == "async" else "")
                if len(kind.modes) > 1 else "")
        return f"{p.schedule}{mode}{roles} x{p.microbatches}"

    def row(self) -> dict[str, Any]:
        """The candidate as one JSON-able table row."""
        return {"candidate": self.label, "step_seconds": self.step_seconds,
                "estimate_seconds": self.estimate_seconds,
                "peak_memory_bytes": max(self.peak_memory.values(), default=0),
                "bubble_fraction": self.bubble_fraction, "note": self.note,
                "forward_partition": list(self.plan.forward_partition),
                "backward_partition": list(self.plan.backward_partition),
                "policy": _policy_summary(self.plan.policy)}


@dataclass(frozen=True)
class PlanSearch:
    """The planner's answer: the best plan, its simulation, and every candidate."""

    best: Candidate
    simulation: Simulation
    candidates: tuple[Candidate, ...]  # best first, then by simulated, then estimated time
    simulated_actions: int = 0  # the work the search did: actions it simulated in all

    @property
    def plan(self) -> Plan:
        """The chosen plan, with its predicted step time."""
        return self.best.plan


@dataclass(frozen=True)
class _Space:
    profile: Profile  # at the job's micro-batch size
    cluster: Cluster
    batch_size: int
    staleness: int


def microbatch_choices(batch_size: int, workers: int, limit: int = MAX_MICROBATCH_CHOICES
                       ) -> list[int]:
    """Divisors of the batch size up to 4x the workers, at most `limit`, spread out."""
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    useful = [d for d in divisors if d <= max(4 * workers, 1)] or [1]
    if len(useful) <= limit:
        return useful
    step = (len(useful) - 1) / (limit - 1)
    return sorted({useful[round(i * step)] for i in range(limit)})


def _kinds(schedules: Sequence[str], mode: str) -> list[tuple[str, str]]:
    out = []
    for kind in schedules:
        if kind not in KINDS:
            raise ConfigError(f"unknown schedule {kind!r}; the planner knows {KINDS}")
        if mode in schedule_kind(kind).modes:
            out.append((kind, mode))
    if not out:
        raise ConfigError(f"no schedule among {list(schedules)} runs in mode {mode!r}")
    return out


def _splits(workers: int, profile: Profile) -> list[int]:
    """Forward worker counts to try for a split kind (PipeFB): all for small clusters,
    else around the forward share of the work."""
    if workers < 2:
        return []
    if workers <= 8:
        return list(range(1, workers))
    fwd = sum(x.forward_seconds for x in profile.layers)
    total = fwd + sum(x.backward_seconds for x in profile.layers)
    centre = round(workers * fwd / total) if total > 0 else workers // 2
    return sorted({min(workers - 1, max(1, centre + d)) for d in range(-2, 3)})


class _Planner:
    """One search; caches partitions (per pass and stage speeds) and simulations."""

    def __init__(self, space: _Space) -> None:
        self.space = space
        self.partitions: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}
        self.sims: dict[Plan, Simulation | ScheduleError] = {}
        self.estimates: dict[Plan, float] = {}
        self.events = 0

    # -- building candidates ---------------------------------------------------------------

    def layer_times(self, which: str, policy: Sequence[str], microbatch: int) -> list[float]:
        """`pass_times` of this search's profile at `microbatch` samples and its store."""
        return pass_times(self.space.profile.at(microbatch), self.space.cluster.store,
                          policy, which)

    def split_partition(self, times: list[float], ranks: Sequence[int], which: str
                        ) -> tuple[int, ...]:
        """Balanced stages of `times`, and of the `which` pass's boundary transfers, over
        the workers `ranks`; one dynamic program serves every stage count when the workers
        are equally fast."""
        speeds = [self.space.cluster.workers[r].speed for r in ranks]
        cuts = self.cut_seconds(which, ranks)
        uniform = len(set(speeds)) == 1
        key = (tuple(times), tuple(cuts), speeds[0] if uniform else tuple(speeds))
        if key not in self.partitions:
            n = min(len(times), self.space.cluster.size) if uniform else len(speeds)
            self.partitions[key] = partitions(times, n, speeds[:1] * n if uniform else speeds,
                                              cuts)
        return self.partitions[key][len(ranks) - 1]

    def cut_seconds(self, which: str, ranks: Sequence[int]) -> list[float]:
        """Per boundary before layer c (c = 0..n), the seconds a stage next to it spends per
        micro-batch (at the profile's size) moving what crosses it over the slowest link
        between consecutive `ranks`: the activation in the forward pass, its gradient in
        the backward, both on combined kinds; nothing crosses the model's ends."""
        per = 2 if which == "combined" else 1
        bandwidth = self.bandwidth(ranks)
        layers = self.space.profile.layers
        return [0.0, *(per * x.output_bytes / bandwidth for x in layers[:-1]), 0.0]

    def bandwidth(self, ranks: Sequence[int]) -> float:
        """Bytes per second of the slowest link between consecutive `ranks` (inf: one)."""
        return slowest_hop(self.space.cluster, itertools.pairwise(ranks)).bandwidth

    def build(self, kind: str, mode: str, microbatches: int, n_fwd: int,
              policy: Sequence[str]) -> Plan:
        """A plan of `kind` with balanced partitions for the given policy (`n_fwd` forward
        workers when the kind splits the passes)."""
        n = self.space.cluster.size
        mb = self.space.batch_size // microbatches
        ref = self.space.profile.microbatch_size  # one partition table for every count
        spec = schedule_kind(kind)
        if spec.split:
            fwd_ranks, bwd_ranks = range(n_fwd), range(n_fwd, n)
            fwd = self.split_partition(self.layer_times("forward", policy, ref), fwd_ranks,
                                       "forward")
            bwd = self.split_partition(self.layer_times("backward", policy, ref), bwd_ranks,
                                       "backward")
            assignment = tuple(WorkerAssignment(r, "forward", r) for r in fwd_ranks) + tuple(
                WorkerAssignment(r, "backward", s) for s, r in enumerate(bwd_ranks))
        else:
            fwd = bwd = self.split_partition(self.layer_times("combined", policy, ref), range(n),
                                             "combined")
            assignment = tuple(WorkerAssignment(r, "combined", r) for r in range(n))
        return Plan(schedule=kind, microbatches=microbatches, microbatch_size=mb,
                    forward_partition=fwd, backward_partition=bwd, policy=tuple(policy),
                    assignment=assignment, mode=mode,
                    staleness=spec.plan_staleness(mode, self.space.staleness))

    def initial_policy(self, kind: str, microbatches: int) -> list[str]:
        """keep where the kind allows it (combined kinds: nothing moves); else (PipeFB)
        offload, or recompute where re-running the forward is cheaper than moving what it
        frees through the store (alone, joining the run before it, or starting a run with
        the layer before: a loss whose saved tensor is its input is only worth recomputing
        together with the head that makes it)."""
        if schedule_kind(kind).keep_allowed:
            return ["keep"] * self.space.profile.n_layers
        layers = self.space.profile.at(self.space.batch_size // microbatches).layers
        bandwidth = self.space.cluster.store.bandwidth
        out: list[str] = []
        for i, x in enumerate(layers):
            joins = bool(out) and out[-1] == "recompute"
            if x.forward_seconds < (x.saved_bytes - kept_bytes(x, "recompute", not joins)
                                    ) / bandwidth:
                out.append("recompute")
                continue
            prev = layers[i - 1] if i else None
            if prev is not None and out[-1] == "offload" and (
                    prev.forward_seconds + x.forward_seconds
                    < (prev.saved_bytes - prev.input_bytes + x.saved_bytes) / bandwidth):
                out[-1] = "recompute"
                out.append("recompute")
                continue
            out.append("offload")
        return out

    # -- simulating -------------------------------------------------------------------------

    def simulate(self, plan: Plan) -> Simulation | ScheduleError:
        if plan not in self.sims:
            self.events += _events(plan)
            try:
                self.sims[plan] = simulate(plan, self.space.profile, self.space.cluster,
                                           check=False)
            except ScheduleError as error:
                self.sims[plan] = error
        return self.sims[plan]

    def over_cap(self, sim: Simulation) -> dict[int, int]:
        """rank -> bytes over MEMORY_MARGIN x its cap."""
        out = {}
        for r, peak in sim.peak_memory.items():
            cap = self.space.cluster.workers[r].memory * MEMORY_MARGIN
            if peak > cap:
                out[r] = int(peak - cap) if math.isfinite(cap) else 0
        return out

    def fit(self, plan: Plan) -> tuple[Plan, Simulation | None, str]:
        """Switches policies until every worker fits its cap (see [Note: search], step 2)."""
        for _ in range(4 * plan.forward_partition[-1]):
            sim = self.simulate(plan)
            if isinstance(sim, ScheduleError):
                return plan, None, f"refused: {str(sim).splitlines()[0]}"
            over = self.over_cap(sim)
            if not over:
                return plan, sim, ""
            policy = self.relieve(plan, over)
            if policy is None:
                r, excess = max(over.items(), key=lambda kv: kv[1])
                cap = self.space.cluster.workers[r].memory
                return plan, sim, (f"refused: worker {r} needs {_gb(sim.peak_memory[r])} even "
                                   f"with offload/recompute, {_gb(excess)} over "
                                   f"{MEMORY_MARGIN:.0%} of its cap ({_gb(cap)})")
            n_fwd = len(plan.forward_partition) - 1
            plan = self.build(plan.schedule, plan.mode, plan.microbatches, n_fwd, policy)
        return plan, None, "refused: memory plan did not converge"

    def relieve(self, plan: Plan, over: dict[int, int]) -> list[str] | None:
        """The policy with one more change per over-cap worker: a kept layer offloaded, or
        a layer recomputed (alone or with the layer before it, as one run), whichever frees
        the most bytes per second of extra time; None if no change frees anything."""
        prof = self.space.profile.at(plan.microbatch_size)
        store = self.space.cluster.store
        policy, changed = list(plan.policy), False
        topology = plan.topology()
        for r in over:
            layers = _layers_of_rank(topology, r)
            held = _held_bytes(plan, policy, layers, prof)
            options: list[tuple[float, tuple[int, ...], str]] = []
            for i in layers:
                x = prof.layers[i]
                if policy[i] == "keep" and x.saved_bytes > 0:
                    options.append((x.saved_bytes / max(2 * store.seconds(x.saved_bytes), 1e-12),
                                    (i,), "offload"))
                for run in ((i,), (i - 1, i)):
                    if run[0] not in layers or all(policy[j] == "recompute" for j in run):
                        continue
                    trial = [("recompute" if j in run else p) for j, p in enumerate(policy)]
                    freed = held - _held_bytes(plan, trial, layers, prof)
                    extra = sum(prof.layers[j].forward_seconds for j in run
                                if policy[j] != "recompute")
                    if freed > 0:
                        options.append((freed / max(extra, 1e-12), run, "recompute"))
            if options:
                _, best, new = max(options)
                for j in best:
                    policy[j] = new
                changed = True
        return policy if changed else None

    # -- the search -------------------------------------------------------------------------

    def estimate(self, plan: Plan) -> float:
        """Analytic step time: fill and drain plus the bottleneck per micro-batch."""
        if plan not in self.estimates:
            self.estimates[plan] = self._estimate(plan)
        return self.estimates[plan]

    def _estimate(self, plan: Plan) -> float:
        prof = self.space.profile.at(plan.microbatch_size)
        c, t = self.space.cluster, plan.topology()
        speed = [w.speed for w in c.workers]
        policy = plan.policy

        fwd_link = self.bandwidth(t.forward_workers)
        bwd_link = self.bandwidth(t.backward_workers)

        def f_time(s: int) -> float:
            layers = t.layers_of_forward(s)
            moved = sum(kept_bytes(prof.layers[i], policy[i]) for i in layers)
            store = c.store.seconds(moved) if t.is_split else 0.0
            return ((prof.forward_seconds(layers) + store) / speed[t.forward_workers[s]]
                    + _boundary_bytes(prof, layers) / fwd_link)

        def b_time(s: int) -> float:
            layers = t.layers_of_backward(s)
            rec = [i for i in layers if policy[i] == "recompute"]
            moved = sum(kept_bytes(prof.layers[i], policy[i]) for i in layers)
            store = c.store.seconds(moved) if t.is_split or "offload" in policy else 0.0
            return ((prof.backward_seconds(layers) + prof.forward_seconds(rec) + store
                     ) / speed[t.backward_workers[s]]
                    + _boundary_bytes(prof, layers) / bwd_link)

        fs = [f_time(s) for s in range(t.n_forward_stages)]
        bs = [b_time(s) for s in range(t.n_backward_stages)]
        hop = c.network.latency + 2 * c.action_overhead
        m = plan.microbatches
        if t.is_split:
            bottleneck = max(max(fs), max(bs))
            fill = sum(fs) + sum(bs) + (len(fs) + len(bs)) * hop
        else:
            bottleneck = max(f + b for f, b in zip(fs, bs, strict=True))
            fill = sum(fs) + sum(bs) + 2 * len(fs) * hop
        if plan.mode == "async":
            return m * bottleneck + c.step_overhead
        return (m - 1) * bottleneck + fill + c.step_overhead

    def candidates(self, kinds: list[tuple[str, str]], microbatches: Sequence[int]
                   ) -> list[Plan]:
        n = self.space.cluster.size
        out = []
        for kind, mode in kinds:
            splits = _splits(n, self.space.profile) if schedule_kind(kind).split else [n]
            for m in microbatches:
                policy = self.initial_policy(kind, m)
                for n_fwd in splits:
                    out.append(self.build(kind, mode, m, n_fwd, policy))
        return out

    def refine(self, plan: Plan, sim: Simulation) -> tuple[Plan, Simulation]:
        """Moves stage boundaries one layer at a time while the simulated time improves
        and every cap holds (see [Note: search], step 3)."""
        improved = True
        while improved:
            improved = False
            for moved in _neighbours(plan):
                if self.events + _events(moved) > 2 * EVENT_BUDGET and moved not in self.sims:
                    return plan, sim
                trial = self.simulate(moved)
                if isinstance(trial, ScheduleError) or self.over_cap(trial):
                    continue
                if trial.step_seconds < sim.step_seconds * (1 - 1e-9):
                    plan, sim, improved = moved, trial, True
                    break
        return plan, sim



def pass_times(profile: Profile, store: Link, policy: Sequence[str], which: str
               ) -> list[float]:
    """Per-layer time of one pass (combined, forward or backward) that partitions balance
    (see [Note: search], step 1): compute, recompute, store traffic, and loading the
    micro-batch, which the forward of the first layer's and the loss layer's stages pays
    (as simulated; once when one stage holds both)."""
    out = []
    for i, x in enumerate(profile.layers):
        data = profile.load_seconds(range(i, i + 1)) if which != "backward" else 0.0
        recompute = x.forward_seconds if policy[i] == "recompute" else 0.0
        # inside a run of recomputed layers nothing moves (stage cuts, unknown here,
        # start a run too: one input per stage is left out)
        starts = i == 0 or policy[i - 1] != "recompute"
        moved = kept_bytes(x, policy[i], starts)
        if which == "combined":
            offload = 2 * store.seconds(moved) if policy[i] == "offload" else 0.0
            out.append(data + x.forward_seconds + x.backward_seconds + recompute + offload)
        elif which == "forward":
            out.append(data + x.forward_seconds + moved / store.bandwidth)
        else:
            out.append(x.backward_seconds + recompute + moved / store.bandwidth)
    return out


def _boundary_bytes(profile: Profile, layers: Sequence[int]) -> int:
    """Bytes crossing the two boundaries of a stage of contiguous `layers` per micro-batch
    and pass: its input from the stage before and its output to the one after (an
    activation forward, its gradient backward)."""
    first, last = layers[0], layers[-1]
    return ((profile.layers[first - 1].output_bytes if first > 0 else 0)
            + (profile.layers[last].output_bytes if last < profile.n_layers - 1 else 0))


def _held_bytes(plan: Plan, policy: list[str], layers: list[int], prof: Profile) -> int:
    """Bytes `layers` hold per micro-batch for their backward under `policy`."""
    runs = recompute_runs(replace(plan, policy=tuple(policy)))
    return sum(kept_bytes(prof.layers[i], policy[i], runs.get(i) == i) for i in layers)


def _layers_of_rank(topology: Topology, rank: int) -> list[int]:
    out: set[int] = set()
    if rank in topology.forward_workers:
        out |= set(topology.layers_of_forward(topology.forward_workers.index(rank)))
    if rank in topology.backward_workers:
        out |= set(topology.layers_of_backward(topology.backward_workers.index(rank)))
    return sorted(out)


def _neighbours(plan: Plan) -> list[Plan]:
    """Plans with one stage boundary moved by one layer (both passes on combined kinds)."""
    out = []
    combined = (plan.forward_partition == plan.backward_partition
                and not schedule_kind(plan.schedule).separate_partitions)
    for which in ("forward", "backward") if not combined else ("both",):
        bounds = plan.backward_partition if which == "backward" else plan.forward_partition
        for j in range(1, len(bounds) - 1):
            for d in (-1, 1):
                b = list(bounds)
                b[j] += d
                if not b[j - 1] < b[j] < b[j + 1]:
                    continue
                new = tuple(b)
                if which == "forward":
                    out.append(replace(plan, forward_partition=new))
                elif which == "backward":
                    out.append(replace(plan, backward_partition=new))
                else:
                    out.append(replace(plan, forward_partition=new, backward_partition=new))
    return out


def _events(plan: Plan) -> int:
    """About how many actions simulating the plan executes (the search's budget unit)."""
    stages = len(plan.forward_partition) - 1 + (
        len(plan.backward_partition) - 1 if schedule_kind(plan.schedule).split else 0)
    iterations = 2 if plan.mode == "sync" else 5 + plan.staleness
    return stages * plan.microbatches * 4 * iterations


def _gb(nbytes: float) -> str:
    return "unbounded" if not math.isfinite(nbytes) else f"{nbytes / 1e9:.3g} GB"


def _policy_summary(policy: Sequence[str]) -> str:
    """`keep` for uniform policies, else counts, e.g. `offload 10, recompute 2`."""
    counts = {p: policy.count(p) for p in dict.fromkeys(policy)}
    return next(iter(counts)) if len(counts) == 1 else ", ".join(
        f"{p} {n}" for p, n in counts.items())


def search(profile: Profile, cluster: Cluster, batch_size: int, *,
           schedules: Sequence[str] = KINDS, mode: str = "sync", staleness: int = 1,
           microbatches: Sequence[int] | None = None) -> PlanSearch:
    """The best plan for `cluster` by simulated step time (see [Note: search]).

    Args:
        profile: layer costs, measured or analytic, at any micro-batch size.
        cluster: the workers (every one gets a stage), links, store and overheads.
        batch_size: samples per training step.
        schedules: the schedule kinds to consider.
        mode: sync or async; kinds that cannot run in it are skipped.
        staleness: the staleness of async PipeFB candidates.
        microbatches: micro-batch counts to try (default: `microbatch_choices`).

    Returns:
        The best candidate, its simulation and every candidate with a note.

    Raises:
        ConfigError: no schedule runs in `mode`, too few layers for the workers, or no
            candidate fits (the message gives the closest one's reason).
    """
    if profile.n_layers < cluster.size:
        raise ConfigError(f"{cluster.size} workers need at least as many layers; the model "
                          f"has {profile.n_layers} (loss included)")
    counts = list(microbatches or microbatch_choices(batch_size, cluster.size))
    bad = [m for m in counts if m < 1 or batch_size % m]
    if bad:
        raise ConfigError(f"micro-batch count {bad[0]} does not divide batch size {batch_size}")
    with _collector_paused():
        return _search(_Planner(_Space(profile, cluster, batch_size, staleness)),
                       _kinds(schedules, mode), counts)


class _Pause:
    """Searches running at once (in a coordinator's threads) and whether the collector
    was on when the first began: the last to end restores it."""

    lock = threading.Lock()
    running = 0
    was_enabled = False


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector while a search runs ([Note: collector])."""
    with _Pause.lock:
        if _Pause.running == 0:
            _Pause.was_enabled = gc.isenabled()
            gc.disable()
        _Pause.running += 1
    try:
        yield
    finally:
        with _Pause.lock:
            _Pause.running -= 1
            if _Pause.running == 0 and _Pause.was_enabled:
                gc.enable()


def _search(planner: _Planner, kinds: list[tuple[str, str]], counts: list[int]
            ) -> PlanSearch:
    """`search` once its arguments are checked (steps 1-4 of [Note: search])."""
    plans = planner.candidates(kinds, counts)
    ranked = sorted(plans, key=planner.estimate)
    results: list[Candidate] = []
    kinds_simulated: set[tuple[str, str]] = set()
    for plan in ranked:
        estimate = planner.estimate(plan)
        kind = (plan.schedule, plan.mode)
        if kind in kinds_simulated and planner.events > EVENT_BUDGET:
            results.append(Candidate(plan, math.inf, estimate,
                                     note="not simulated: its estimate ranked it out"))
            continue
        kinds_simulated.add(kind)
        fitted, sim, note = planner.fit(plan)
        if sim is None or note:
            results.append(Candidate(fitted, math.inf, planner.estimate(fitted), note=note))
            continue
        results.append(Candidate(fitted, sim.step_seconds, estimate, sim.peak_memory,
                                 sim.bubble_fraction))
    fitting = [c for c in results if math.isfinite(c.step_seconds)]
    if not fitting:
        reasons = sorted({c.note for c in results if c.note.startswith("refused")})
        raise ConfigError("no plan fits: " + (reasons[0] if reasons else "nothing simulated"))
    top, plan, sim = _final(planner, fitting)
    plan = replace(plan, predicted_step_seconds=sim.step_seconds,
                   predicted_peak_memory_bytes=tuple(sim.peak_memory[r]
                                                     for r in sorted(sim.peak_memory)),
                   extra={"bubble_fraction": sim.bubble_fraction})
    best = Candidate(plan, sim.step_seconds, planner.estimate(plan), sim.peak_memory,
                     sim.bubble_fraction)
    others = [_lost(c, best) for c in results if c is not top]
    others.sort(key=lambda c: (c.step_seconds, c.estimate_seconds))
    return PlanSearch(best, sim, (best, *others), planner.events)


def _final(planner: _Planner, fitting: list[Candidate]
           ) -> tuple[Candidate, Plan, Simulation]:
    """Refines the `FINALISTS` fastest candidates and picks the fastest refined plan; plans
    within `TIE` of it count as equally fast and the lowest peak memory among them wins
    (the highest rank's, then the sum over ranks: see [Note: search], step 4). Returns the
    chosen candidate, its plan and simulation."""
    refined = []
    for c in sorted(fitting, key=lambda c: c.step_seconds)[:FINALISTS]:
        sim = planner.simulate(c.plan)
        assert isinstance(sim, Simulation)
        refined.append((c, *planner.refine(c.plan, sim)))
    fastest = min(sim.step_seconds for _, _, sim in refined)
    tied = [r for r in refined if r[2].step_seconds <= fastest * (1 + TIE)]
    return min(tied, key=lambda r: (max(r[2].peak_memory.values()),
                                    sum(r[2].peak_memory.values()), r[2].step_seconds))


def _lost(c: Candidate, best: Candidate) -> Candidate:
    if c.note:
        return c
    slower = c.step_seconds / best.step_seconds - 1 if best.step_seconds > 0 else 0.0
    if slower < TIE:
        return replace(c, note=f"as fast within {TIE:.0%}, more peak memory or unrefined")
    why = (f"{slower:.0%} slower" + (f"; bubble {c.bubble_fraction:.0%} vs "
                                     f"{best.bubble_fraction:.0%}"
                                     if c.bubble_fraction > best.bubble_fraction + 0.02 else ""))
    return replace(c, note=why)


def best_estimate(profile: Profile, cluster: Cluster, batch_size: int, *,
                  schedules: Sequence[str] = KINDS, mode: str = "sync", staleness: int = 1
                  ) -> tuple[Plan, float]:
    """The candidate with the best analytic step time (`_Planner.estimate`), simulating
    nothing and ignoring memory caps: the training-time model's view of one pipeline.

    Raises:
        ConfigError: as `search`.
    """
    if profile.n_layers < cluster.size:
        raise ConfigError(f"{cluster.size} workers need at least as many layers; the model "
                          f"has {profile.n_layers} (loss included)")
    planner = _Planner(_Space(profile, cluster, batch_size, staleness))
    plans = planner.candidates(_kinds(schedules, mode),
                               microbatch_choices(batch_size, cluster.size))
    best = min(plans, key=planner.estimate)
    return best, planner.estimate(best)
