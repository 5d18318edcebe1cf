"""In-situ costs: fits a layer profile to the action times a running plan measured.

A profile measured on an idle worker underestimates what the same layers cost inside a
pipeline on a shared machine: other workers compete for cores and memory bandwidth, and
the worker's own gRPC threads compete for its interpreter while it computes; a calibrated
link latency (an echo between idle processes) underestimates a hop between busy ones.
After a few steps of a plan, `fit` finds one factor per kind of work (forward, backward,
optimizer, store traffic) such that the simulated time of each kind, summed over ranks,
equals the measured one, then one factor on every link's latency such that the simulated
receive waits (RECV_*, summed over ranks) equal the measured ones, and re-simulates the
plan. The step time is never fitted: it is what the simulator predicts from busy and
waiting times measured where they happen. The factors say where a run is slower than its
profile and cluster description.

[Note: fixed point]
On a host with fewer cores than busy workers the simulator stretches each action by the
processor sharing it models, so measured times cannot simply be divided by profiled ones:
each round multiplies every factor by measured / simulated (stretch included), and a few
rounds settle (each round's change shrinks with the share of time spent waiting).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pipefb.plan.plan import Plan
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.costs import Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

#: kinds of work a factor scales; STASH also covers FETCH (both move bytes via the store)
FITTED = ("F", "B", "OPT", "STASH")
RECEIVES = ("RECV_F", "RECV_B", "RECV_L", "RECV_W")  # their waits fit the link latency
LATENCY = "latency"  # the factor on every link's latency
ROUNDS = 4  # fixed-point rounds (see [Note: fixed point])
BISECTIONS = 12  # latency factor steps per round: within 2^-12 of its bracket
MAX_LATENCY_FACTOR = 64.0  # beyond this, waits are not the links' doing: keep 1.0
#: the store's factor stays within 1/this..this: STASH and FETCH spans are what the copy
#: lane leaves exposed ([Note: copy lane] in pipefb.sim.copylane), which does not grow in
#: proportion to the store's time (a take hidden but for 1 us would ask for any factor)
MAX_STORE_FACTOR = 8.0
#: iterations simulated: enough that the compared one (the second to last) follows a
#: whole step, as the measured steps do (a sync step's first waits are for the last one's)
ITERATIONS = 4
#: the steps of a run whose action times a fit uses: step 0 warms up (first calls, the
#: allocator growing); the median over 8 steps keeps one stalled step of short steps on a
#: shared machine from setting a factor
STEPS = range(1, 9)


@dataclass(frozen=True)
class InSitu:
    """A plan's simulation with costs fitted to measured action times.

    Attributes:
        factors: per fitted kind, measured over profiled cost, and `latency`: fitted over
            described link latency (1.0: as described; what the plan does not run or
            wait for keeps 1.0).
        simulation: the plan simulated with the fitted profile and store.
        profile: the fitted profile.
    """

    factors: dict[str, float]
    simulation: Simulation
    profile: Profile

    @property
    def step_seconds(self) -> float:
        """The refined prediction of the plan's step time."""
        return self.simulation.step_seconds

    def to_dict(self) -> dict[str, object]:
        """JSON-able summary for job status and reports."""
        return {"factors": self.factors, "step_seconds": self.step_seconds,
                "bubble_fraction": self.simulation.bubble_fraction}


def median_action_seconds(steps: Sequence[Sequence[Mapping[str, float]]]) -> dict[str, float]:
    """Per action kind, the median over steps of its seconds summed over the ranks; each
    step lists every rank's action seconds by kind (a kind a rank did not run counts 0)."""
    kinds = {kind for ranks in steps for rank in ranks for kind in rank}
    per_step = [{kind: sum(rank.get(kind, 0.0) for rank in ranks) for kind in kinds}
                for ranks in steps]
    return {kind: statistics.median(s[kind] for s in per_step) for kind in kinds}


def measured_kinds(action_seconds: Mapping[str, float]) -> dict[str, float]:
    """Measured seconds per fitted kind from action seconds by kind (FETCH joins STASH),
    and the receive waits under LATENCY."""
    out = {kind: float(action_seconds.get(kind, 0.0)) for kind in FITTED}
    out["STASH"] += float(action_seconds.get("FETCH", 0.0))
    out[LATENCY] = sum(float(action_seconds.get(kind, 0.0)) for kind in RECEIVES)
    return out


def simulated_kinds(sim: Simulation) -> dict[str, float]:
    """`measured_kinds` of the simulation's steady iteration, summed over ranks."""
    k = max(0, sim.iterations - 2)
    out: dict[str, float] = defaultdict(float)
    for s in sim.spans:
        if s.iteration == k:
            out[s.action.kind.name] += s.end - s.start
    return measured_kinds(out)


