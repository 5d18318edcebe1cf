"""The planner and simulator: exact on known pipelines, near exhaustive search, fast, within
memory caps, and refusing what deadlocks."""

from __future__ import annotations

import gc
import itertools
import json
import math
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefb.app.cli import main
from pipefb.errors import ConfigError, ScheduleError
from pipefb.plan.partition import balanced_plan, partition
from pipefb.plan.plan import Plan, WorkerAssignment, lowered_schedule, schedule_for
from pipefb.planner import search as planner_module
from pipefb.planner.balance import pass_times
from pipefb.planner.candidates import SearchSpace as _Space
from pipefb.planner.candidates import microbatch_choices
from pipefb.planner.search import EVENT_BUDGET, _events, _Planner, search
from pipefb.schedule import Action, Kind
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.costs import LayerProfile, Profile, uniform_profile
from pipefb.sim.result import Span
from pipefb.sim.simulate import simulate

FAST = Cluster.uniform(4, network=Link(1e12, 0.0), store=Link(1e12, 0.0))


def _profile(seed: int, n: int) -> Profile:
    import random

    rng = random.Random(seed)
    layers = tuple(LayerProfile(f"l{i}", rng.uniform(1e-4, 2e-3), rng.uniform(2e-4, 4e-3),
                                rng.randrange(1, 1 << 16), rng.randrange(1, 1 << 16),
                                rng.randrange(1, 1 << 18), rng.randrange(0, 1 << 20))
                   for i in range(n))
    return Profile(2, layers, optimizer_seconds_per_byte=1e-10, optimizer_state_ratio=2.0)


@pytest.mark.parametrize(("schedule", "mode", "expected"), [
    ("gpipe", "sync", 7 * 12e-3),  # (M + S - 1) (F + B), F = 4 ms, B = 8 ms per stage
    ("1f1b", "sync", 7 * 12e-3),
    ("pipedream", "async", 4 * 12e-3),  # no flush: M (F + B)
    ("pipefb", "sync", 16e-3 + 4 * 16e-3 + 16e-3),  # fill, 4 backwards, drain
    ("pipefb", "async", 4 * 16e-3),  # bound by the backward stage
])
def test_simulated_step_matches_the_textbook_formula(schedule, mode, expected):
    profile = uniform_profile(8, forward=1e-3, backward=2e-3, params=0)  # 2 samples per mb
    plan = balanced_plan(schedule, 4, [1.0] * 8, 8, 4, mode=mode, staleness=1)
    sim = simulate(plan, profile, FAST)
    assert sim.step_seconds == pytest.approx(expected, rel=1e-3)  # links: ~0.1 us a hop


def test_simulated_memory_counts_stashed_microbatches():
    profile = uniform_profile(8, activation=1000, params=1000)
    plan = balanced_plan("gpipe", 4, [1.0] * 8, 8, 4)
    sim = simulate(plan, profile, FAST)
    # stage 0: params 2000, grads 2000, AdamW state 4000, 4 micro-batches x 2 layers x
    # saved 2 x 1000 x 2 samples, plus one outgoing activation (2000) at the peak
    stashed = 4 * 2 * 4000
    assert sim.peak_memory_by_kind[0]["stashed"] == stashed
    assert sim.peak_memory[0] == 2000 + 2000 + 4000 + stashed
    one_f = simulate(balanced_plan("1f1b", 4, [1.0] * 8, 8, 4), profile, FAST)
    # stage s holds 4 - s in flight and the weight halves of s waiting ([Note: early sends])
    assert [one_f.peak_memory_by_kind[r]["stashed"] for r in range(4)] == [4 * 2 * 4000] * 4
    assert one_f.peak_memory[0] == sim.peak_memory[0]  # stage 0 holds 4 in both


