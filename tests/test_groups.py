"""Group hybrid parallelism: G pipeline groups, data-parallel across groups, gradients summed
by a real gloo all-reduce between worker processes before each optimizer step."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator.client import CoordinatorClient
from coordinator.results import check_groups_agree
from pipefb.app.cli import main
from pipefb.app.local import LocalServices
from pipefb.errors import ConfigError, WorkerFailed
from pipefb.job.config import JobConfig
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import schedule_for
from pipefb.runtime.reference import SingleProcess
from pipefb.runtime.state import weights_digest
from protos import coordinator_pb2
from tests.conftest import worker_threads
from tests.test_async import assert_store_and_versions_empty
from tests.test_transparency import assert_same_training, make_job, run_on_cluster


def test_groups_replicate_the_pipeline_on_consecutive_ranks() -> None:
    plan = balanced_plan("pipefb", 4, [1.0] * 6, batch_size=8, microbatches=4, groups=2)
    assert plan.groups == 2 and plan.microbatches == 2 and plan.microbatch_size == 2
    assert plan.group_ranks() == [[0, 1], [2, 3]]
    assert [(a.rank, a.group, a.role, a.stage) for a in plan.assignment] == [
        (0, 0, "forward", 0), (1, 0, "backward", 0), (2, 1, "forward", 0), (3, 1, "backward", 0)]
    assert plan.topology(1).forward_workers == (2,) and plan.topology(1).backward_workers == (3,)
    schedule = schedule_for(plan)
    assert sorted(schedule) == [0, 1, 2, 3]
    assert [str(a) for a in schedule[2]] == [str(a) for a in schedule[0]]


@pytest.mark.parametrize(("fields", "message"), [
    ({"groups": -1}, "groups -1 must be an integer >= 1"),
    ({"groups": 0}, "groups 0 .auto: the planner picks. needs --plan auto"),
    ({"groups": 3, "workers": 4}, "groups 3 does not divide workers 4"),
    ({"groups": 2, "workers": 4, "microbatches": 3, "batch_size": 6},
     "groups 2 does not divide microbatches 3"),
    ({"check_groups_every": -2}, "check_groups_every -2 must be an integer >= 0"),
    ({"check_groups_every": True}, "check_groups_every True must be an integer >= 0"),
])
def test_bad_group_counts_are_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig(schedule="1f1b", **fields)


# (model, optimizer, schedule, workers, groups): 2 groups of 2 stages, and 2 groups of 1
# stage (plain data parallelism); the cluster fixture has 4 workers. Summing across groups
# changes the order of floating-point additions (each group sums its micro-batches, then
# the groups are summed), so weights agree to rounding, not to the bit: AdamW divides by
# the root of small second moments and turns a few ulps of gradient into weight
# differences well above an ulp (convnet), hence atol 1e-6 there. gpt's attention key bias has a
# gradient that is zero up to rounding, which AdamW scales up to the learning rate: gpt
# uses SGD.
SYNC_RUNS = [("gpt", "sgd", "1f1b", 4, 2), ("mlp", "adamw", "pipefb", 4, 2),
             ("convnet", "adamw", "gpipe", 2, 2), ("gpt", "sgd", "pipefb", 4, 2)]


@pytest.mark.parametrize(("model", "optimizer", "schedule", "workers", "groups"), SYNC_RUNS)
def test_sync_groups_equal_one_process_on_the_full_batch(
        client: Any, cluster: Any, model: str, optimizer: str, schedule: str, workers: int,
        groups: int) -> None:
    job = make_job(model, schedule, workers, optimizer, groups=groups, check_groups_every=1)
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights, atol=1e-6 if optimizer == "adamw" else 1e-7)
    # each group ran half of the micro-batches; both report their losses
    assert all(sorted({w.group for w in r.workers}) == [0, 1] for r in reports)
    assert_groups_identical(reports)
    assert_store_and_versions_empty(cluster, reports)


@pytest.mark.parametrize("schedule", ["pipefb", "pipedream"])
def test_async_groups_keep_identical_weights(client: Any, cluster: Any, schedule: str
                                            ) -> None:
    """Checked on a cadence of 2 steps: after steps 1 and 3 and the last, 4."""
    job = make_job("mlp", schedule, 4, "adamw", mode="async", groups=2, steps=5,
                   check_groups_every=2)
    reports, weights = run_on_cluster(client, job)
    assert [r.step for r in reports] == list(range(5))
    assert_groups_identical(reports, checked=(1, 3, 4))
    if schedule == "pipefb":  # deterministic: equals one process with step k's gradient at k - S
        with worker_threads():
            # one process runs the job's K: all micro-batches stale, as on several groups
            delayed = SingleProcess(replace(job, schedule="single", mode="sync", groups=1,
                                            staleness_microbatches=job.stale_microbatches()),
                                    job.staleness)
            want = [s.loss for s in delayed.run()]
            want_weights = delayed.weights()
        torch.testing.assert_close(torch.tensor([r.loss for r in reports], dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=0)
        for name, value in want_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert_store_and_versions_empty(cluster, reports)


def assert_groups_identical(reports: list[Any], checked: tuple[int, ...] | None = None
                            ) -> None:
    """After each `checked` step (None: every step) each weight-owning rank reported a
    digest, equal across the groups; after the other steps no rank did."""
    for report in reports:
        owners = [w for w in report.workers if w.role != "forward"]
        assert owners
        if checked is not None and report.step not in checked:
            assert not any(w.weights_digest for w in report.workers), report.step
            continue
        assert all(w.weights_digest for w in owners)
        by_stage: dict[int, set[str]] = {}
        for w in owners:
            by_stage.setdefault(w.stage, set()).add(w.weights_digest)
        assert all(len(d) == 1 for d in by_stage.values()), (report.step, by_stage)


def test_groups_one_ulp_apart_fail_the_step_naming_stage_and_ranks() -> None:
    """The digest tells one ulp or a renamed tensor apart; the coordinator's check fails the
    step on differing digests of a stage, or on a weight owner that sent none where another
    did; forward ranks own no weights and send none."""
    weights = {"layers.0.weight": torch.ones(3, 4), "layers.0.bias": torch.zeros(4)}
    apart = {name: t.clone() for name, t in weights.items()}
    apart["layers.0.weight"][1, 2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    renamed = {"layers.1.weight": weights["layers.0.weight"],
               "layers.0.bias": weights["layers.0.bias"]}
    digest = weights_digest({name: t.clone() for name, t in weights.items()})
    assert digest == weights_digest(weights)
    assert digest != weights_digest(apart) and digest != weights_digest(renamed)

    def report(*digests: tuple[int, int, str, int, str]) -> coordinator_pb2.StepReport:
        return coordinator_pb2.StepReport(step=7, workers=[
            coordinator_pb2.WorkerStepStats(rank=r, group=g, role=role, stage=s,
                                            weights_digest=d)
            for r, g, role, s, d in digests])

    forward = (1, 0, "forward", 0, "")
    check_groups_agree(report((0, 0, "backward", 1, digest), (2, 1, "backward", 1, digest),
                              forward))
    check_groups_agree(report((0, 0, "backward", 1, ""), (2, 1, "backward", 1, ""), forward))
    with pytest.raises(WorkerFailed, match=r"groups diverged at step 7: stage 1 weights of "
                                           r"rank 0 \(group 0\) and rank 2 \(group 1\) differ"):
        check_groups_agree(report((0, 0, "backward", 1, digest),
                                  (2, 1, "backward", 1, weights_digest(apart)), forward))
    with pytest.raises(WorkerFailed, match=r"groups unchecked at step 7: rank 2 \(group 1, "
                                           r"stage 1\) sent no weights digest, rank 0 did"):
        check_groups_agree(report((0, 0, "combined", 1, digest), (2, 1, "combined", 1, ""),
                                  forward))


def test_killing_a_group_mid_run_leaves_no_hung_process(tmp_path: Path) -> None:
    """Two groups of one worker (data parallelism) spend most of each short step in the
    all-reduce; SIGKILL one: the job fails naming it, the survivor's all-reduce ends (no
    hang) and the survivor trains the next job with a fresh worker."""
    with LocalServices(2, tmp_path, threads=1) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(2)
        job = make_job("mlp", "gpipe", 2, "sgd", groups=2, steps=100_000)
        stream = client.train(client.submit(job).job_id)
        first = next(stream)
        next(stream)
        names = {w.worker_id: w.name for w in client.workers()}
        victim = names[next(w.worker_id for w in first.workers if w.rank == 1)]
        process = next(p for p in cluster.workers() if p.name == victim)
        os.kill(process.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            for _ in stream:
                pass
        assert time.monotonic() - killed < 60
        assert victim in failed.value.details() and "died" in failed.value.details()
        cluster.add_worker(2).wait_ready()
        deadline = time.monotonic() + 30
        while any(w.name == victim and w.alive for w in client.workers()):
            assert time.monotonic() < deadline, "the killed worker still counts as alive"
            time.sleep(0.2)
        reports, _ = run_on_cluster(client, replace(job, steps=3))
        assert [r.step for r in reports] == [0, 1, 2]


def test_plan_cli_shows_every_group_count_and_can_fix_one(tmp_path: Path, capsys: Any) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("workers: {count: 4, memory: 8GiB}\nnetwork: {bandwidth: 1GB/s, "
                       "latency: 50us}\nstore: {bandwidth: 2GB/s, latency: 100us}\n")
    argv = ["plan", "--model", "mlp", "--dataset", "digits", "--batch-size", "16",
            "--cluster", str(cluster), "--profile", "analytic", "--json",
            "--out", str(tmp_path / "plan")]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["groups"] for row in out["group_candidates"]] == [1, 2, 4]
    chosen = next(r for r in out["group_candidates"] if r["groups"] == out["groups"])
    assert chosen["simulated_ms"] == pytest.approx(out["predicted_step_seconds"] * 1e3)
    assert out["plan"]["groups"] == out["groups"]
    assert main([*argv, "--groups", "2"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["groups"] == 2 and len(fixed["plan"]["assignment"]) == 4
    assert [row["groups"] for row in fixed["group_candidates"]] == [2]
    assert main([*argv, "--groups", "3"]) == 2
    assert "groups 3 does not divide workers" in capsys.readouterr().err


def test_plan_auto_picks_the_groups_and_the_report_names_them(client: Any) -> None:
    """Through the coordinator: plan auto with groups auto profiles, searches every group
    count on the registered workers, and trains the chosen plan."""
    job = make_job("mlp", "auto", 4, "adamw", plan="auto", groups=0, steps=2)
    reports, _ = run_on_cluster(client, job)
    status = client.status(reports[0].job_id)
    planner = json.loads(status.planner_json)
    assert [row["groups"] for row in planner["group_candidates"]] == [1, 2, 4]
    assert status.plan.groups == planner["groups"] >= 1
    assert sorted({w.group for w in reports[0].workers}) == list(range(status.plan.groups))
