"""The planner's choice of the number of pipeline groups: its training-time model against
exhaustive search, on described clusters of 4 to 64 workers (nothing runs here)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.planner.groups import group_counts, grouped, search_groups, shortlist
from pipefb.schedule import Kind
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate


def _profile(seed: int, n: int) -> Profile:
    """n layers of 0.1-2 ms forward, 0.2-4 ms backward and 4-64 MB of parameters each:
    heavy enough that the all-reduce competes with the bubble."""
    rng = random.Random(seed)
    layers = tuple(LayerProfile(f"l{i}", rng.uniform(1e-4, 2e-3), rng.uniform(2e-4, 4e-3),
                                rng.randrange(1, 1 << 16), rng.randrange(1 << 16, 1 << 20),
                                rng.randrange(1 << 16, 1 << 20), rng.randrange(1 << 22, 1 << 26))
                   for i in range(n))
    return Profile(4, layers, optimizer_seconds_per_byte=1e-11, optimizer_state_ratio=2.0)


@pytest.mark.parametrize("workers", [4, 8, 16, 32, 64])
def test_model_choice_of_groups_is_within_5_percent_of_exhaustive_search(workers: int) -> None:
    profile = _profile(workers, max(workers, 16))
    cluster = Cluster.uniform(workers, network=Link(12e9, 2e-5), store=Link(12e9, 2e-5))
    result = search_groups(profile, cluster, 128, exhaustive=True)
    assert [c.groups for c in result.choices] == group_counts(workers, 128, profile.n_layers)
    assert all(c.plan is not None for c in result.choices)
    assert result.by_model.step_seconds <= 1.05 * result.best.step_seconds
    assert result.plan.groups == result.best.groups
    assert len(result.plan.assignment) == workers
    if workers == 8:  # without exhaustive, the planner returns exactly the model's choice
        assert search_groups(profile, cluster, 128).best == result.by_model


def test_allreduce_makes_many_small_groups_lose_on_a_slow_network() -> None:
    """1 GB/s between workers: summing 64 MB stages over 8 replicas costs more than the
    bubble it saves, so data parallelism loses to deeper pipelines."""
    profile = _profile(1, 16)
    fast = Cluster.uniform(8, network=Link(100e9, 1e-6), store=Link(12e9, 2e-5))
    slow = Cluster.uniform(8, network=Link(1e9, 1e-4), store=Link(12e9, 2e-5))
    on_fast = search_groups(profile, fast, 128, exhaustive=True)
    on_slow = search_groups(profile, slow, 128, exhaustive=True)
    assert on_slow.best.groups < on_fast.best.groups
    pure_dp = {c.groups: c for c in on_slow.choices}[8]
    assert pure_dp.step_seconds > on_slow.best.step_seconds


def test_simulated_optimizer_steps_add_exactly_the_ring_allreduce() -> None:
    """Two groups of one 1f1b pipeline: each stage's OPT lasts its optimizer time plus
    2 (G-1) link transfers of 1/G of its gradients, and the step grows by at least the
    smaller of the two all-reduces."""
    profile = _profile(2, 4)
    link = Link(1e9, 1e-4)
    one = balanced_plan("1f1b", 2, [1.0] * 4, 8, 4)
    alone = simulate(one, profile, Cluster.uniform(2, network=link, store=link))
    two = simulate(grouped(one, 2), profile, Cluster.uniform(4, network=link, store=link))
    assert sorted({s.rank for s in two.spans}) == [0, 1]  # one group simulated for all

    def opt_seconds(sim: Simulation, rank: int) -> float:
        return next(s.end - s.start for s in sim.spans
                    if s.rank == rank and s.action.kind is Kind.OPT)

    ring = []
    for stage in range(2):
        owned = profile.param_bytes(one.topology().layers_of_backward(stage))
        ring.append(2 * (link.latency + owned / 2 / link.bandwidth))
        assert opt_seconds(two, stage) == pytest.approx(opt_seconds(alone, stage) + ring[-1],
                                                        rel=1e-9)
    assert two.step_seconds >= alone.step_seconds + min(ring)


def test_group_counts_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ConfigError, match="groups 3 must divide the workers"):
        search_groups(_profile(0, 8), Cluster.uniform(4), 12, groups=[3])


def _two_hosts(n: int) -> Cluster:
    """n workers, half on each of two hosts of n/2 cores; fast links inside a host."""
    from pipefb.sim.cluster import WorkerSpec

    workers = tuple(WorkerSpec(f"g{i}", host=f"h{i * 2 // n}") for i in range(n))
    inside = Link(20e9, 1e-5)
    links = {frozenset((a.name, b.name)): inside
             for i, a in enumerate(workers) for b in workers[i + 1:] if a.host == b.host}
    return Cluster(workers, network=Link(1e9, 1e-4), links=links,
                   host_cores={"h0": n // 2, "h1": n // 2})


def test_group_view_keeps_its_links_and_its_share_of_each_host() -> None:
    from pipefb.sim.cluster import group_view

    cluster = _two_hosts(8)
    two = group_view(cluster, 2)  # group 0 owns host h0 whole
    assert [w.name for w in two.workers] == ["g0", "g1", "g2", "g3"]
    assert two.host_cores == {"h0": 4}
    assert two.link(0, 1).bandwidth == 20e9 and len(two.links) == 6
    four = group_view(cluster, 4)  # group 0 holds 2 of h0's 4 workers
    assert four.host_cores == {"h0": 2} and len(four.links) == 1


def test_ring_moves_at_its_slowest_hop() -> None:
    from pipefb.sim.cluster import ring_link

    cluster = _two_hosts(8)
    # 4 groups of 2: stage 0's ring is g0, g2 (h0), g4, g6 (h1): two hops cross hosts
    assert ring_link(cluster, 0, 4) == Link(1e9, 1e-4)
    # 2 groups of 4 on 8 workers of one host: every hop stays inside
    one_host = replace(cluster, host_cores={"h0": 8},
                       workers=tuple(replace(w, host="h0") for w in cluster.workers))
    assert ring_link(replace(one_host, links={
        frozenset((a.name, b.name)): Link(20e9, 1e-5) for i, a in enumerate(one_host.workers)
        for b in one_host.workers[i + 1:]}), 1, 2) == Link(20e9, 1e-5)


def test_the_shortlist_keeps_every_near_tie_of_the_model() -> None:
    """The model's best three, and past them only counts within 10% of its best."""
    assert shortlist({1: 1.0, 2: 1.01, 4: 1.02, 8: 1.05, 16: 1.2, 32: 1.11}) == [1, 2, 4, 8]
    assert shortlist({1: 2.0, 2: 1.0, 4: 1.5, 8: 1.6}) == [2, 4, 8]
    assert shortlist({4: 1.0}) == [4]


def test_a_group_count_no_plan_fits_is_passed_over_with_its_reason() -> None:
    """PipeFB needs a forward and a backward worker: on 2 workers, 2 groups of one worker
    have no PipeFB plan, so the search takes 1 group and says why it passed over 2."""
    result = search_groups(_profile(0, 8), Cluster.uniform(2), 16, schedules=("pipefb",))
    assert result.best.groups == 1 and result.plan.schedule == "pipefb"
    [two] = [c for c in result.choices if c.groups == 2]
    assert two.plan is None and two.note == (
        "refused: no pipefb plan in sync mode runs on 1 worker with 8 samples a step")
    with pytest.raises(ConfigError, match=r"^no group count has a plan: refused: no pipefb"):
        search_groups(_profile(0, 8), Cluster.uniform(2), 16, schedules=("pipefb",),
                      groups=[2])