def test_bad_layer_times_are_refused_by_name():
    with pytest.raises(ConfigError, match=re.escape("'l': forward_seconds = -1.0 must be >= 0")):
        LayerProfile("l", -1.0, 2e-3, 1, 1, 1, 1)
    with pytest.raises(ConfigError, match=re.escape("weight_grad_seconds = 0.003 exceeds")):
        LayerProfile("l", 1e-3, 2e-3, 1, 1, 1, 1, weight_grad_seconds=3e-3)


def test_a_later_stage_sends_before_its_weight_halves_in_simulation():
    """[Note: early sends] on 2 stages of 4 layers, F 8 ms and B 16 ms a stage, half of B
    the weight halves: stage 0 is busy 4 (8 + 16) = 96 ms a step and waits once, after its
    F1, for stage 1's F0 and first input half (8 ms), where it waited for stage 1's whole
    first backward (24 ms): 104 ms instead of (M + S - 1)(F + B) = 120 ms."""
    profile = uniform_profile(8, forward=1e-3, backward=2e-3, params=0)
    early = replace(profile, layers=tuple(replace(x, weight_grad_seconds=1e-3)
                                          for x in profile.layers))
    plan = balanced_plan("1f1b", 2, [1.0] * 8, 8, 4)
    assert simulate(plan, profile, FAST).step_seconds == pytest.approx(120e-3, rel=1e-3)
    sim = simulate(plan, early, FAST)
    assert sim.step_seconds == pytest.approx(104e-3, rel=1e-3)
    spans = {(s.rank, str(s.action)): s for s in sim.spans if s.iteration == 1}
    assert spans[(1, "1B0")].end - spans[(1, "1B0")].start == pytest.approx(8e-3)  # input half
    assert spans[(1, "1B3")].end - spans[(1, "1B3")].start == pytest.approx(24e-3)  # + 2 halves
    assert spans[(0, "0RECV_B3")].end == pytest.approx(spans[(1, "1B3")].end - 16e-3, abs=1e-6)


def test_simulation_finds_a_deadlock_and_names_the_waits():
    plan = balanced_plan("gpipe", 2, [1.0] * 4, 2, 1)
    schedule = schedule_for(plan)
    schedule[1] = [Action(1, Kind.B, 0), *[a for a in schedule[1] if a.kind is not Kind.B]]
    schedule[0] = [a for a in schedule[0] if a.kind is not Kind.RECV_B] + [
        Action(0, Kind.RECV_B, 0)]
    with pytest.raises(ScheduleError, match="deadlock in simulation") as err:
        simulate(plan, uniform_profile(4), FAST, schedule=schedule)
    assert "worker 1, step 0: 1B0 waits for 1F0" in str(err.value)


def test_a_deadlock_names_per_stage_waits_too():
    """Waits on an action of no micro-batch (OPT) and on a weight push are named."""
    plan = balanced_plan("pipefb", 2, [1.0] * 4, 2, 1)
    schedule = {r: [a for a in actions if a.kind is not Kind.OPT]
                for r, actions in lowered_schedule(plan).items()}
    with pytest.raises(ScheduleError, match="deadlock in simulation") as err:
        simulate(plan, uniform_profile(4), FAST, schedule=schedule)
    assert str(err.value).splitlines()[1:] == [
        "  worker 0, step 1: 0RECV_W waits for PUSH_W of backward stage 0 of step 0",
        "  worker 1, step 0: 0PUSH_W waits for 0OPT of step 0"]


def test_shared_cores_slow_concurrent_stages():
    profile = uniform_profile(8)
    plan = balanced_plan("pipedream", 4, [1.0] * 8, 8, 4)
    own = simulate(plan, profile, FAST)
    shared = Cluster(tuple(w.__class__(w.name, host="box") for w in FAST.workers),
                     FAST.network, FAST.store, host_cores={"box": 2})
    both = simulate(plan, profile, shared)
    assert both.step_seconds == pytest.approx(2 * own.step_seconds, rel=0.05)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=9), st.data())
