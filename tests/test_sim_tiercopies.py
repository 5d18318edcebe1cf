"""A CPU rank that takes back its own stashes in front of the node-local tier copies them on
its compute lane ([Note: tier copies] in pipefb.sim.costmodel), as the workers do
([Note: copies on the compute thread] in offload_store/writer.py); every other rank keeps
its copy lane; the planner offloads there where the copy is cheaper than the forward.
Expected times are worked out by hand in the comments (milliseconds, no overheads)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.plan.stashpath import copies_on_compute_thread, takes_back_own_stash
from pipefb.planner.candidates import SearchSpace
from pipefb.planner.insitu import scaled
from pipefb.planner.search import _Planner
from pipefb.schedule import Action
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.costmodel import Costs
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

MS = 1e-3
MB = 1_000_000
TIER = Link(1e9, 0.0)  # 1 MB: 1 ms to put, 1 ms to take
STORE = Link(1e8, 0.0)  # 1 MB: 10 ms to write, 10 ms to take
BASE = Cluster.uniform(1, network=Link(1e15, 0.0), store=STORE)
CPU_TIER = replace(BASE, local_tier=TIER)
# the copy lane's clusters: on CUDA, or without the tier
LANE = {"cuda with the tier": replace(CPU_TIER, device="cuda"), "cpu without the tier": BASE}


def _one_rank(cluster: Cluster, policy: str = "offload", iterations: int = 1) -> Simulation:
    """One combined rank, one layer of F 4 ms, B 8 ms and 1 MB saved, three micro-batches
    (GPipe): STASH2 and FETCH2 come back to back and move nothing."""
    plan = replace(balanced_plan("gpipe", 1, [1.0], 3, 3), policy=(policy,))
    actions = [Action.parse(x) for x in "0F0 0STASH0 0F1 0STASH1 0F2 0STASH2 0FETCH2 0B2 "
               "0FETCH1 0B1 0FETCH0 0B0 0OPT".split()]
    profile = Profile(1, (LayerProfile("l", 4 * MS, 8 * MS, 0, 0, MB, 0),),
                      optimizer_seconds_per_byte=0.0)
    return simulate(plan, profile, cluster, iterations, schedule={0: actions})


def _spans(sim: Simulation) -> dict[str, tuple[float, float]]:
    return {s.label: (round(s.start / MS, 6), round(s.end / MS, 6)) for s in sim.spans}


def test_the_workers_rule_copies_on_the_compute_thread_only_for_a_private_cpu_rank():
    assert copies_on_compute_thread(True, True, "cpu")
    for private, tier, device in [(False, True, "cpu"), (True, False, "cpu"),
                                  (True, True, "cuda")]:
        assert not copies_on_compute_thread(private, tier, device)
    for kind in ("gpipe", "1f1b", "pipedream"):
        assert all(takes_back_own_stash(balanced_plan(kind, 2, [1.0] * 4, 4, 4), r)
                   for r in (0, 1))
    assert not any(takes_back_own_stash(balanced_plan("pipefb", 4, [1.0] * 4, 4, 4), r)
                   for r in range(4))


def test_a_cpu_private_ranks_stash_and_fetch_run_on_its_compute_lane():
    # F0 0-4, STASH0 puts 1 MB in 4-5, F1 5-9, STASH1 9-10, F2 10-14, STASH2 and FETCH2
    # skipped, B2 14-22, FETCH1 22-23, B1 23-31, FETCH0 31-32, B0 32-40: keep's 36 ms
    # plus four 1 ms copies. Nothing is in flight: the peak is one micro-batch's 1 MB.
    keep = _one_rank(CPU_TIER, "keep")
    sim = _one_rank(CPU_TIER)
    assert keep.step_seconds == pytest.approx(36 * MS)
    assert sim.step_seconds == pytest.approx(40 * MS)
    assert _spans(sim) == {
        "0F0": (0, 4), "0STASH0": (4, 5), "0F1": (5, 9), "0STASH1": (9, 10),
        "0F2": (10, 14), "0STASH2": (14, 14), "0FETCH2": (14, 14), "0B2": (14, 22),
        "0FETCH1": (22, 23), "0B1": (23, 31), "0FETCH0": (31, 32), "0B0": (32, 40),
        "0OPT": (40, 40)}
    assert sim.peak_memory == {0: MB}
    assert sim.peak_memory_by_kind[0]["stash_in_flight"] == 0


def test_on_a_loopback_host_a_tier_copy_is_the_ranks_own_cpu_work_alone():
    """One loopback core whose store traffic keeps two cores busy (`cpu` 2: the worker and
    Redis): a tier copy asks Redis nothing, so no second job shares the core with it and
    the timeline is the one above, 40 ms."""
    one = replace(CPU_TIER, workers=(replace(CPU_TIER.workers[0], host="box"),),
                  host_cores={"box": 1}, loopback_hosts=frozenset({"box"}),
                  store=Link(1e8, 0.0, cpu=2.0))
    sim = _one_rank(one)
    assert sim.step_seconds == pytest.approx(40 * MS)
    assert _spans(sim)["0STASH0"] == pytest.approx((4, 5))


@pytest.mark.parametrize("name", sorted(LANE))
def test_on_cuda_or_without_the_tier_the_stash_keeps_the_copy_lane(name):
    # STASH0 hands 1 MB over at 4 (written 4-14), STASH1 at 8 (written 14-24): the
    # computes run as keep's, F0 0-4, F1 4-8, F2 8-12, B2 12-20; FETCH1 takes its stash
    # back from the writer (20), FETCH0 takes stash 0 from the store in 20-30 beside B1
    # (20-28) and waits for the rest: B0 30-38. At F2's end both writes are in flight:
    # 2 MB beside F2's 1 MB.
    sim = _one_rank(LANE[name])
    assert sim.step_seconds == pytest.approx(38 * MS)
    spans = _spans(sim)
    assert spans["0STASH0"] == (4, 4) and spans["0STASH1"] == (8, 8)
    assert spans["0FETCH1"] == (20, 20) and spans["0FETCH0"] == (28, 30)
    assert sim.peak_memory == {0: 3 * MB}
    assert sim.peak_memory_by_kind[0]["stash_in_flight"] == 2 * MB


@pytest.mark.parametrize("kind", ["1f1b", "pipedream"])
def test_a_cpu_1f1b_or_pipedream_offload_program_copies_on_the_compute_lane(kind):
    """Two ranks, two layers each offloaded (1 MB saved per layer and micro-batch), four
    micro-batches: with the tier on the CPU every STASH and FETCH that moves bytes lasts
    its 2 MB over the tier (2 ms) and none is in flight; the same program on CUDA hands
    them to the copy lane (a STASH costs the compute lane nothing) and counts bytes in
    flight."""
    plan = replace(balanced_plan(kind, 2, [1.0] * 4, 4, 4), policy=("offload",) * 4)
    profile = Profile(1, (LayerProfile("l", 4 * MS, 8 * MS, 0, 0, MB, 0),) * 4,
                      optimizer_seconds_per_byte=0.0)
    two = replace(CPU_TIER, workers=Cluster.uniform(2).workers)
    assert Costs(plan, profile, two).on_compute == {0, 1}
    assert Costs(plan, profile, replace(two, device="cuda")).on_compute == frozenset()
    tier, lane = simulate(plan, profile, two), simulate(plan, profile, replace(two, device="cuda"))
    moved = [s for s in tier.spans if s.action.kind.name in ("STASH", "FETCH")
             and s.end > s.start]
    assert moved and all(s.end - s.start == pytest.approx(2 * MS) for s in moved)
    assert all(tier.peak_memory_by_kind[r]["stash_in_flight"] == 0 for r in (0, 1))
    assert all(s.end == s.start for s in lane.spans if s.action.kind.name == "STASH")
    assert max(lane.peak_memory_by_kind[r]["stash_in_flight"] for r in (0, 1)) > 0


def test_a_pipefb_program_keeps_the_copy_lane_with_the_tier_on_the_cpu():
    plan = balanced_plan("pipefb", 2, [1.0], 2, 2)
    profile = Profile(1, (LayerProfile("l", 4 * MS, 1e-6, 0, 0, 2 * MB, 0),),
                      optimizer_seconds_per_byte=0.0)
    two = replace(BASE, workers=Cluster.uniform(2).workers)
    assert Costs(plan, profile, replace(two, local_tier=TIER)).on_compute == frozenset()
    with_tier = simulate(plan, profile, replace(two, local_tier=TIER), 2)
    without = simulate(plan, profile, two, 2)
    assert with_tier.records == without.records
    assert with_tier.peak_memory_by_kind == without.peak_memory_by_kind
    forward = plan.topology().forward_workers[0]
    assert with_tier.peak_memory_by_kind[forward]["stash_in_flight"] == 2 * MB


@pytest.mark.parametrize(("tier", "device", "offloads"), [
    # a put is 0.03 ms: 16 copies a step on stage 0 add under 2% (nearly free)
    (Link(2e10, 0.0), "cpu", True),
    # 0.3 ms: a put and a take (0.6 ms) cost less than re-running the 1 ms forward
    (Link(2e9, 0.0), "cpu", True),
    # 1.2 ms each: recomputing is cheaper
    (Link(5e8, 0.0), "cpu", False),
    # on CUDA the tier's speed does not matter: the store's round trip (1.2 ms), written
    # on the compute lane (in-flight cap 0), is dearer than the forward
    (Link(2e10, 0.0), "cuda", False),
])
def test_the_planner_offloads_a_cpu_tier_rank_where_its_copy_is_cheaper_than_the_forward(
        tier, device, offloads):
    """GPipe on 2 workers, 4 layers of F 1 ms, B 2 ms and 600 KB saved, 8 micro-batches,
    the cap 5% under keep's peak; the store 1 GB/s with no copy lane to hide it."""
    layer = LayerProfile("l", 1 * MS, 2 * MS, 1000, 1000, 600_000, 0)
    profile = Profile(1, (layer,) * 4, optimizer_seconds_per_byte=0.0)
    cluster = replace(Cluster.uniform(2, network=Link(1e15, 0.0), store=Link(1e9, 0.0)),
                      stash_in_flight_bytes=0, local_tier=tier, device=device)
    keep = _Planner(SearchSpace(profile, cluster, 8, 0)).build("gpipe", "sync", 8, 2,
                                                              ["keep"] * 4)
    base = simulate(keep, profile, cluster)
    cap = base.peak_memory[0] * 0.95 / 0.9
    plan, sim, note = _Planner(SearchSpace(profile, cluster.with_memory(cap), 8, 0)).fit(keep)
    assert note == "" and sim is not None and sim.peak_memory[0] <= cap * 0.9
    if offloads:
        assert "offload" in plan.policy[:2] and "recompute" not in plan.policy
        assert sim.step_seconds < 1.15 * base.step_seconds
    else:
        assert plan.policy[:2] == ("recompute", "recompute")


