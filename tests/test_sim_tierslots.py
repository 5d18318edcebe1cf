"""A private rank's stashes past the node-local tier's cap go through the store ([Note:
tier cap] in pipefb.sim.tierslots), as the workers' private stores spill them
([Note: own slots] in offload_store/ownslots.py). Expected times are worked out by hand
in the comments (milliseconds, no overheads): a tier copy is 1 ms per MB, a store copy 10
(`TIER`, `STORE`); `_one_rank` runs GPipe's three micro-batches on one rank, F 4 ms, B 8 ms,
1 MB saved."""

from __future__ import annotations

import functools
import gc
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from offload_store import ownslots, segments
from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import lowered_schedule
from pipefb.sim.cluster import Cluster, Link, WorkerSpec
from pipefb.sim.costmodel import Costs
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.program import _weight_halves_run
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate
from pipefb.sim.tierslots import FREE_SLOTS, TierSlots, tier_slots, views_dropped
from tests.test_sim_tiercopies import CPU_TIER, MB, MS, STORE, TIER, _one_rank


def _spans(sim: Simulation, rank: int = 0, iteration: int = 0
           ) -> dict[str, tuple[float, float]]:
    """label -> (start, end) in ms of one rank's actions in one iteration."""
    return {s.label: (round(s.start / MS, 6), round(s.end / MS, 6)) for s in sim.spans
            if s.rank == rank and s.iteration == iteration}


def _copies(sim: Simulation, rank: int) -> dict[str, float]:
    """label -> ms of each STASH and FETCH of one rank's first iteration that moves bytes."""
    return {label: round(end - start, 6) for label, (start, end) in _spans(sim, rank).items()
            if ("STASH" in label or "FETCH" in label) and end > start}


def test_the_free_slots_kept_are_the_runtimes() -> None:
    assert FREE_SLOTS == ownslots.FREE_SLOTS


def test_a_private_rank_whose_stashes_fit_is_unchanged() -> None:
    # A cap of two stashes holds STASH0's and STASH1's slots (STASH2 moves nothing), and
    # the next step reuses them: the timeline is the tier's, F0 0-4, STASH0 4-5, ... B0
    # 32-40, as with no cap; both slots are the rank's `node_tier`, outside its 1 MB peak.
    uncapped = _one_rank(CPU_TIER, iterations=2)
    assert CPU_TIER.local_tier_bytes == math.inf
    capped = _one_rank(replace(CPU_TIER, local_tier_bytes=2 * MB), iterations=2)
    assert capped.step_seconds == pytest.approx(40 * MS)
    assert capped.records == uncapped.records
    assert capped.peak_memory == uncapped.peak_memory == {0: MB}
    assert capped.peak_node_tier == uncapped.peak_node_tier == {0: 2 * MB}


def test_a_stash_past_the_cap_pays_the_stores_time_for_its_put_and_take() -> None:
    # A cap of 1.5 stashes: STASH0 fills a slot (1 ms); STASH1's would pass the cap, so it
    # goes to the store (10 ms) and FETCH1 takes it from there (10 ms); FETCH0 takes its
    # slot back (1 ms). F0 0-4, STASH0 4-5, F1 5-9, STASH1 9-19, F2 19-23, STASH2 and
    # FETCH2 skipped, B2 23-31, FETCH1 31-41, B1 41-49, FETCH0 49-50, B0 50-58. The next
    # step's STASH0 reuses the freed slot and STASH1 spills again: 58 ms a step. Only the
    # slot is in the tier; the rank's own peak is unchanged.
    sim = _one_rank(replace(CPU_TIER, local_tier_bytes=1.5 * MB), iterations=2)
    assert sim.step_seconds == pytest.approx(58 * MS)
    assert _spans(sim) == {
        "0F0": (0, 4), "0STASH0": (4, 5), "0F1": (5, 9), "0STASH1": (9, 19),
        "0F2": (19, 23), "0STASH2": (23, 23), "0FETCH2": (23, 23), "0B2": (23, 31),
        "0FETCH1": (31, 41), "0B1": (41, 49), "0FETCH0": (49, 50), "0B0": (50, 58),
        "0OPT": (58, 58)}
    second = _spans(sim, iteration=1)
    assert (second["0STASH0"], second["0STASH1"]) == ((62, 63), (67, 77))
    assert sim.peak_memory == {0: MB}
    assert sim.peak_node_tier == {0: MB}
    assert sim.peak_memory_by_kind[0]["stash_in_flight"] == 0


