"""The planner: picks schedule kind, micro-batch count, roles, partitions and per-layer
activation policy for a cluster, by simulated step time under each worker's memory cap.

A pure function of a layer profile and a cluster description (`search`); it returns the
best plan, the runners-up and why each lost. This module runs the search; the candidates
and answers are `pipefb.planner.candidates`, partitions `pipefb.planner.balance`, policies
`pipefb.planner.policy` and the ranking estimate `pipefb.planner.estimate`.

[Note: search]
For every schedule kind the job's mode allows, every micro-batch count (divisors of the
batch size), and for a kind that splits the passes (PipeFB) every split of the workers
into forward and backward roles:
1. partition: `pipefb.plan.partition.partitions` balances each pass's per-layer time (at
   the profile's micro-batch size, one table for every stage count) over its workers'
   speeds (forward + backward on combined kinds; PipeFB's forward stages by forward time
   plus the stash put, its backward stages by backward time plus the fetch), each stage
   also paying the bytes that cross its two boundaries over the pass's slowest link
   (`Balancer.cut_seconds`: the activation forward, its gradient backward, both on
   combined kinds), so a cut avoids a layer with a large output (a head's logits) when a
   cheaper one balances as well;
2. policy: combined kinds keep everything; PipeFB offloads each layer unless re-running
   its forward is cheaper than moving its saved tensors through the store; while a worker's
   simulated peak exceeds its cap, its kept layer with the largest stash is offloaded if
   the simulation says that is nearly free (the copy lane hides its copies behind compute,
   or a CPU rank's node-local tier copies them in less than the step's `NEARLY_FREE`:
   [Note: tier copies] in pipefb.sim.costmodel), else its layers switch to offload or
   recompute, whichever frees more bytes per second of extra time (an offload costing a
   put and a take, through the store or that tier); the partition is re-balanced, and the
   plan simulated again;
3. an analytic estimate ranks the candidates; the best ones are simulated (as many as an
   event budget allows, and at least the best of each schedule kind: the estimate ignores
   the caps, so a kind's best estimate may lose most to fitting its memory);
4. the `FINALISTS` fastest simulated candidates have their stage boundaries moved one
   layer at a time while the simulated step time improves, and the fastest refined plan
   wins; refined plans within `TIE` of it count as equally fast, and the one with the
   lowest peak memory among them wins (the highest rank's peak, then the sum of all).
   The simulator does not price a larger footprint (allocation, caches), and step times
   this close are within the noise of a profile, so between them the smaller footprint
   is the safer choice.
A candidate whose simulation deadlocks, or which cannot fit a cap, is refused with the
reason.

Cost: partitions are O(k n^2) each with boundary costs (n layers, k stages; one n x n
tensor operation per stage count) and cached per (pass, stage speeds, boundary costs);
nearly all of a search's time is simulation, which `EVENT_BUDGET` bounds (see
[Note: collector]).

[Note: collector]
A search allocates a few hundred thousand small objects (simulated actions, the lowered
lists its simulations keep), and each of CPython's full collections rescans every object
of the process, torch's included, so the collections those allocations trigger would take
a large share of a search. `search` therefore pauses the cyclic collector while it runs
(reference counting still frees everything at once); the last of searches running at
once in several threads restores it as the first found it. The simulator's spans are
atoms-only tuples (`pipefb.sim.result.Record`) for the same reason: the collector stops tracking
them.
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from pipefb.errors import ConfigError, ScheduleError
from pipefb.plan.plan import Plan
from pipefb.planner.balance import Balancer
from pipefb.planner.candidates import (
    Candidate,
    PlanSearch,
    SearchSpace,
    forward_splits,
    kinds_in_mode,
    microbatch_choices,
)
from pipefb.planner.estimate import estimate
from pipefb.planner.policy import NEARLY_FREE, initial_policy, relieve
from pipefb.schedule import KINDS, schedule_kind
from pipefb.sim.cluster import Cluster
from pipefb.sim.costs import Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

MEMORY_MARGIN = 0.9  # plans use at most this share of a cap: the model is not exact
FINALISTS = 3  # the fastest simulated candidates whose stage boundaries are refined
TIE = 0.01  # simulated step times this close are equal: the lower peak memory wins
EVENT_BUDGET = 30_000  # simulated actions the search may spend on ranking candidates


class _Planner:
    """One search: builds candidates (`Balancer`, `pipefb.planner.policy`), and caches
    their estimates and simulations, counting the simulated actions."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.balancer = Balancer(space)
        self.sims: dict[Plan, Simulation | ScheduleError] = {}
        self.estimates: dict[Plan, float] = {}
        self.events = 0

    # -- building candidates ---------------------------------------------------------------

    def build(self, kind: str, mode: str, microbatches: int, n_fwd: int,
              policy: Sequence[str]) -> Plan:
        """`Balancer.build`: a plan of `kind` with balanced partitions for `policy`."""
        return self.balancer.build(kind, mode, microbatches, n_fwd, policy)

    def initial_policy(self, kind: str, microbatches: int) -> list[str]:
        """`pipefb.planner.policy.initial_policy` in this search's space."""
        return initial_policy(self.space, kind, microbatches)

    def relieve(self, plan: Plan, over: dict[int, int]) -> list[str] | None:
        """`pipefb.planner.policy.relieve` in this search's space; with a copy lane, an
        offload is tried by simulation first ([Note: search], step 2)."""
        base = self.simulate(plan)
        if not self.space.cluster.stash_in_flight_bytes or not isinstance(base, Simulation):
            return relieve(self.space, plan, over)

        def nearly_free(policy: list[str], rank: int) -> bool:
            trial = self.simulate(replace(plan, policy=tuple(policy)))  # same partition
            return (isinstance(trial, Simulation)
                    and trial.step_seconds <= base.step_seconds * (1 + NEARLY_FREE)
                    and trial.peak_memory[rank] < base.peak_memory[rank])
        return relieve(self.space, plan, over, nearly_free)

    def candidates(self, kinds: list[tuple[str, str]], microbatches: Sequence[int]
                   ) -> list[Plan]:
        """The first plan of every (kind, mode), micro-batch count and role split."""
        n = self.space.cluster.size
        out = []
        for kind, mode in kinds:
            splits = (forward_splits(n, self.space.profile) if schedule_kind(kind).split
                      else [n])
            for m in microbatches:
                policy = self.initial_policy(kind, m)
                for n_fwd in splits:
                    out.append(self.build(kind, mode, m, n_fwd, policy))
        return out

    # -- simulating -------------------------------------------------------------------------

    def estimate(self, plan: Plan) -> float:
        """`pipefb.planner.estimate.estimate`, cached."""
        if plan not in self.estimates:
            self.estimates[plan] = estimate(self.space, plan)
        return self.estimates[plan]

    def simulate(self, plan: Plan) -> Simulation | ScheduleError:
        """The plan's simulation (or why it cannot run), cached; counts its actions."""
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

    def refine(self, plan: Plan, sim: Simulation) -> tuple[Plan, Simulation]:
        """Moves stage boundaries one layer at a time while the simulated time improves
        and every cap holds (see [Note: search], step 4)."""
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