def test_the_tier_and_device_read_from_yaml_and_round_trip():
    data = {"workers": {"count": 2}, "device": "cuda",
            "local_tier": {"bandwidth": "5GB/s", "latency": "50us"}}
    cluster = Cluster.from_dict(data)
    assert cluster.device == "cuda" and cluster.local_tier is not None
    assert (cluster.local_tier.bandwidth, cluster.local_tier.latency) == (5e9, pytest.approx(5e-5))
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    plain = Cluster.from_dict({"workers": {"count": 1}})
    assert plain.device == "cpu" and plain.local_tier is None
    assert "local_tier" not in plain.to_dict() and "device" not in plain.to_dict()
    with pytest.raises(ConfigError, match=r"cluster device 'tpu' is not one of"):
        Cluster.from_dict({"workers": {"count": 1}, "device": "tpu"})
    with pytest.raises(ConfigError, match=r"cluster\.local_tier needs a bandwidth"):
        Cluster.from_dict({"workers": {"count": 1}, "local_tier": {"latency": "1us"}})


def test_a_job_cluster_takes_the_jobs_device_and_in_situ_scales_the_tier():
    from pipefb.planner.job import job_cluster

    assert job_cluster(CPU_TIER, 1, device="cuda").device == "cuda"
    assert job_cluster(replace(CPU_TIER, device="cuda"), 1).device == "cuda"
    profile = Profile(1, (LayerProfile("l", 1e-3, 2e-3, 0, 0, 1, 0),))
    _, slower = scaled(profile, CPU_TIER, {"STASH": 2.0})
    assert slower.local_tier == Link(TIER.bandwidth / 2, 0.0)
    assert slower.store == Link(STORE.bandwidth / 2, 0.0)