def test_a_cap_of_zero_sends_every_stash_through_the_store() -> None:
    """The workers' --local-tier-bytes 0 is a tier that holds nothing (their unset, -1, is
    half the tmpfs, which the calibrated cluster fills in): every put and take is a store
    copy, still on the compute lane (the rank has no I/O thread). F0 0-4, STASH0 4-14, F1
    14-18, STASH1 18-28, F2 28-32, B2 32-40, FETCH1 40-50, B1 50-58, FETCH0 58-68, B0
    68-76: keep's 36 ms plus four 10 ms copies, nothing in the tier."""
    sim = _one_rank(replace(CPU_TIER, local_tier_bytes=0), iterations=2)
    assert sim.step_seconds == pytest.approx(76 * MS)
    assert _copies(sim, 0) == {"0STASH0": 10, "0STASH1": 10, "0FETCH1": 10, "0FETCH0": 10}
    assert sim.peak_node_tier == {0: 0}


def test_on_a_loopback_host_a_spilled_copy_shares_the_core_with_the_store() -> None:
    """One loopback core whose store copies keep two cores busy (`cpu` 2: the worker and
    Redis), a cap of 1.5 stashes: STASH1's 10 ms job shares the core with Redis's 10 ms
    beside it, both at half speed, 9-29, as FETCH1's in 41-61; the tier copies run alone
    (4-5, 69-70). F2 29-33, B2 33-41, B1 61-69, B0 70-78."""
    one = replace(CPU_TIER, workers=(replace(CPU_TIER.workers[0], host="box"),),
                  host_cores={"box": 1}, loopback_hosts=frozenset({"box"}),
                  store=Link(1e8, 0.0, cpu=2.0), local_tier_bytes=1.5 * MB)
    sim = _one_rank(one)
    assert sim.step_seconds == pytest.approx(78 * MS)
    spans = _spans(sim)
    assert (spans["0STASH0"], spans["0STASH1"]) == ((4, 5), (9, 29))
    assert (spans["0FETCH1"], spans["0FETCH0"], spans["0B0"]) == ((41, 61), (69, 70), (70, 78))


def _two_ranks(cap: float, host: str = "box") -> Simulation:
    """GPipe on two private ranks of one host (two cores), three micro-batches: layer 0
    (rank 0) F 4 ms, layer 1 (rank 1) F 3 ms, both B 8 ms and 1 MB saved."""
    plan = replace(balanced_plan("gpipe", 2, [1.0] * 2, 3, 3), policy=("offload",) * 2)
    profile = Profile(1, (LayerProfile("l0", 4 * MS, 8 * MS, 0, 0, MB, 0),
                          LayerProfile("l1", 3 * MS, 8 * MS, 0, 0, MB, 0)),
                      optimizer_seconds_per_byte=0.0)
    workers = tuple(WorkerSpec(f"w{i}", host=host) for i in range(2))
    cluster = Cluster(workers, network=Link(1e15, 0.0), store=STORE,
                      host_cores={host: 2} if host else {}, local_tier=TIER,
                      local_tier_bytes=cap)
    return simulate(plan, profile, cluster, 1)