def search(profile: Profile, cluster: Cluster, batch_size: int, *,
           schedules: Sequence[str] = KINDS, mode: str = "sync", staleness: int = 1,
           microbatches: Sequence[int] | None = None, stale_microbatches: int = 0
           ) -> PlanSearch:
    """The best plan for `cluster` by simulated step time (see [Note: search]).

    Args:
        profile: layer costs, measured or analytic, at any micro-batch size.
        cluster: the workers (every one gets a stage), links, store and overheads.
        batch_size: samples per training step.
        schedules: the schedule kinds to consider.
        mode: sync or async; kinds that cannot run in it are skipped.
        staleness: the staleness of async PipeFB candidates.
        microbatches: micro-batch counts to try (default: `microbatch_choices`).
        stale_microbatches: the job's K: async PipeFB candidates run only their first K
            forwards on the older version (`JobConfig.stale_microbatches`); 0: all.

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
        return _search(_Planner(SearchSpace(profile, cluster, batch_size, staleness,
                                            stale_microbatches)),
                       kinds_in_mode(schedules, mode), counts)


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
    planner = _Planner(SearchSpace(profile, cluster, batch_size, staleness))
    plans = planner.candidates(kinds_in_mode(schedules, mode),
                               microbatch_choices(batch_size, cluster.size))
    if not plans:
        raise ConfigError(f"no {'/'.join(schedules)} plan in {mode} mode runs on "
                          f"{cluster.size} worker{'s' if cluster.size != 1 else ''} with "
                          f"{batch_size} samples a step")
    best = min(plans, key=planner.estimate)
    return best, planner.estimate(best)