def test_partition_with_speeds_equals_brute_force(costs, data):
    k = data.draw(st.integers(1, len(costs)))
    speeds = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=k, max_size=k))
    got = partition(costs, k, speeds)

    def bottleneck(bounds):
        return max(sum(costs[a:b]) / s for (a, b), s in zip(itertools.pairwise(bounds), speeds,
                                                           strict=True))

    best = min(bottleneck((0, *cuts, len(costs)))
               for cuts in itertools.combinations(range(1, len(costs)), k - 1))
    assert bottleneck(got) == pytest.approx(best)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=9), st.data())
def test_partition_with_cut_costs_equals_brute_force(costs, data):
    """A stage also pays the transfers at its two boundaries (none at the model's ends)."""
    n = len(costs)
    k = data.draw(st.integers(1, n))
    speeds = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=k, max_size=k))
    cut = data.draw(st.lists(st.sampled_from([0, 0, 3, 10, 40]), min_size=n + 1,
                             max_size=n + 1))
    got = partition(costs, k, speeds, cut)

    def bottleneck(bounds):
        return max(sum(costs[a:b]) / s + (cut[a] if 0 < a else 0) + (cut[b] if b < n else 0)
                   for (a, b), s in zip(itertools.pairwise(bounds), speeds, strict=True))

    best = min(bottleneck((0, *cuts, n))
               for cuts in itertools.combinations(range(1, n), k - 1))
    assert bottleneck(got) == pytest.approx(best)


def test_a_dear_boundary_moves_the_cut_and_bad_cut_costs_are_refused():
    costs = [1.0, 1.0, 1.0, 1.0]
    assert partition(costs, 2) == (0, 2, 4)
    # what crosses after layer 2 is dear: the cut moves to the cheapest one that still
    # balances, though the halves are then uneven (3 + 0.2 against 1 + 0.2; after layer 1:
    # 1 + 0.5 against 3 + 0.5)
    assert partition(costs, 2, cuts=[0, 0.5, 5.0, 0.2, 0]) == (0, 3, 4)
    with pytest.raises(ConfigError, match="cut costs"):
        partition(costs, 2, cuts=[0, 1, 2])
    with pytest.raises(ConfigError, match="cut costs"):
        partition(costs, 2, cuts=[0, -1, 0, 0, 0])


def _exhaustive(profile: Profile, cluster: Cluster, batch: int, mode: str) -> float:
    """The best simulated step time over every schedule, micro-batch count, role split and
    pair of partitions, with the planner's policy rule."""
    planner = _Planner(_Space(profile, cluster, batch, 1))
    n, layers = cluster.size, profile.n_layers
    best = math.inf
    for kind in ("gpipe", "1f1b", "pipedream", "pipefb"):
        modes = {"gpipe": ["sync"], "1f1b": ["sync"], "pipedream": ["async"],
                 "pipefb": ["sync", "async"]}[kind]
        if mode not in modes:
            continue
        for m in microbatch_choices(batch, n):
            policy = tuple(planner.initial_policy(kind, m))
            splits = range(1, n) if kind == "pipefb" else [n]
            for n_fwd in splits:
                n_bwd = n - n_fwd if kind == "pipefb" else n
                fwds = [(0, *c, layers) for c in itertools.combinations(range(1, layers),
                                                                        n_fwd - 1)]
                bwds = ([(0, *c, layers) for c in itertools.combinations(range(1, layers),
                                                                         n_bwd - 1)]
                        if kind == "pipefb" else [None])
                for f, b in itertools.product(fwds, bwds):
                    if kind == "pipefb":
                        assign = tuple(WorkerAssignment(r, "forward", r) for r in range(n_fwd)
                                       ) + tuple(WorkerAssignment(n_fwd + s, "backward", s)
                                                 for s in range(n_bwd))
                    else:
                        assign = tuple(WorkerAssignment(r, "combined", r) for r in range(n))
                    plan = Plan(kind, m, batch // m, f, b or f, policy, assign, mode=mode,
                                staleness=1 if kind == "pipefb" and mode == "async" else 0)
                    best = min(best, simulate(plan, profile, cluster, check=False).step_seconds)
    return best