def test_the_private_ranks_of_a_host_share_its_tiers_cap() -> None:
    """With 2.5 stashes of room on the host: rank 0's STASH0 (4) and rank 1's (8) fill two
    slots, so rank 0's STASH1 at 9 would pass the cap and goes to the store, as every later
    stash does while both slots wait for their backward. Rank 0: F0 0-4, STASH0 4-5, F1
    5-9, STASH1 9-19, F2 19-23, STASH2 23-33; rank 1: F0 5-8, STASH0 8-9, F1 19-22,
    STASH1 22-32, F2 33-36, STASH2 36-46, FETCH0 46-47, B0 47-55, FETCH1 55-65, B1 65-73,
    FETCH2 73-83, B2 83-91; rank 0 again: FETCH0 55-56, B0 56-64, FETCH1 73-83, B1 83-91,
    FETCH2 91-101, B2 101-109. Alone on hosts of their own each rank has 2.5 stashes of
    room: two slots each, only STASH2 and FETCH2 through the store."""
    shared = _two_ranks(2.5 * MB)
    assert shared.step_seconds == pytest.approx(109 * MS)
    assert _copies(shared, 0) == {"0STASH0": 1, "0STASH1": 10, "0STASH2": 10,
                                  "0FETCH0": 1, "0FETCH1": 10, "0FETCH2": 10}
    assert _copies(shared, 1) == {"1STASH0": 1, "1STASH1": 10, "1STASH2": 10,
                                  "1FETCH0": 1, "1FETCH1": 10, "1FETCH2": 10}
    assert _spans(shared, 1)["1B2"] == (83, 91)
    assert shared.peak_node_tier == {0: MB, 1: MB}
    apart = _two_ranks(2.5 * MB, host="")
    for r in (0, 1):
        assert _copies(apart, r) == {f"{r}STASH0": 1, f"{r}STASH1": 1, f"{r}STASH2": 10,
                                     f"{r}FETCH0": 1, f"{r}FETCH1": 1, f"{r}FETCH2": 10}
    assert _two_ranks(math.inf).step_seconds == pytest.approx(55 * MS)


def test_a_slot_holds_its_room_until_the_weight_halves_that_read_it_ran() -> None:
    """Backward stage 1 of a sync GPipe runs input grads first and lets one micro-batch's
    weight-grad halves wait ([Note: early sends] in pipefb.sim.program): B0 frees no
    slot, B1 the one of micro-batch 0, the last B those of 1 and 2; stage 0 frees its own."""
    plan = balanced_plan("gpipe", 2, [1.0] * 2, 3, 3, policy=["offload"] * 2)
    schedule = lowered_schedule(plan)
    profile = Profile(1, (LayerProfile("l", 4 * MS, 8 * MS, 0, 0, MB, 0),) * 2)
    costs = Costs(plan, profile, replace(CPU_TIER, workers=Cluster.uniform(2).workers))
    b = {r: [i for i, a in enumerate(schedule[r]) if a.kind.name == "B"] for r in (0, 1)}
    late = views_dropped(schedule[1], _weight_halves_run(costs, 1, schedule[1]))
    assert [late[i] for i in b[1]] == [(), (0,), (1, 2)]
    own = views_dropped(schedule[0], _weight_halves_run(costs, 0, schedule[0]))
    assert [own[i] for i in b[0]] == [(0,), (1,), (2,)]


def test_groups_share_a_hosts_cap_by_their_workers_there() -> None:
    plan = balanced_plan("gpipe", 4, [1.0] * 2, 4, 2, policy=["offload"] * 2, groups=2)
    profile = Profile(1, (LayerProfile("l", 4 * MS, 8 * MS, 0, 0, MB, 0),) * 2)
    workers = tuple(WorkerSpec(f"w{i}", host="box") for i in range(4))
    cluster = Cluster(workers, host_cores={"box": 4}, local_tier=TIER, local_tier_bytes=8 * MB)
    costs = Costs(plan, profile, cluster)
    slots = tier_slots(costs, lowered_schedule(plan), {})
    assert slots.tier_of == {0: "box", 1: "box"} and slots.caps == {"box": 4 * MB}
    assert slots.shared


