"""Processor sharing on loopback hosts, and in-situ cost fitting (pipefb.planner.insitu)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

from pipefb.errors import ConfigError
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import lowered_schedule
from pipefb.planner.insitu import (
    FITTED,
    ITERATIONS,
    LATENCY,
    fit,
    measured_kinds,
    scaled,
    simulated_kinds,
)
from pipefb.schedule import Kind
from pipefb.sim.cluster import Cluster, Link, WorkerSpec
from pipefb.sim.costs import uniform_profile
from pipefb.sim.simulate import simulate


def box(n: int, cores: int, *, loopback: bool = False) -> Cluster:
    """`n` workers on one host of `cores` cores; a 1 GB/s, 50 us network and store."""
    return Cluster(tuple(WorkerSpec(f"w{i}", host="box") for i in range(n)),
                   network=Link(1e9, 50e-6), store=Link(1e9, 50e-6),
                   host_cores={"box": cores},
                   loopback_hosts=frozenset({"box"} if loopback else set()))


def test_processor_sharing_stretches_concurrent_computes():
    """Two stages always computing on one core take twice as long as on two."""
    profile = uniform_profile(4, activation=8, params=0)
    plan = balanced_plan("pipedream", 2, [1.0] * 4, 64, 32, mode="async")
    two, one = simulate(plan, profile, box(2, 2)), simulate(plan, profile, box(2, 1))
    assert one.step_seconds == pytest.approx(2 * two.step_seconds, rel=0.05)


def test_loopback_transfers_take_cpu_from_computes():
    """On a loopback host moving bytes costs core time: with big activations and one
    core a step is slower by about the bytes moved over the bandwidth."""
    profile = uniform_profile(4, activation=1 << 20, params=0)  # 1 MiB per sample
    plan = balanced_plan("gpipe", 2, [1.0] * 4, 8, 4)
    links = simulate(plan, profile, box(2, 1))
    cpu = simulate(plan, profile, box(2, 1, loopback=True))
    moved = 2 * 4 * 2 * (1 << 20) / 1e9  # F and B, 4 micro-batches of 2 samples
    assert cpu.step_seconds - links.step_seconds == pytest.approx(moved, rel=0.25)
    assert box(2, 1, loopback=True).on_loopback(0, 1)
    assert not box(2, 1).on_loopback(0, 1)


def test_a_transfer_keeps_link_cpu_cores_busy_on_a_loopback_host():
    """With `cpu` 2 both ends of each transfer take a core for its time: on one core a step
    is slower than with `cpu` 1 by the bytes moved over the bandwidth once more; the store's
    `cpu` likewise stretches stash and fetch, and neither counts where bytes cross links."""
    profile = uniform_profile(4, activation=1 << 20, params=0)  # 1 MiB per sample
    plan = balanced_plan("gpipe", 2, [1.0] * 4, 8, 4)
    one = box(2, 1, loopback=True)
    two = replace(one, network=Link(1e9, 50e-6, cpu=2.0))
    moved = 2 * 4 * 2 * (1 << 20) / 1e9  # F and B, 4 micro-batches of 2 samples
    extra = simulate(plan, profile, two).step_seconds - simulate(plan, profile, one).step_seconds
    assert extra == pytest.approx(moved, rel=0.25)
    offload = balanced_plan("1f1b", 2, [1.0] * 4, 8, 4, policy=["offload"] * 4)
    slower = replace(one, store=Link(1e9, 50e-6, cpu=2.0))
    assert (simulate(offload, profile, slower).step_seconds
            > 1.1 * simulate(offload, profile, one).step_seconds)
    links = box(2, 1)
    assert simulate(offload, profile, replace(links, store=Link(1e9, 50e-6, cpu=2.0))
                    ).step_seconds == simulate(offload, profile, links).step_seconds


def test_each_step_call_takes_step_cpu_from_a_loopback_hosts_cores():
    """[Note: step calls]: on one saturated core each rank's Step call adds its CPU to the
    step; with spare cores, or where the host is not loopback, it costs nothing."""
    profile = uniform_profile(4, activation=8, params=0)
    plan = balanced_plan("pipedream", 2, [1.0] * 4, 64, 32, mode="async")

    def extra(cluster: Cluster) -> float:
        calls = replace(cluster, step_cpu=2e-3)
        return simulate(plan, profile, calls).step_seconds - simulate(
            plan, profile, cluster).step_seconds

    assert extra(box(2, 1, loopback=True)) == pytest.approx(2 * 2e-3, rel=0.05)  # 2 ranks
    assert extra(box(2, 4, loopback=True)) == pytest.approx(0.0, abs=1e-9)
    assert extra(box(2, 1)) == pytest.approx(0.0, abs=1e-9)
    text = replace(box(2, 1, loopback=True), step_cpu=2e-3).to_dict()
    assert text["overheads"]["step_cpu"] == 2e-3
    assert Cluster.from_dict(text).step_cpu == 2e-3
    assert "step_cpu" not in box(2, 1).to_dict()["overheads"]  # the default, 0, is left out


def test_a_send_followed_by_compute_starts_busy_send_later_on_a_loopback_host():
    """[Note: busy senders]: in GPipe with 4 micro-batches the first forward and the first
    backward transfer are followed by compute and gate the other rank's chain, so the step
    grows by 2 x busy_send; a longer delay is cut to the compute after the send;
    where the host is not loopback, or a send is followed by a receive, nothing changes."""
    profile = uniform_profile(4, activation=8, params=0)
    plan = balanced_plan("gpipe", 2, [1.0] * 4, 8, 4)

    def extra(cluster: Cluster, delay: float, on: object = plan) -> float:
        later = replace(cluster, busy_send=delay)
        return (simulate(on, profile, later).step_seconds  # type: ignore[arg-type]
                - simulate(on, profile, cluster).step_seconds)  # type: ignore[arg-type]

    loopback = box(2, 4, loopback=True)
    assert extra(loopback, 1e-4) == pytest.approx(2e-4, rel=1e-6)
    # cut to the compute after the send: a stage's F (2 layers x 2 samples x 1 ms), its B
    assert extra(loopback, 1.0) == pytest.approx(4e-3 + 8e-3, rel=1e-6)
    assert extra(box(2, 4), 1e-4) == pytest.approx(0.0, abs=1e-12)
    one = balanced_plan("gpipe", 2, [1.0] * 4, 2, 1)  # each send is followed by a receive
    assert extra(loopback, 1e-4, one) == pytest.approx(0.0, abs=1e-12)
    text = replace(loopback, busy_send=5e-4).to_dict()
    assert Cluster.from_dict(text).busy_send == 5e-4
    assert "busy_send" not in loopback.to_dict()["overheads"]


def test_a_steps_last_send_starts_at_once_though_the_next_step_computes():
    """[Note: busy senders]: a send followed by compute starts busy_send later, but not a
    step's last send, whose flush waits with the lock free. Rank 0 of an async PipeDream
    here sends the next step's F0 last (after OPT), then begins the next step with F1: that
    hop stays at the link's latency, while step 0's F0, followed by F1, waits busy_send."""
    profile = uniform_profile(4, forward=2e-3, backward=1e-4, activation=8, params=0)
    plan = balanced_plan("pipedream", 2, [1.0] * 4, 8, 4, mode="async")
    schedule = lowered_schedule(plan)
    lead = next(a for a in schedule[0] if a.kind is Kind.SEND_F and a.lead)
    schedule[0] = [a for a in schedule[0] if a != lead] + [lead]
    loopback = box(2, 4, loopback=True)

    def first_hops(cluster: Cluster) -> list[float]:
        """Per step, from rank 0's SEND_F of micro-batch 0 to the end of rank 1's wait."""
        spans = simulate(plan, profile, cluster, 4, schedule=schedule).spans
        sent = {s.step: s.start for s in spans
                if s.rank == 0 and s.action.kind is Kind.SEND_F and s.action.microbatch == 0}
        got = {s.step: s.end for s in spans
               if s.rank == 1 and s.action.kind is Kind.RECV_F and s.action.microbatch == 0}
        return [got[k] - sent[k] for k in sorted(sent)]

    delay = 1e-3  # under F1 (2 layers x 2 ms)
    quick, late = first_hops(loopback), first_hops(replace(loopback, busy_send=delay))
    assert quick == pytest.approx([50e-6] * 4, abs=1e-7)  # the box's link latency
    assert [b - a for a, b in zip(quick, late, strict=True)] == pytest.approx(
        [delay, 0.0, 0.0, 0.0], abs=1e-12)


def test_oversubscribed_cores_do_less_work_in_all():
    """[Note: oversubscribed cores]: two stages always computing on one core whose
    oversubscribed speed is 0.8 take 1/0.8 as long as on one losing nothing; with a core
    each nothing is lost; the value reads back and a bad one is refused by name."""
    profile = uniform_profile(4, activation=8, params=0)
    plan = balanced_plan("pipedream", 2, [1.0] * 4, 64, 32, mode="async")

    def step(cores: int, speed: float) -> float:
        cluster = replace(box(2, cores), host_oversubscribed={"box": speed})
        return simulate(plan, profile, cluster).step_seconds

    assert step(1, 0.8) == pytest.approx(step(1, 1.0) / 0.8, rel=0.02)
    assert step(2, 0.8) == step(2, 1.0)
    text = replace(box(2, 1), host_oversubscribed={"box": 0.9}).to_dict()
    assert text["hosts"] == [{"name": "box", "cores": 1, "oversubscribed": 0.9}]
    assert Cluster.from_dict(text).oversubscribed_of("box") == 0.9
    with pytest.raises(ConfigError, match=r"host 'box': oversubscribed 0.2 must be in 0.5..1"):
        Cluster.from_dict({**text, "hosts": [{"name": "box", "cores": 1,
                                              "oversubscribed": 0.2}]})
    with pytest.raises(ConfigError, match=r"host 'other' has an oversubscribed speed but no"):
        replace(box(2, 1), host_oversubscribed={"other": 0.9})
    with pytest.raises(ConfigError, match=r"hosts\[0\].oversubscribed = 'x' is not a number"):
        Cluster.from_dict({**text, "hosts": [{"name": "box", "oversubscribed": "x"}]})


def test_link_cpu_reads_back_and_is_refused_by_name_when_bad():
    text = replace(box(2, 2, loopback=True), network=Link(1e9, 5e-5, cpu=1.5)).to_dict()
    assert text["network"] == {"bandwidth": 1e9, "latency": 5e-5, "cpu": 1.5}
    assert "cpu" not in text["store"]  # the default, 1, is left out
    assert Cluster.from_dict(text).network.cpu == 1.5
    with pytest.raises(ConfigError, match=r"network.cpu = 'many' is not a number"):
        Cluster.from_dict({**text, "network": {"bandwidth": 1e9, "cpu": "many"}})
    with pytest.raises(ConfigError, match=r"link cpu 0.5 must be a number of cores in 1..8"):
        Cluster.from_dict({**text, "store": {"bandwidth": 1e9, "cpu": 0.5}})


def test_loopback_needs_a_host_with_cores():
    with pytest.raises(ConfigError, match=r"loopback host\(s\) \['x'\]"):
        Cluster(Cluster.uniform(2).workers, loopback_hosts=frozenset({"x"}))
    with pytest.raises(ConfigError, match=r"hosts\[0\].loopback = 'yes'"):
        Cluster.from_dict({"workers": {"count": 2}, "hosts": [{"name": "a", "loopback": "yes"}]})
    text = box(2, 2, loopback=True).to_dict()
    assert text["hosts"] == [{"name": "box", "cores": 2, "loopback": True}]
    assert Cluster.from_dict(text).loopback_hosts == {"box"}


@pytest.mark.parametrize(("schedule", "workers", "cores"), [
    ("gpipe", 2, 2), ("1f1b", 4, 2), ("pipefb", 4, 2), ("pipedream", 3, 4)])
def test_fit_recovers_the_true_costs(schedule: str, workers: int, cores: int):
    """Action times simulated with 'true' costs (forward 1.5x, backward 2x, optimizer 3x,
    store 2x slower than profiled, hops 4x the described latency) give back the cost
    factors and the true step time, which is never fitted directly."""
    profile = uniform_profile(8, forward=2e-4, backward=4e-4, activation=1 << 12,
                              params=1 << 16)
    cluster = box(workers, cores, loopback=True)
    mode = "async" if schedule == "pipedream" else "sync"
    plan = balanced_plan(schedule, workers, [1.0] * 8, 8, 4, mode=mode)
    true = {"F": 1.5, "B": 2.0, "OPT": 3.0, "STASH": 2.0, LATENCY: 4.0}
    truth = simulate(plan, *scaled(profile, cluster, true),
                     ITERATIONS if mode == "sync" else 0)
    measured: dict[str, float] = defaultdict(float)  # what the workers would report
    for span in truth.spans:
        if span.iteration == truth.iterations - 2:
            measured[span.action.kind.name] += span.end - span.start
    got = fit(plan, profile, cluster, measured, rounds=8)
    kinds = simulated_kinds(truth)
    for kind in (*FITTED, LATENCY):
        if kinds[kind] > 0:
            assert got.factors[kind] == pytest.approx(true[kind], rel=0.05), kind
    assert got.step_seconds == pytest.approx(truth.step_seconds, rel=0.03)
    assert simulate(plan, profile, cluster).step_seconds < 0.8 * truth.step_seconds


def test_measured_kinds_folds_fetch_into_stash():
    assert measured_kinds({"F": 1.0, "STASH": 0.25, "FETCH": 0.5, "RECV_F": 9.0,
                           "RECV_W": 1.0, "SEND_F": 3.0}) == {
        "F": 1.0, "B": 0.0, "OPT": 0.0, "STASH": 0.75, LATENCY: 10.0}


def test_scaled_leaves_bytes_alone():
    profile = uniform_profile(3)
    new, cluster = scaled(profile, box(1, 1), {"F": 2.0, "STASH": 4.0})
    assert [x.forward_seconds for x in new.layers] == [2e-3] * 3
    assert [x.backward_seconds for x in new.layers] == [2e-3] * 3
    assert new.layers[0].saved_bytes == profile.layers[0].saved_bytes
    assert cluster.store.bandwidth == 1e9 / 4
    assert replace(new, layers=profile.layers).optimizer_seconds_per_byte == 1e-10