@pytest.mark.parametrize(("seed", "layers", "mode"), [(0, 8, "sync"), (1, 10, "async"),
                                                      (2, 12, "sync")])
def test_planner_is_within_two_percent_of_exhaustive_search(seed, layers, mode):
    profile = _profile(seed, layers)
    cluster = Cluster.uniform(4, network=Link(2e9, 2e-5), store=Link(4e9, 3e-5))
    chosen = search(profile, cluster, 8, mode=mode)
    exhaustive = _exhaustive(profile, cluster, 8, mode)
    assert chosen.best.step_seconds <= exhaustive * 1.02


def test_planning_200_layers_on_64_workers_stays_within_its_event_budget():
    """The work is bounded, not timed (bench/planner.py times it): the
    candidates beyond the first are simulated only while the budget lasts, and boundary
    moves stop at twice the budget."""
    profile = _profile(3, 200)
    result = search(profile, Cluster.uniform(64), 64)
    assert len(result.plan.assignment) == 64
    assert result.plan.forward_partition[-1] == 200
    one = _events(result.plan)
    assert 0 < result.simulated_actions <= 2 * EVENT_BUDGET + 2 * one


@pytest.mark.parametrize("enabled", [True, False])
def test_a_search_pauses_the_collector_and_leaves_it_as_it_found_it(enabled, monkeypatch):
    """[Note: collector]: the search itself runs with the cyclic collector off, and the
    collector is on after it exactly when it was on before."""
    seen: list[bool] = []
    inner = planner_module._search

    def spy(*args: object) -> object:
        seen.append(gc.isenabled())
        return inner(*args)

    monkeypatch.setattr(planner_module, "_search", spy)
    if not enabled:
        gc.disable()
    try:
        result = search(_profile(5, 40), Cluster.uniform(8), 16)
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert seen == [False]
    assert result.plan.forward_partition[-1] == 40


def test_overlapping_searches_keep_the_collector_paused_until_the_last_ends():
    """Two searches in two threads: the first to end leaves the collector off for the
    other, and the last restores it."""
    first, second = planner_module._collector_paused(), planner_module._collector_paused()
    try:
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not gc.isenabled()
        second.__exit__(None, None, None)
        assert gc.isenabled()
    finally:
        gc.enable()


def test_plans_respect_memory_caps_and_switch_policies():
    profile = uniform_profile(12, activation=1 << 20, params=1 << 16)
    free = search(profile, Cluster.uniform(4), 16, schedules=("1f1b",))
    assert set(free.plan.policy) == {"keep"}
    cap = free.simulation.max_peak_memory * 0.6
    capped = search(profile, Cluster.uniform(4, memory=cap), 16, schedules=("1f1b",))
    assert set(capped.plan.policy) - {"keep"}, "a tight cap must offload or recompute"
    assert capped.simulation.max_peak_memory <= cap
    with pytest.raises(ConfigError, match="no plan fits"):
        search(profile, Cluster.uniform(4, memory=1000.0), 16, schedules=("1f1b",))


def test_uneven_layers_get_an_uneven_partition_that_beats_the_even_split():
    layers = [LayerProfile("embed", 8e-3, 16e-3, 1, 1 << 12, 1 << 12, 1 << 22)] + [
        LayerProfile("block", 1e-3, 2e-3, 1 << 12, 1 << 12, 1 << 13, 1 << 16)] * 6 + [
        LayerProfile("head", 8e-3, 16e-3, 1 << 12, 1 << 14, 1 << 14, 1 << 22)]
    profile = Profile(4, tuple(layers), 1e-10, 2.0)
    result = search(profile, FAST, 16, schedules=("1f1b",))
    even = balanced_plan("1f1b", 4, [1.0] * 8, 16, result.plan.microbatches)
    assert result.plan.forward_partition != even.forward_partition
    assert result.best.step_seconds < simulate(even, profile, FAST).step_seconds * 0.95