def test_the_slots_decide_as_the_runtimes_own_slots(tmp_path: Path) -> None:
    """Two ranks' `OwnSlots` on one real tier directory and the simulator's `TierSlots`
    run the same random puts, takes and dropped tensors of two stash sizes: every put
    lands in a slot or spills alike, every take finds its slot or not alike, and the
    tier's bytes and each rank's `node_tier` bytes agree after every step. (The seed's
    400 steps make 30 new slots, reuse 29 free ones, drop a rank's free slots of the
    other size to make room 18 times and spill 79 stashes.)"""
    base, cap = segments.private_base(tmp_path / "tier"), 8 * 1024
    folders = {r: functools.cache(functools.partial(segments.job_dir, base, f"j{r}"))
               for r in (0, 1)}
    own = {r: ownslots.OwnSlots(base, 0, cap, folders[r]) for r in (0, 1)}
    sim = TierSlots({0: "host", 1: "host"}, {"host": cap})
    rng = random.Random(7)
    put: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    taken: dict[int, dict[tuple[int, int], object]] = {0: {}, 1: {}}
    for n in range(400):
        r, choice = rng.randrange(2), rng.random()
        if choice < 0.35:
            key, size = (n, 0), rng.choice((1024, 2048))
            got = own[r].put((*key, 0), {0: {"a": torch.zeros(size, dtype=torch.uint8)}})
            assert (got is not None) == sim.put(r, key, size), n
            put[r].append(key)
        elif choice < 0.7 and put[r]:
            key = put[r].pop(rng.randrange(len(put[r])))
            view = own[r].take((*key, 0), {0: ["a"]})
            assert (view is not None) == sim.take(r, key), n
            if view is not None:
                taken[r][key] = view
            del view  # the tensors live in `taken` alone
        elif taken[r]:
            key = rng.choice(sorted(taken[r]))
            del taken[r][key]
            gc.collect()  # the taken tensors go: their slot's finalizer returns it
            sim.views_gone(r, key)
        assert segments.used_bytes(base) == sim.used("host"), n
        assert own[r].held_bytes() == sim.ranks[r].held(), n
    for store in own.values():
        store.close()


def test_the_tiers_cap_reads_from_yaml_and_round_trips() -> None:
    data = {"workers": {"count": 1},
            "local_tier": {"bandwidth": "5GB/s", "latency": "50us", "cap": "1GiB"}}
    cluster = Cluster.from_dict(data)
    assert cluster.local_tier_bytes == 2**30
    assert cluster.to_dict()["local_tier"]["cap"] == 2**30
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    plain = Cluster.from_dict({"workers": {"count": 1}, "local_tier": {"bandwidth": 1e9}})
    assert plain.local_tier_bytes == math.inf and "cap" not in plain.to_dict()["local_tier"]
    with pytest.raises(ConfigError, match=r"cluster\.local_tier\.cap = -1 must be finite"):
        Cluster.from_dict({"workers": {"count": 1},
                           "local_tier": {"bandwidth": 1e9, "cap": -1}})
    with pytest.raises(ConfigError, match=r"cluster\.local_tier\.cap = '1 GB/s' has the "
                                          "wrong unit"):
        Cluster.from_dict({"workers": {"count": 1},
                           "local_tier": {"bandwidth": 1e9, "cap": "1 GB/s"}})
    with pytest.raises(ConfigError, match=r"cluster\.local_tier has unknown key 'bytes'"):
        Cluster.from_dict({"workers": {"count": 1},
                           "local_tier": {"bandwidth": 1e9, "bytes": 5}})
    with pytest.raises(ConfigError, match=r"local tier cap -5 must be >= 0 bytes"):
        replace(CPU_TIER, local_tier_bytes=-5)
