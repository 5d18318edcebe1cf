"""A PipeFB rank whose stash partners share its loopback host moves its stashes through the
node-local tier ([Note: shared tier] in pipefb.sim.costmodel), as the workers do, and a
forward rank's sends wait for its writes ([Note: fenced sends] in pipefb.sim.engine); a
cluster that describes no shared tier is priced as before. Expected times are worked out
by hand in the comments (milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.plan.stashpath import fences_sends, stash_partners
from pipefb.sim.cluster import Cluster, Link, WorkerSpec
from pipefb.sim.costmodel import Costs
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

MS = 1e-3
MB = 1_000_000
STORE = Link(1e8, 0.0)  # 2 MB of stash: 20 ms to write, 20 ms to take
TIER = Link(1e9, 0.5e-3)  # 2 MB: 2.5 ms each way
PLAN = balanced_plan("pipefb", 2, [1.0], 1, 1)  # rank 0 forward, rank 1 backward
# F 4 ms, B 1 us, 2 MB saved: rank 0 runs RECV_W F0 STASH0 SEND_L0, rank 1 RECV_L0
# FETCH0 B0 OPT PUSH_W
PROFILE = Profile(1, (LayerProfile("l", 4 * MS, 1e-6, 0, 0, 2 * MB, 0),),
                  optimizer_seconds_per_byte=0.0)


def _cluster(hosts: tuple[str, ...] = ("box", "box"), **links: Link) -> Cluster:
    """Workers on loopback hosts of 8 cores each (no core is shared), the hop link of
    ~zero time, the store 100 MB/s."""
    return Cluster(tuple(WorkerSpec(f"w{i}", host=h) for i, h in enumerate(hosts)),
                   network=Link(1e15, 0.0), store=STORE, host_cores=dict.fromkeys(hosts, 8),
                   loopback_hosts=frozenset(hosts), **links)


def _spans(sim: Simulation) -> dict[str, tuple[float, float]]:
    """label -> (start, end) in ms of the first iteration's actions."""
    return {s.label: (round(s.start / MS, 6), round(s.end / MS, 6)) for s in sim.spans
            if s.iteration == 0}


def test_the_stash_partners_are_the_workers_consumers_and_producers():
    assert stash_partners(PLAN, 0) == {1} and stash_partners(PLAN, 1) == {0}
    gpipe = balanced_plan("gpipe", 2, [1.0] * 4, 4, 4)  # each rank takes back its own
    assert stash_partners(gpipe, 0) == stash_partners(gpipe, 1) == frozenset()
    four = balanced_plan("pipefb", 4, [1.0] * 4, 4, 4)
    t = four.topology()
    for f, rank in enumerate(t.forward_workers):
        consumers = {t.backward_workers[b] for b in range(len(t.backward_workers))
                     if set(t.layers_of_backward(b)) & set(t.layers_of_forward(f))}
        assert stash_partners(four, rank) == consumers


def test_only_a_forward_only_rank_fences_its_sends():
    assert [fences_sends(PLAN.topology(), r) for r in (0, 1)] == [True, False]
    gpipe = balanced_plan("gpipe", 2, [1.0] * 4, 4, 4)
    assert not any(fences_sends(gpipe.topology(), r) for r in (0, 1))


def test_on_one_loopback_host_the_stash_moves_through_the_shared_tier():
    # STASH0 hands 2 MB over at 4, written 4-6.5 (0.5 + 2 ms); the fenced SEND_L0 leaves
    # then over the ~zero hop: RECV_L0 ends at 6.5, FETCH0 takes 6.5-9, B0 9-9.001
    sim = simulate(PLAN, PROFILE, _cluster(shared_tier=TIER), 2)
    spans = _spans(sim)
    written = 4 + TIER.seconds(2 * MB) / MS
    assert spans["0STASH0"] == (4, 4)
    assert spans["0RECV_L0"][1] == pytest.approx(written)
    assert spans["0FETCH0"] == pytest.approx((written, written + TIER.seconds(2 * MB) / MS))
    assert sim.step_seconds == pytest.approx(9.001 * MS)
    assert Costs(PLAN, PROFILE, _cluster(shared_tier=TIER)).copy_links == {0: TIER, 1: TIER}


def test_without_the_shared_tier_or_with_a_partner_on_another_host_redis_prices_it():
    # the store's 20 ms each way: written 4-24, RECV_L0 at 24, FETCH0 24-44
    plain = simulate(PLAN, PROFILE, _cluster(), 2)
    assert _spans(plain)["0RECV_L0"][1] == pytest.approx(24)
    assert _spans(plain)["0FETCH0"] == pytest.approx((24, 44))
    assert plain.step_seconds == pytest.approx(44.001 * MS)
    apart = _cluster(("a", "b"), shared_tier=TIER)
    assert Costs(PLAN, PROFILE, apart).copy_links == {0: STORE, 1: STORE}
    assert (simulate(PLAN, PROFILE, apart, 2).records
            == simulate(PLAN, PROFILE, _cluster(("a", "b")), 2).records)
    assert _spans(simulate(PLAN, PROFILE, apart, 2))["0FETCH0"] == pytest.approx((24, 44))
    # a combined rank takes back its own stashes: no partner, the store (or its tier)
    gpipe = replace(balanced_plan("gpipe", 2, [1.0] * 2, 2, 2), policy=("offload",) * 2)
    profile = Profile(1, (PROFILE.layers[0],) * 2, optimizer_seconds_per_byte=0.0)
    assert Costs(gpipe, profile, _cluster(shared_tier=TIER)).copy_links == {0: STORE, 1: STORE}


