"""The simulator's copy lane ([Note: copy lane] in pipefb.sim.copylane): stashes leave the
compute lane, fetches are prefetched, bytes in flight are capped; the planner offloads
where the overlap makes it nearly free. Every expected time here is worked out by hand
in the test's comments (milliseconds; no overheads, links of ~zero time)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import lowered_schedule
from pipefb.planner.candidates import SearchSpace
from pipefb.planner.search import _Planner
from pipefb.schedule import Action, Schedule
from pipefb.sim.cluster import STASH_IN_FLIGHT_BYTES, Cluster, Link
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

MS = 1e-3
STORE = Link(1e9, 0.0)  # 1 MB of stash: 1 ms to write, 1 ms to take


def _cluster(workers: int, in_flight: int = STASH_IN_FLIGHT_BYTES) -> Cluster:
    cluster = Cluster.uniform(workers, network=Link(1e15, 0.0), store=STORE)
    return replace(cluster, stash_in_flight_bytes=in_flight)


def _profile(forward: float, backward: float, saved: int, layers: int = 1) -> Profile:
    layer = LayerProfile("l", forward, backward, 0, 0, saved, 0)
    return Profile(1, (layer,) * layers, optimizer_seconds_per_byte=0.0)


def _spans(sim: Simulation, rank: int, iteration: int = 0) -> dict[str, tuple[float, float]]:
    """label -> (start, end) in ms of one rank's actions in one iteration."""
    return {s.label: (round(s.start / MS, 6), round(s.end / MS, 6)) for s in sim.spans
            if s.rank == rank and s.iteration == iteration}


def _combined(in_flight: int, policy: str = "offload") -> Simulation:
    """One combined rank runs F0 STASH0 F1 STASH1 FETCH1 B1 FETCH0 B0 OPT: F 4 ms, B 8 ms,
    a 1 MB stash per micro-batch (1 ms each way)."""
    plan = replace(balanced_plan("gpipe", 1, [1.0], 2, 2), policy=(policy,))
    actions = [Action.parse(x) for x in
               "0F0 0STASH0 0F1 0STASH1 0FETCH1 0B1 0FETCH0 0B0 0OPT".split()]
    schedule: Schedule = {0: actions}
    return simulate(plan, _profile(4 * MS, 8 * MS, 1_000_000), _cluster(1, in_flight), 1,
                    schedule=schedule)


def test_a_stash_that_overlaps_compute_adds_nothing_when_the_lane_is_free():
    # The lane writes stash 0 in 4-5 under F1 (4-8); STASH1 and FETCH1 are back to back
    # (skipped: [Note: back-to-back stash]); FETCH0 is prefetched when FETCH1 ends (8) and
    # taken in 8-9 under B1 (8-16): the step is keep's 2 F + 2 B = 24 ms.
    lane = _combined(STASH_IN_FLIGHT_BYTES)
    assert lane.step_seconds == pytest.approx(24 * MS)
    assert _spans(lane, 0) == {"0F0": (0, 4), "0STASH0": (4, 4), "0F1": (4, 8),
                               "0STASH1": (8, 8), "0FETCH1": (8, 8), "0B1": (8, 16),
                               "0FETCH0": (16, 16), "0B0": (16, 24), "0OPT": (24, 24)}
    assert _combined(STASH_IN_FLIGHT_BYTES, "keep").step_seconds == pytest.approx(24 * MS)
    # written on the compute lane (cap 0), stash 0 costs its 1 ms there
    sync = _combined(0)
    assert sync.step_seconds == pytest.approx(25 * MS)
    assert _spans(sync, 0)["0STASH0"] == (4, 5)


def test_on_a_loopback_host_a_copy_takes_cpu_beside_the_compute():
    """The same list on one loopback core: write 0's 1 ms of CPU shares the core with F1
    from 4, so both run at half speed until it is done at 6 and F1 ends at 9; the take of
    stash 0, issued when FETCH1 ends (9), shares the core with B1 until 11, so B1 ends at
    18 and B0 runs 18-26: the copies cost the compute lane their CPU, nothing more."""
    plan = replace(balanced_plan("gpipe", 1, [1.0], 2, 2), policy=("offload",))
    actions = [Action.parse(x) for x in
               "0F0 0STASH0 0F1 0STASH1 0FETCH1 0B1 0FETCH0 0B0 0OPT".split()]
    cluster = replace(_cluster(1), workers=(replace(_cluster(1).workers[0], host="box"),),
                      host_cores={"box": 1}, loopback_hosts=frozenset({"box"}))
    sim = simulate(plan, _profile(4 * MS, 8 * MS, 1_000_000), cluster, 1,
                   schedule={0: actions})
    spans = _spans(sim, 0)
    assert spans["0F1"] == pytest.approx((4, 9))
    assert spans["0B1"] == pytest.approx((9, 18))
    assert spans["0FETCH0"] == pytest.approx((18, 18))  # taken in 9-10
    assert spans["0B0"] == pytest.approx((18, 26))
    assert sim.step_seconds == pytest.approx(26 * MS)


