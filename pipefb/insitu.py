"""In-situ costs: fits a layer profile to the action times a running plan measured.

A profile measured on an idle worker underestimates what the same layers cost inside a
pipeline on a shared machine: other workers compete for cores and memory bandwidth, and
the worker's own gRPC threads compete for its interpreter while it computes. After a few
steps of a plan, `fit` finds one factor per kind of work (forward, backward, optimizer,
store traffic) such that the simulated time of each kind, summed over ranks, equals the
measured one, and re-simulates the plan with the scaled profile. The factors say where a
run is slower than its profile; the refined step time is what the simulator predicts from
costs measured where they run.

[Note: fixed point]
On a host with fewer cores than busy workers the simulator stretches each action by the
processor sharing it models, so measured times cannot simply be divided by profiled ones:
each round multiplies every factor by measured / simulated (stretch included), and a few
rounds settle (each round's change shrinks with the share of time spent waiting).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pipefb.cluster import Cluster, Link
from pipefb.costs import Profile
from pipefb.plan import Plan
from pipefb.schedule import Kind
from pipefb.simulate import Simulation, simulate

#: kinds of work a factor scales; STASH also covers FETCH (both move bytes via the store)
FITTED = ("F", "B", "OPT", "STASH")
ROUNDS = 4  # fixed-point rounds (see [Note: fixed point])


@dataclass(frozen=True)
class InSitu:
    """A plan's simulation with costs fitted to measured action times.

    Attributes:
        factors: per fitted kind, measured over profiled cost (1.0: as profiled; kinds
            the plan does not run keep 1.0).
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


def measured_kinds(action_seconds: Mapping[str, float]) -> dict[str, float]:
    """Measured seconds per fitted kind from action seconds by kind (FETCH joins STASH)."""
    out = {kind: float(action_seconds.get(kind, 0.0)) for kind in FITTED}
    out["STASH"] += float(action_seconds.get("FETCH", 0.0))
    return out


def simulated_kinds(sim: Simulation) -> dict[str, float]:
    """Seconds per fitted kind in the simulation's steady iteration, summed over ranks."""
    k = max(0, sim.iterations - 2)
    out: dict[str, float] = defaultdict(float)
    for s in sim.spans:
        if s.iteration == k:
            name = "STASH" if s.action.kind is Kind.FETCH else s.action.kind.name
            out[name] += s.end - s.start
    return {kind: out.get(kind, 0.0) for kind in FITTED}


def scaled(profile: Profile, cluster: Cluster, factors: Mapping[str, float]
           ) -> tuple[Profile, Cluster]:
    """The profile and cluster with each kind's cost multiplied by its factor."""
    f, b = factors.get("F", 1.0), factors.get("B", 1.0)
    layers = tuple(replace(x, forward_seconds=x.forward_seconds * f,
                           forward_fixed_seconds=x.forward_fixed_seconds * f,
                           backward_seconds=x.backward_seconds * b,
                           backward_fixed_seconds=x.backward_fixed_seconds * b)
                   for x in profile.layers)
    profile = replace(profile, layers=layers, optimizer_seconds_per_byte=(
        profile.optimizer_seconds_per_byte * factors.get("OPT", 1.0)))
    store = Link(cluster.store.bandwidth / factors.get("STASH", 1.0), cluster.store.latency)
    return profile, replace(cluster, store=store)


def fit(plan: Plan, profile: Profile, cluster: Cluster, measured: Mapping[str, float],
        rounds: int = ROUNDS) -> InSitu:
    """Fits per-kind factors so the simulated seconds of each kind match `measured`.

    Args:
        plan: the plan that ran.
        profile: the profile it was planned with.
        cluster: the cluster it was simulated on.
        measured: per kind (F, B, OPT, STASH, FETCH), seconds per step summed over ranks,
            e.g. medians of the workers' `action_seconds` after warm-up.
        rounds: fixed-point rounds (see [Note: fixed point]).

    Returns:
        The factors and the plan's simulation with the fitted costs.
    """
    want = measured_kinds(measured)
    factors = dict.fromkeys(FITTED, 1.0)
    fitted_profile, sim = profile, simulate(plan, profile, cluster, check=False)
    for _ in range(rounds):
        got = simulated_kinds(sim)
        for kind in FITTED:
            if got[kind] > 0 and want[kind] > 0:
                factors[kind] *= want[kind] / got[kind]
        fitted_profile, fitted_cluster = scaled(profile, cluster, factors)
        sim = simulate(plan, fitted_profile, fitted_cluster, check=False)
    return InSitu({k: round(v, 4) for k, v in factors.items()}, sim, fitted_profile)


__all__ = ["FITTED", "InSitu", "fit", "measured_kinds", "scaled", "simulated_kinds"]
