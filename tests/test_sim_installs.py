"""A forward rank's RECV_W copies the pushed weights into its layers after they arrive
([Note: weight installs] in pipefb.sim.costmodel). Expected times are worked out by hand
in the comments (milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefb.plan.partition import balanced_plan
from pipefb.sim.cluster import Cluster, Link, WorkerSpec
from pipefb.sim.costmodel import Costs
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.result import Simulation
from pipefb.sim.simulate import simulate

MS = 1e-3
MB = 1_000_000
PLAN = balanced_plan("pipefb", 2, [1.0], 1, 1)  # rank 0 forward, rank 1 backward
# F 4 ms, B 2 ms, 1 MB of parameters, nothing saved; copying parameters 1 ms per MB
PROFILE = Profile(1, (LayerProfile("l", 4 * MS, 2 * MS, 0, 0, 0, MB),),
                  weight_copy_seconds_per_byte=1e-9)
# two hosts of their own (no shared cores): the hop 1 ms + 1 GB/s, the store instant
CLUSTER = Cluster((WorkerSpec("w0", host="a"), WorkerSpec("w1", host="b")),
                  network=Link(1e9, 1 * MS), store=Link(1e15, 0.0))


def _spans(sim: Simulation, iteration: int) -> dict[str, tuple[float, float]]:
    """label -> (start, end) in ms of one iteration's actions."""
    return {s.label: (round(s.start / MS, 6), round(s.end / MS, 6)) for s in sim.spans
            if s.iteration == iteration}


def test_a_recv_w_copies_the_forward_stages_parameters_after_they_arrive():
    # iteration 0: RECV_W 0-1 (the copy), F0 1-5, SEND_L0 arrives 6 (1 ms latency), B0
    # 6-8, PUSH_W at 8 arrives 8 + 1 + 1 MB / 1 GB/s = 10; iteration 1: RECV_W waits
    # from 5 and copies 10-11, F0 11-15, the loss arrives 16, B0 16-18: a step of 10 ms
    sim = simulate(PLAN, PROFILE, CLUSTER, 2)
    assert Costs(PLAN, PROFILE, CLUSTER).install(0, 0) == pytest.approx(1 * MS)
    first, second = _spans(sim, 0), _spans(sim, 1)
    assert first["0RECV_W"] == pytest.approx((0, 1))
    assert first["0F0"] == pytest.approx((1, 5))
    assert first["0PUSH_W"][1] == pytest.approx(8)
    assert second["0RECV_W"][1] == pytest.approx(11)
    assert second["0F0"] == pytest.approx((11, 15))
    assert sim.step_seconds == pytest.approx(10 * MS)


def test_the_copy_scales_with_the_parameters_and_the_workers_speed():
    # 3 MB at 1 ms per MB on a worker of speed 2: 1.5 ms; the push then takes 1 + 3 ms
    profile = replace(PROFILE, layers=(replace(PROFILE.layers[0], param_bytes=3 * MB),))
    fast = replace(CLUSTER, workers=(replace(CLUSTER.workers[0], speed=2.0),
                                     CLUSTER.workers[1]))
    assert Costs(PLAN, profile, fast).install(0, 0) == pytest.approx(1.5 * MS)
    # F 2 ms at speed 2: 1.5 + 2 + 1 (loss) + 2 (B) + 4 (push) = 10.5 ms a step
    assert simulate(PLAN, profile, fast, 2).step_seconds == pytest.approx(10.5 * MS)


def test_without_a_weight_copy_rate_a_recv_w_costs_only_its_wait():
    # no copy: F0 0-4, the loss arrives 5, B0 5-7, the push arrives 9 and iteration 1's
    # RECV_W ends then: 4 + 1 + 2 + 2 = 9 ms a step
    free = replace(PROFILE, weight_copy_seconds_per_byte=0.0)
    assert simulate(PLAN, free, CLUSTER, 2).step_seconds == pytest.approx(9 * MS)
    assert _spans(simulate(PLAN, free, CLUSTER, 2), 1)["0RECV_W"][1] == pytest.approx(9)
