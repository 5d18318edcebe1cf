"""Asynchronous schedules in the IR: PipeDream's leads, async PipeFB's staleness, policies."""

from __future__ import annotations

import pytest

from pipefb.errors import ConfigError, ScheduleError
from pipefb.job.config import JobConfig, layer_policies
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import recompute_runs
from pipefb.schedule import Action, Kind, Topology, dry_run, generate, iteration, lower, validate

THREE = Topology.combined((0, 1, 2, 3))
SPLIT = Topology((0, 2, 4), (0, 1, 4), (0, 1), (2, 3))


def test_pipedream_action_table() -> None:
    got = {w: " ".join(map(str, a)) for w, a in generate("pipedream", THREE, 4).items()}
    assert got == {
        0: "0F2 0B0 0F3 0B1 0F0+1 0B2 0F1+1 0B3 0OPT",
        1: "1F1 1B0 1F2 1B1 1F3 1B2 1F0+1 1B3 1OPT",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2OPT",
    }


def test_pipedream_with_fewer_microbatches_than_stages_leads_a_whole_step() -> None:
    four = Topology.combined((0, 1, 2, 3, 4))
    row = [str(a) for a in generate("pipedream", four, 2)[0]]
    assert row == ["0F0+1", "0B0", "0F1+1", "0B1", "0OPT"]
    validate(lower(generate("pipedream", four, 2), four), four, 2)


def test_lead_round_trips_and_is_refused_where_meaningless() -> None:
    a = Action(0, Kind.SEND_F, 3, lead=1)
    assert str(a) == "0SEND_F3+1" and Action.parse("0SEND_F3+1") == a
    assert a.base == Action(0, Kind.SEND_F, 3)
    for bad in (lambda: Action(0, Kind.B, 0, lead=1), lambda: Action(0, Kind.F, 0, lead=2)):
        with pytest.raises(ScheduleError, match="lead"):
            bad()


def test_iteration_runs_the_prologue_first_and_drops_steps_past_the_end() -> None:
    row = generate("pipedream", THREE, 4)[0]
    first = [f"{a}@{t}" for t, a in iteration(row, 0, 3)]
    assert first[:2] == ["0F0@0", "0F1@0"]  # the prologue: step 0's warm-up forwards
    assert "0F0@1" in first  # the lead forwards of step 1
    last = iteration(row, 2, 3)
    assert all(t == 2 for t, _ in last)  # no action of a step past the end
    assert [a for _, a in last if a.kind is Kind.F] == [Action(0, Kind.F, 2), Action(0, Kind.F, 3)]


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 1), (2, 4), (3, 2), (4, 4), (4, 7)])
@pytest.mark.parametrize("offload", [False, True])
def test_pipedream_validates_and_never_deadlocks(stages: int, microbatches: int,
                                                 offload: bool) -> None:
    topo = Topology.combined(tuple(range(stages + 1)))
    stashing = frozenset(range(stages)) if offload else frozenset()
    lowered = lower(generate("pipedream", topo, microbatches), topo, stashing)
    validate(lowered, topo, microbatches)
    trace = dry_run(lowered, topo, steps=5)
    assert sum(a.kind is Kind.B for _, _, a in trace) == 5 * stages * microbatches


def test_pipedream_runs_the_next_forwards_before_the_optimizer() -> None:
    lowered = lower(generate("pipedream", THREE, 4), THREE)
    ticks = {(w, str(a)): t for w, t, a in dry_run(lowered, THREE, steps=1)}
    assert ticks  # one step: the prologue and no lead forward past the end
    trace = dry_run(lowered, THREE, steps=2)
    order = [str(a) for w, _, a in trace if w == 0]
    assert order.index("0OPT") > order.index("0F1")  # 0F1 of step 1 ran before step 0's OPT
    assert order.count("0F1") == 2 and order.count("0OPT") == 2


def test_validator_catches_a_backward_before_its_unled_forward() -> None:
    bad = generate("pipedream", THREE, 4)
    bad[2] = [Action(2, Kind.B, 0), Action(2, Kind.F, 0), *bad[2][2:]]
    with pytest.raises(ScheduleError, match="before its forward"):
        validate(lower(bad, THREE), THREE, 4)


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_async_pipefb_forwards_run_staleness_steps_ahead(staleness: int) -> None:
    lowered = lower(generate("pipefb", SPLIT, 3), SPLIT)
    validate(lowered, SPLIT, 3, staleness)
    trace = dry_run(lowered, SPLIT, steps=6, staleness=staleness)
    # when forward worker 0 runs its RECV_W of step k, how many OPTs has backward stage 0 run?
    recv = [t for w, t, a in trace if w == 0 and a.kind is Kind.RECV_W]
    opts = [t for w, t, a in trace if a == Action(0, Kind.OPT)]
    for k, tick in enumerate(recv):
        done = sum(t < tick for t in opts)
        assert done >= k - staleness, f"step {k} ran on a version older than {k - staleness}"
    ahead = max(k - sum(t < tick for t in opts) for k, tick in enumerate(recv))
    assert ahead == staleness  # the dry run runs as far ahead as the staleness allows


def test_layer_policies_expand_and_refuse_by_name() -> None:
    job = JobConfig(schedule="1f1b", workers=2, model="mlp", dataset="digits")
    assert layer_policies(job, 3) == ("keep",) * 3
    pipefb_job = JobConfig(schedule="pipefb", workers=2)
    assert layer_policies(pipefb_job, 2) == ("offload",) * 2
    mixed = JobConfig(schedule="1f1b", workers=2, policy="keep, recompute,offload")
    assert layer_policies(mixed, 3) == ("keep", "recompute", "offload")
    cases = [(JobConfig(schedule="pipefb", workers=2, policy="offload,keep,offload"), "layer 1"),
             (JobConfig(schedule="1f1b", workers=2, policy="keep,swap"), "'swap'"),
             (JobConfig(schedule="1f1b", workers=2, policy="keep,keep"), "lists 2 layers")]
    for bad, message in cases:
        with pytest.raises(ConfigError, match=message):
            layer_policies(bad, 3)


def test_modes_are_checked_against_the_schedule() -> None:
    assert JobConfig(schedule="pipedream").mode == "async"
    assert JobConfig(schedule="pipefb").mode == "sync"
    with pytest.raises(ConfigError, match="cannot run in mode 'async'"):
        JobConfig(schedule="1f1b", mode="async")
    with pytest.raises(ConfigError, match="cannot run in mode 'sync'"):
        JobConfig(schedule="pipedream", mode="sync")
    with pytest.raises(ConfigError, match="staleness -1"):
        JobConfig(schedule="pipefb", mode="async", staleness=-1)


def test_recompute_runs_stop_at_stage_boundaries() -> None:
    policy = ("recompute",) * 4 + ("keep", "recompute")
    plan = balanced_plan("1f1b", 2, [1.0] * 6, 4, 2, policy)
    assert plan.forward_partition == (0, 3, 6)
    assert recompute_runs(plan) == {0: 0, 1: 0, 2: 0, 3: 3, 5: 5}
    split = balanced_plan("pipefb", 3, [1.0] * 6, 4, 2, ("recompute",) * 6)
    runs = recompute_runs(split)
    starts = sorted(set(runs.values()))
    assert starts == sorted({0, *split.forward_partition[1:-1], *split.backward_partition[1:-1]})