def scaled(profile: Profile, cluster: Cluster, factors: Mapping[str, float]
           ) -> tuple[Profile, Cluster]:
    """The profile and cluster with each kind's cost, and every link's latency,
    multiplied by its factor."""
    f, b = factors.get("F", 1.0), factors.get("B", 1.0)
    layers = tuple(replace(x, forward_seconds=x.forward_seconds * f,
                           forward_fixed_seconds=x.forward_fixed_seconds * f,
                           backward_seconds=x.backward_seconds * b,
                           backward_fixed_seconds=x.backward_fixed_seconds * b,
                           weight_grad_seconds=x.weight_grad_seconds * b)
                   for x in profile.layers)
    profile = replace(profile, layers=layers, data_seconds=profile.data_seconds * f,
                      optimizer_seconds_per_byte=(profile.optimizer_seconds_per_byte
                                                  * factors.get("OPT", 1.0)),
                      optimizer_fixed_seconds=(profile.optimizer_fixed_seconds
                                               * factors.get("OPT", 1.0)),
                      weight_copy_seconds_per_byte=(profile.weight_copy_seconds_per_byte
                                                    * factors.get("OPT", 1.0)))
    stash = factors.get("STASH", 1.0)  # the store's copies and the tier's alike
    store = replace(cluster.store, bandwidth=cluster.store.bandwidth / stash)
    hop = factors.get(LATENCY, 1.0)

    def copies(link: Link | None) -> Link | None:
        return None if link is None else replace(link, bandwidth=link.bandwidth / stash)

    def slower(link: Link) -> Link:
        return Link(link.bandwidth, link.latency * hop)

    return profile, replace(cluster, store=store, local_tier=copies(cluster.local_tier),
                            shared_tier=copies(cluster.shared_tier),
                            network=slower(cluster.network),
                            links={pair: slower(x) for pair, x in cluster.links.items()})


def fit(plan: Plan, profile: Profile, cluster: Cluster, measured: Mapping[str, float],
        rounds: int = ROUNDS) -> InSitu:
    """Fits per-kind factors and a latency factor to measured action seconds.

    Args:
        plan: the plan that ran.
        profile: the profile it was planned with.
        cluster: the cluster it was simulated on.
        measured: per action kind (F, B, OPT, STASH, FETCH, RECV_*), seconds per step
            summed over ranks, e.g. medians of the workers' `action_seconds` after warm-up.
        rounds: fixed-point rounds (see [Note: fixed point]).

    Returns:
        The factors and the plan's simulation with the fitted costs.
    """
    want = measured_kinds(measured)
    factors = {**dict.fromkeys(FITTED, 1.0), LATENCY: 1.0}
    fitted = (profile, cluster)
    sim = _simulate(plan, *fitted)
    for _ in range(rounds):
        got = simulated_kinds(sim)
        for kind in FITTED:
            if got[kind] > 0 and want[kind] > 0:
                factors[kind] *= want[kind] / got[kind]
        factors["STASH"] = min(max(factors["STASH"], 1 / MAX_STORE_FACTOR), MAX_STORE_FACTOR)
        factors[LATENCY] = _latency_factor(plan, profile, cluster, factors, want[LATENCY])
        fitted = scaled(profile, cluster, factors)
        sim = _simulate(plan, *fitted)
    return InSitu({k: round(v, 4) for k, v in factors.items()}, sim, fitted[0])


def _latency_factor(plan: Plan, profile: Profile, cluster: Cluster,
                    factors: dict[str, float], want: float) -> float:
    """The latency factor whose simulated receive waits match `want` (bisection; waits
    grow with latency), given the other factors; 1.0 when nothing is received, or when
    even MAX_LATENCY_FACTOR leaves the waits short (then they come from elsewhere, say a
    worker descheduled, and a slower link would only mispredict the step)."""
    def waits(hop: float) -> float:
        trial = scaled(profile, cluster, {**factors, LATENCY: hop})
        return simulated_kinds(_simulate(plan, *trial))[LATENCY]

    if want <= 0 or waits(1.0) <= 0:
        return 1.0
    if waits(MAX_LATENCY_FACTOR) < want:
        return 1.0
    low, high = 0.0, 1.0
    while waits(high) < want:
        low, high = high, high * 4
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        low, high = (mid, high) if waits(mid) < want else (low, mid)
    return (low + high) / 2


def _simulate(plan: Plan, profile: Profile, cluster: Cluster) -> Simulation:
    iterations = ITERATIONS if plan.mode == "sync" else 0  # async: the default is longer
    return simulate(plan, profile, cluster, iterations, check=False)


__all__ = ["FITTED", "LATENCY", "InSitu", "fit", "measured_kinds", "median_action_seconds",
           "scaled", "simulated_kinds"]
