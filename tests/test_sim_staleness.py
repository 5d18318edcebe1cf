"""The simulator and the planner follow the job's `staleness_microbatches` K ([Note:
micro-batch staleness] in pipefb.runtime.place): in async PipeFB only a step's first K
forwards run on version k - S, the others wait for the push of version k - S + 1. Every
expected time is worked out by hand in the comments (milliseconds; no overheads, links and
store of ~zero time)."""

from __future__ import annotations

import pytest

from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import Plan
from pipefb.planner.search import search
from pipefb.schedule import Action, Kind, Topology
from pipefb.schedule.deps import requirements
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate
from protos.convert import plan_from_proto, plan_to_proto

MS = 1e-3
CLUSTER = Cluster.uniform(2, network=Link(1e15, 0.0), store=Link(1e15, 0.0))
PROFILE = Profile(1, (LayerProfile("l", 4 * MS, 8 * MS, 0, 0, 0, 0),),
                  optimizer_seconds_per_byte=0.0)  # F 4 ms, B 8 ms, nothing stashed


def _plan(mode: str, k: int) -> Plan:
    """PipeFB on 2 ranks (rank 0 forward, rank 1 backward), one layer, 2 micro-batches of
    1 sample: rank 0 runs RECV_W F0 STASH0 SEND_L0 F1 STASH1 SEND_L1, rank 1 RECV_L0
    FETCH0 B0 RECV_L1 FETCH1 B1 OPT PUSH_W."""
    return balanced_plan("pipefb", 2, [1.0], 2, 2, None, mode, int(mode == "async"), 1, k)


def _ends(sim: Simulation, label: str, rank: int = 0) -> list[float]:
    """When `label` ended on `rank` in each iteration, in ms."""
    return [round(s.end / MS, 6) for s in sorted(sim.spans, key=lambda s: s.iteration)
            if s.rank == rank and s.label == label]


def test_the_first_k_forwards_run_ahead_and_the_rest_wait_for_the_newer_push() -> None:
    # sync: F0 F1 of step t wait for step t-1's push; B0 runs after F0, B1 after B0:
    # 4 + 8 + 8 = 20 ms a step (push t at 20t + 20).
    sync = simulate(_plan("sync", 0), PROFILE, CLUSTER, 4)
    assert sync.step_seconds == pytest.approx(20 * MS)
    assert _ends(sync, "0F1") == [8, 28, 48, 68]
    # K = all (PipeDream-2BW): step t's forwards need step t-2's push only, so rank 0 runs
    # ahead and the backward rank's 16 ms a step is the bound: step 1's F0 F1 run 8-16.
    every = simulate(_plan("async", 0), PROFILE, CLUSTER, 4)
    assert every.step_seconds == pytest.approx(16 * MS)
    assert _ends(every, "0F1")[:2] == [8, 16]
    # K = 1: F0 of step t still runs ahead, but F1 waits for step t-1's push. Rank 1 ends
    # step 0 at 20 (B0 4-12, B1 12-20), so step 1's F1 runs 20-24; B0 of step 1 (its F0
    # ran 8-12) runs 20-28, B1 28-36: push 1 at 36, step 2's F1 36-40 (its F0 24-28, after
    # F1 of step 1), B1 of step 2 44-52, push at 52, step 3's F1 52-56. The backward
    # rank is still the bound, 16 ms a step, and F1 ends 4 ms after each push.
    one = simulate(_plan("async", 1), PROFILE, CLUSTER, 4)
    assert one.step_seconds == pytest.approx(16 * MS)
    assert _ends(one, "0F1") == [8, 24, 40, 56]
    assert _ends(one, "0F0") == [4, 12, 28, 44]
    assert _ends(one, "0PUSH_W", rank=1)[:3] == [20, 36, 52]


def test_a_fresh_forward_requires_the_push_one_step_later_than_the_stale_ones() -> None:
    t = Topology((0, 1), (0, 1), (0,), (1,))  # one layer: rank 0 forward, rank 1 backward
    push = Action(0, Kind.PUSH_W)
    assert (-1, push) in requirements(Action(0, Kind.F, 1), t, 1, 1)
    assert (-1, push) not in requirements(Action(0, Kind.F, 0), t, 1, 1)
    assert (-1, push) not in requirements(Action(0, Kind.F, 1), t, 1, 0)  # K = all


def test_plans_carry_k_only_where_it_leaves_some_forwards_fresh() -> None:
    assert _plan("async", 1).stale_microbatches == 1
    assert _plan("async", 2).stale_microbatches == 0  # K = all micro-batches
    assert _plan("sync", 1).stale_microbatches == 0  # nothing runs stale
    assert balanced_plan("pipedream", 2, [1.0, 1.0], 2, 2, None, "async", 1, 1,
                         1).stale_microbatches == 0  # pipedream stashes, it does not lag
    plan = _plan("async", 1)
    assert plan_from_proto(plan_to_proto(plan)) == plan  # Plan field 420
    with pytest.raises(ConfigError, match=r"^plan stale_microbatches 3 is not in 0\.\.2"):
        Plan(**{**plan.__dict__, "stale_microbatches": 3})


def test_the_planner_predicts_async_pipefb_with_the_jobs_k() -> None:
    profile = Profile(1, (LayerProfile("l", 4 * MS, 8 * MS, 0, 0, 0, 0),) * 2,
                      optimizer_seconds_per_byte=0.0)
    found = search(profile, CLUSTER, 2, schedules=("pipefb",), mode="async", staleness=1,
                   microbatches=[2], stale_microbatches=1)
    assert found.best.plan.stale_microbatches == 1
    again = simulate(found.best.plan, profile, CLUSTER)
    assert found.best.step_seconds == pytest.approx(again.step_seconds)