def test_a_shared_tier_copy_keeps_its_links_cpu_busy_on_the_host():
    """One core for both ranks, two micro-batches: F1 (4 ms from 4) shares the core with
    the CPU of write 0 and of take 0, `shared_tier.cpu` times their 2.5 ms each, so it
    ends later with cpu 2 than with 1; the store's `cpu` plays no part."""
    plan = balanced_plan("pipefb", 2, [1.0], 2, 2)

    def f1_end(tier_cpu: float, store_cpu: float) -> float:
        one = replace(_cluster(shared_tier=replace(TIER, cpu=tier_cpu)),
                      store=replace(STORE, cpu=store_cpu), host_cores={"box": 1})
        return _spans(simulate(plan, PROFILE, one, 2))["0F1"][1]

    assert f1_end(1.0, 1.0) == f1_end(1.0, 3.0) == pytest.approx(13.001)
    assert f1_end(2.0, 1.0) == pytest.approx(14.751)


# step seconds of these plans on a calibrated-like loopback cluster without the shared
# tier, as main's simulator gave them before it existed
BEFORE = {("pipefb", 2): 0.10590427169200073, ("pipefb", 4): 0.0974905089037032,
          ("gpipe", 2): 0.09775641427904072, ("gpipe", 4): 0.08222524403023379,
          ("1f1b", 2): 0.09565387130177502, ("1f1b", 4): 0.07997697457010096,
          ("pipedream", 2): 0.08568283653846143, ("pipedream", 4): 0.0634720901161126}


@pytest.mark.parametrize(("kind", "n"), sorted(BEFORE))
def test_a_cluster_without_the_new_links_is_priced_as_before(kind, n):
    cluster = Cluster(tuple(WorkerSpec(f"w{i}", host="local") for i in range(4)),
                      network=Link(2.6e9, 2.5e-4, 1.15), store=Link(1.3e9, 5.4e-4, 1.3),
                      host_cores={"local": 2}, loopback_hosts=frozenset({"local"}),
                      action_overhead=1.7e-5, step_overhead=4.8e-4, step_cpu=5e-4,
                      busy_send=3.3e-4, host_oversubscribed={"local": 0.95},
                      local_tier=Link(3.9e10, 1.75e-4))
    profile = Profile(1, tuple(LayerProfile(f"l{i}", (1 + i) * MS, 2 * (1 + i) * MS, 1000,
                                            1000, 300_000 * (i + 1), 0) for i in range(4)),
                      optimizer_seconds_per_byte=1e-9)
    plan = replace(balanced_plan(kind, n, [1.0] * 4, 4, 4), policy=("offload",) * 4)
    assert simulate(plan, profile, cluster, 3).step_seconds == pytest.approx(
        BEFORE[(kind, n)], rel=1e-12)


def test_the_shared_tier_reads_from_yaml_and_round_trips():
    data = {"workers": {"count": 2, "host": "box"}, "hosts": [{"name": "box", "cores": 4,
                                                              "loopback": True}],
            "shared_tier": {"bandwidth": "8GB/s", "latency": "1ms", "cpu": 1.2}}
    cluster = Cluster.from_dict(data)
    assert cluster.shared_tier == Link(8e9, pytest.approx(1e-3), 1.2)
    text = cluster.to_dict()
    assert text["shared_tier"] == {"bandwidth": 8e9, "latency": cluster.shared_tier.latency,
                                   "cpu": 1.2}
    assert Cluster.from_dict(text) == cluster
    plain = Cluster.from_dict({"workers": {"count": 1}})
    assert plain.shared_tier is None and "shared_tier" not in plain.to_dict()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("shared_tier", {"latency": "1ms"}, r"cluster\.shared_tier needs a bandwidth"),
    ("shared_tier", {"bandwidth": "fast"}, r"cluster\.shared_tier\.bandwidth = 'fast' is "
                                           "not a number with a unit"),
    ("shared_tier", {"bandwidth": "1GB"}, r"cluster\.shared_tier\.bandwidth = '1GB' has the "
                                          "wrong unit"),
    ("shared_tier", {"bandwidth": 0}, r"cluster\.shared_tier: link bandwidth 0.0 must be > 0"),
    ("shared_tier", {"bandwidth": "1GB/s", "cpu": 0.5}, r"cluster\.shared_tier: link cpu 0.5 "
                                                       "must be"),
    ("shared_tier", {"bandwidth": "1GB/s", "jitter": 1}, r"cluster\.shared_tier has unknown "
                                                         "key 'jitter'"),
    ("shared_tier", "fast", r"cluster\.shared_tier must be a mapping, got str"),
])
def test_a_bad_shared_tier_is_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        Cluster.from_dict({"workers": {"count": 1}, field: value})