def test_plan_cli_prints_json_and_writes_the_timeline(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("workers: {count: 2, memory: 8GiB}\nnetwork: {bandwidth: 1GB/s, "
                       "latency: 50us}\nstore: {bandwidth: 2GB/s, latency: 100us}\n")
    code = main(["plan", "--model", "mlp", "--dataset", "digits", "--batch-size", "16",
                 "--cluster", str(cluster), "--profile", "analytic", "--json",
                 "--out", str(tmp_path / "plan")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_step_seconds"] > 0
    assert out["predicted_peak_memory_bytes"] > 0
    plan = Plan.from_dict(out["plan"])
    assert len(plan.assignment) == 2
    assert (tmp_path / "plan" / "timeline.png").stat().st_size > 1000
    assert main(["plan", "--cluster", str(tmp_path / "missing.yaml")]) == 2


def _head_heavy_profile() -> Profile:
    """Three blocks, a head that turns a small input into big logits, and a loss that
    saves those logits (its input): recomputing the loss alone frees nothing."""
    small, big = 1 << 10, 1 << 24
    block = LayerProfile("block", 1e-3, 2e-3, small, small, 4 * small, 1 << 16)
    return Profile(1, (block, block, block,
                       LayerProfile("head", 1e-4, 2e-4, small, big, small, 1 << 16),
                       LayerProfile("loss", 1e-5, 1e-5, big, 4, big, 0)),
                   optimizer_seconds_per_byte=1e-10, optimizer_state_ratio=2.0)


def test_head_and_loss_are_recomputed_as_one_run():
    planner = _Planner(_Space(_head_heavy_profile(), Cluster.uniform(2, store=Link(1e9, 1e-5)),
                              1, 1))
    assert planner.initial_policy("pipefb", 1) == ["offload"] * 3 + ["recompute"] * 2
    plan = balanced_plan("gpipe", 2, [10.0, 10.0, 10.0, 1.0, 1.0], 1, 1)
    assert plan.forward_partition == (0, 2, 5)
    relieved = planner.relieve(plan, {1: 1})
    assert relieved == ["keep"] * 3 + ["recompute"] * 2  # frees the logits for 0.11 ms


def test_the_partition_keeps_a_huge_activation_inside_a_stage():
    """Layer 1's output takes 0.4 s per direction over the 1 GB/s link, layers take 0.3 s:
    the compute-balanced cut after layer 1 would put 0.8 s of transfers on both stages."""
    layers = tuple(LayerProfile(f"l{i}", 0.1, 0.2, 1000, 400_000_000 if i == 1 else 1000, 0,
                                1000) for i in range(4))
    profile = Profile(4, layers, optimizer_seconds_per_byte=0.0, optimizer_state_ratio=0.0)
    cluster = Cluster.uniform(2, network=Link(1e9, 1e-4))
    planner = _Planner(_Space(profile, cluster, 16, 1))
    plan = planner.build("1f1b", "sync", 4, 2, ["keep"] * 4)
    assert plan.forward_partition in ((0, 1, 4), (0, 3, 4))  # not (0, 2, 4)
    even = replace(plan, forward_partition=(0, 2, 4), backward_partition=(0, 2, 4))
    assert simulate(plan, profile, cluster).step_seconds < simulate(
        even, profile, cluster).step_seconds
    four = _Planner(_Space(profile, Cluster.uniform(4, network=Link(1e9, 1e-4)), 16, 1))
    pipefb = four.build("pipefb", "sync", 4, 2, ["offload"] * 4)  # 2 forward, 2 backward
    assert (0, 2, 4) not in (pipefb.forward_partition, pipefb.backward_partition)


@pytest.mark.parametrize("schedules", [("gpipe", "1f1b"), ("1f1b", "gpipe")])
def test_of_two_equally_fast_plans_the_one_with_less_peak_memory_wins(schedules):
    """GPipe and 1F1B take the same (M + S - 1)(F + B) on a uniform pipeline; 1F1B's last
    stage holds one micro-batch where GPipe's holds all of them, so 1F1B is chosen, and
    GPipe's row says why it lost."""
    profile = uniform_profile(8, activation=1000, params=1000)
    result = search(profile, FAST, 8, schedules=schedules, microbatches=[4])
    by_kind = {c.plan.schedule: c for c in result.candidates}
    assert by_kind["gpipe"].step_seconds == pytest.approx(result.best.step_seconds, rel=1e-3)
    gpipe, best = by_kind["gpipe"].peak_memory, result.best.peak_memory
    assert max(gpipe.values()) == max(best.values())  # stage 0 holds 4 in both
    assert sum(gpipe.values()) > sum(best.values())
    assert result.plan.schedule == "1f1b"
    assert by_kind["gpipe"].note.startswith("as fast within 1%")


def test_loading_a_micro_batch_costs_the_first_and_the_loss_stage_forward():
    profile = replace(uniform_profile(8, forward=1e-3, backward=2e-3, params=0),
                      data_seconds=1e-3)  # 2 samples per mb: 4 ms per stage forward
    sim = simulate(balanced_plan("gpipe", 4, [1.0] * 8, 8, 4), profile, FAST)
    forwards = {s.action.stage: s.end - s.start for s in sim.spans if s.action.kind is Kind.F}
    assert forwards == pytest.approx({0: 5e-3, 1: 4e-3, 2: 4e-3, 3: 5e-3})


def test_partitions_balance_loading_on_the_first_and_the_loss_layer():
    profile = replace(uniform_profile(4, forward=1e-3, backward=2e-3, params=0),
                      data_seconds=5e-3)
    store = Link(1e12, 0.0)
    keep = ["keep"] * 4
    combined = pass_times(profile, store, keep, "combined")
    assert combined == pytest.approx([8e-3, 3e-3, 3e-3, 8e-3])  # 1 + 2 ms, + 5 at the ends
    # split passes also move the stash through the store: 0.1 us here
    assert pass_times(profile, store, keep, "forward") == pytest.approx(
        [6e-3, 1e-3, 1e-3, 6e-3], rel=1e-3)
    assert pass_times(profile, store, keep, "backward") == pytest.approx([2e-3] * 4, rel=1e-3)
    one = replace(uniform_profile(1, forward=1e-3, backward=2e-3, params=0), data_seconds=5e-3)
    assert pass_times(one, store, ["keep"], "combined") == pytest.approx([8e-3])  # once


@pytest.mark.parametrize("loopback", [False, True])
def test_a_step_starts_after_its_weight_push_has_left(loopback):
    """The runtime flushes its sends at the end of each step, so a backward-only worker
    whose step ends with PUSH_W starts its next step once the new weights have left (the
    forward worker's RECV_W ends a link's latency later), not when PUSH_W returns
    ([Note: flush])."""
    profile = uniform_profile(4, params=1 << 24)  # 64 MiB of weights: 67 ms at 1 GB/s
    plan = balanced_plan("pipefb", 2, [1.0] * 4, 2, 1)
    hosts = ({"host_cores": {"box": 2}, "loopback_hosts": frozenset({"box"})} if loopback
             else {})
    link = Link(bandwidth=1e9, latency=1e-4)
    cluster = Cluster(tuple(replace(w, host="box" if loopback else w.host)
                            for w in FAST.workers[:2]), link, FAST.store, **hosts)
    left = 0.0 if loopback else link.latency  # a loopback transfer leaves as it arrives
    sim = simulate(plan, profile, cluster, iterations=3)
    backward = next(a.rank for a in plan.assignment if a.role == "backward")
    forward = 1 - backward

    def spans(rank: int, kind: Kind | None, iteration: int) -> list[Span]:
        return [s for s in sim.spans if s.rank == rank and s.iteration == iteration
                and (kind is None or s.action.kind is kind)]

    for k in (0, 1):
        push = spans(backward, Kind.PUSH_W, k)[-1]
        arrived = spans(forward, Kind.RECV_W, k + 1)[0].end
        assert arrived > push.end + 0.06  # the bytes take 67 ms
        next_step = min(s.start for s in spans(backward, None, k + 1))
        assert next_step == pytest.approx(arrived - left, abs=1e-6)


def test_an_opt_costs_the_optimizers_fixed_part_plus_its_bytes_and_nothing_without_params():
    # stage 0 (layers 0-1) owns no parameters; stage 1's two layers own 1 MB each
    layers = (LayerProfile("free", 1e-3, 2e-3, 64, 64, 64, 0),) * 2 + (
        LayerProfile("owned", 1e-3, 2e-3, 64, 64, 64, 1 << 20),) * 2
    profile = Profile(2, layers, optimizer_seconds_per_byte=1e-9, optimizer_fixed_seconds=3e-4,
                      optimizer_state_ratio=2.0)
    plan = balanced_plan("1f1b", 2, [1.0] * 4, 4, 2)
    sim = simulate(plan, profile, Cluster.uniform(2, network=Link(1e12, 0.0)))
    opt = {s.rank: s.end - s.start for s in sim.spans if s.action.kind is Kind.OPT}
    assert opt[0] == pytest.approx(0.0, abs=1e-12)  # the action overhead only: none here
    assert opt[1] == pytest.approx(3e-4 + 1e-9 * (2 << 20))
    assert profile.optimizer_seconds(0) == 0.0
    with pytest.raises(ConfigError, match="optimizer_fixed_seconds = -1"):
        replace(profile, optimizer_fixed_seconds=-1.0)


@pytest.mark.parametrize(("schedule", "mode", "copies"), [
    ("pipedream", "async", {0: True, 1: False}),  # rank 0 forwards step k+1 before its OPT
    ("1f1b", "sync", {0: False, 1: False}),
    ("pipefb", "sync", {2: False, 3: False}),
    ("pipefb", "async", {2: True, 3: True}),  # staleness 1: step k+1 forwards on version k
])
def test_an_opt_that_keeps_the_weights_it_replaces_pays_their_copy(
        schedule: str, mode: str, copies: dict[int, bool]) -> None:
    layer = LayerProfile("owned", 1e-3, 2e-3, 64, 64, 64, 1 << 20)
    profile = Profile(2, (layer,) * 4, optimizer_seconds_per_byte=1e-9,
                      optimizer_fixed_seconds=3e-4, optimizer_state_ratio=2.0,
                      weight_copy_seconds_per_byte=5e-10)
    workers = 4 if schedule == "pipefb" else 2
    plan = balanced_plan(schedule, workers, [1.0] * 4, 4, 2, mode=mode,
                         staleness=1 if mode == "async" and schedule == "pipefb" else 0)
    sim = simulate(plan, profile, Cluster.uniform(workers, network=Link(1e12, 0.0)))
    opt = {s.rank: s.end - s.start for s in sim.spans if s.action.kind is Kind.OPT}
    step = 3e-4 + 1e-9 * (2 << 20)  # each backward stage owns two 1 MB layers
    assert opt == pytest.approx({r: step + (5e-10 * (2 << 20) if copy else 0.0)
                                 for r, copy in copies.items()})
    with pytest.raises(ConfigError, match="weight_copy_seconds_per_byte = -1"):
        replace(profile, weight_copy_seconds_per_byte=-1.0)