def _split(microbatches: int, forward: float, saved: int, in_flight: int) -> Simulation:
    """PipeFB on a forward and a backward rank, one layer, B 1 us: the forward rank's list
    is RECV_W (F STASH SEND_L) per micro-batch."""
    plan = balanced_plan("pipefb", 2, [1.0], microbatches, microbatches)
    schedule = lowered_schedule(plan)
    forward_rank = plan.topology().forward_workers[0]
    assert [str(a) for a in schedule[forward_rank]] == ["0RECV_W"] + [
        f"0{kind}{m}" for m in range(microbatches) for kind in ("F", "STASH", "SEND_L")]
    return simulate(plan, _profile(forward, 1e-6, saved), _cluster(2, in_flight), 2)


def _flushed(sim: Simulation) -> float:
    """When the forward rank's first iteration ended: its flush waits for its writes, and
    the next iteration's RECV_W span starts there."""
    rank = next(r for r, (role, _) in sim.roles.items() if role == "forward")
    return _spans(sim, rank, 1)["0RECV_W"][0]


@pytest.mark.parametrize(("write_ms", "lane_ms", "sync_ms"), [
    # F0 0-4, write 0 in 4-(4+w); F1 4-8, write 1 from max(8, 4+w): the step's flush waits
    # for it. A 2 ms write fits under F1: 8 + 2 = 10 (on the compute lane 8 + 2 x 2 = 12).
    (2, 10, 12),
    # A 6 ms write is 2 ms longer than F1, so write 1 starts 2 ms late: 8 + 6 + 2 = 16
    # (on the compute lane 8 + 2 x 6 = 20).
    (6, 16, 20),
])
def test_a_stash_longer_than_the_overlap_adds_exactly_the_excess(write_ms, lane_ms, sync_ms):
    saved = write_ms * 1_000_000
    assert _flushed(_split(2, 4 * MS, saved, STASH_IN_FLIGHT_BYTES)) == pytest.approx(lane_ms)
    assert _flushed(_split(2, 4 * MS, saved, 0)) == pytest.approx(sync_ms)


def test_a_forward_ranks_loss_leaves_after_its_stash_is_written():
    # write 0 in 4-6: SEND_L0 is handed over at 4 but leaves at 6; the backward rank's
    # RECV_L0 ends then and its FETCH0 takes the stash in 6-8
    sim = _split(2, 4 * MS, 2_000_000, STASH_IN_FLIGHT_BYTES)
    backward = next(r for r, (role, _) in sim.roles.items() if role == "backward")
    spans = _spans(sim, backward)
    assert spans["0RECV_L0"][1] == pytest.approx(6)
    assert spans["0FETCH0"] == pytest.approx((6, 8))
    # FETCH1 is prefetched once RECV_L1 arrived (write 1 in 8-10), beside B0: B1 waits for
    # the take only (10-12)
    assert spans["0FETCH1"][1] == pytest.approx(12)


def test_bounded_bytes_in_flight_serialise_the_stashes():
    # F 1 ms, 2 ms writes, three micro-batches. Uncapped: writes in 1-3, 3-5, 5-7 while
    # F runs 0-3. A cap of one stash (2 MB): STASH1 at 2 waits for write 0 (ends 3), F2
    # runs 3-4, STASH2 waits for write 1 (ends 5); the flush is at 7 either way.
    free = _split(3, 1 * MS, 2_000_000, STASH_IN_FLIGHT_BYTES)
    capped = _split(3, 1 * MS, 2_000_000, 2_000_000)
    rank = next(r for r, (role, _) in free.roles.items() if role == "forward")
    assert {k: v for k, v in _spans(free, rank).items() if k[1] in "FS"} == {
        "0F0": (0, 1), "0STASH0": (1, 1), "0SEND_L0": (1, 1), "0F1": (1, 2),
        "0STASH1": (2, 2), "0SEND_L1": (2, 2), "0F2": (2, 3), "0STASH2": (3, 3),
        "0SEND_L2": (3, 3)}
    spans = _spans(capped, rank)
    assert spans["0STASH1"] == (2, 3) and spans["0F2"] == (3, 4)
    assert spans["0STASH2"] == (4, 5)
    assert _flushed(free) == _flushed(capped) == pytest.approx(7)
    # bytes in flight are memory until written: at F2's end (3) write 1 and F2's own
    # stash, 4 MB; under the cap one stash at most is in flight
    assert free.peak_memory[rank] == capped.peak_memory[rank] == 4_000_000
    assert free.peak_memory_by_kind[rank]["stash_in_flight"] == 2_000_000
    assert capped.peak_memory_by_kind[rank]["stash_in_flight"] <= 2_000_000


def test_the_in_flight_cap_reads_from_yaml_and_round_trips():
    data = {"workers": {"count": 2}, "store": {"bandwidth": "1GB/s", "in_flight": "64MiB"}}
    cluster = Cluster.from_dict(data)
    assert cluster.stash_in_flight_bytes == 64 << 20
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert Cluster.from_dict({"workers": {"count": 1}}).stash_in_flight_bytes == 256 << 20
    with pytest.raises(ConfigError, match=r"cluster.store.in_flight = '-1MiB'"):
        Cluster.from_dict({"workers": {"count": 1},
                           "store": {"bandwidth": "1GB/s", "in_flight": "-1MiB"}})
    with pytest.raises(ConfigError, match=r"cluster\.store has unknown key 'inflight'"):
        Cluster.from_dict({"workers": {"count": 1},
                           "store": {"bandwidth": "1GB/s", "inflight": 1}})


def test_the_planner_offloads_where_the_overlap_makes_it_nearly_free():
    """GPipe on 2 workers, 4 layers of F 1 ms, B 2 ms and 600 KB saved, 8 micro-batches,
    caps 5% under keep's peak. Costed as a round trip on the compute lane (1.2 ms), an
    offload looks dearer than recomputing the 1 ms forward, and so it is without a copy
    lane; with one the simulation hides it (54.6 ms against keep's 54.0), so stage 0
    offloads. The last stage recomputes either way: its stash and fetch come back to back
    there, so an offload frees nothing."""
    layer = LayerProfile("l", 1 * MS, 2 * MS, 1000, 1000, 600_000, 0)
    profile = Profile(1, (layer,) * 4, optimizer_seconds_per_byte=0.0)
    chosen = {}
    for in_flight in (STASH_IN_FLIGHT_BYTES, 0):
        cluster = _cluster(2, in_flight)
        keep = _Planner(SearchSpace(profile, cluster, 8, 0)).build("gpipe", "sync", 8, 2,
                                                                  ["keep"] * 4)
        peak = simulate(keep, profile, cluster).peak_memory[0]
        planner = _Planner(SearchSpace(profile, cluster.with_memory(peak * 0.95 / 0.9), 8, 0))
        plan, sim, note = planner.fit(keep)
        assert note == "" and sim is not None
        chosen[in_flight] = (plan.policy, sim.step_seconds)
    policy, seconds = chosen[STASH_IN_FLIGHT_BYTES]
    assert policy[0] == "offload" and policy[2:] == ("recompute", "recompute")
    assert chosen[0][0][0] == "recompute"
    assert seconds < chosen[0][1]


def test_a_job_with_a_memory_cap_counts_its_stashes_in_flight_in_its_peaks():
    """Its workers write stashes on the I/O thread too (worker.service), so its plan keeps
    the cluster's lane and each rank's simulated peak counts the bytes in flight: the three
    2 ms writes of `test_bounded_bytes_in_flight_serialise_the_stashes` hold 4 MB at F2's
    end, where stashes written on the compute lane are gone at their STASH's end."""
    from pipefb.planner.job import job_cluster

    capped = job_cluster(_cluster(2), 2, memory_cap=1 << 30)
    assert capped.stash_in_flight_bytes == STASH_IN_FLIGHT_BYTES
    assert [w.memory for w in capped.workers] == [1 << 30] * 2
    assert job_cluster(_cluster(2), 2).stash_in_flight_bytes == STASH_IN_FLIGHT_BYTES
    plan = balanced_plan("pipefb", 2, [1.0], 3, 3)
    profile = _profile(1 * MS, 1e-6, 2_000_000)
    sim = simulate(plan, profile, capped, 2)
    rank = plan.topology().forward_workers[0]
    assert sim.peak_memory[rank] == 4_000_000
    assert sim.peak_memory_by_kind[rank]["stash_in_flight"] == 2_000_000
    on_compute_lane = simulate(plan, profile, replace(capped, stash_in_flight_bytes=0), 2)
    assert on_compute_lane.peak_memory[rank] == 2_000_000
    assert on_compute_lane.peak_memory_by_kind[rank]["stash_in_flight"] == 0
