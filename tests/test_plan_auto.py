"""plan "auto" on a real local cluster: the coordinator profiles its workers, plans,
simulates, and trains exactly what one process trains; bad requests are refused."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import grpc
import pytest

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.plan.plan import Plan
from pipefb.planner.insitu import STEPS
from pipefb.planner.job import job_cluster, plan_job
from pipefb.sim.cluster import Cluster
from pipefb.sim.costs import Profile
from protos import coordinator_pb2, coordinator_pb2_grpc, server
from protos.convert import plan_from_proto
from protos.security import Security
from tests.test_transparency import assert_same_training, make_job


def test_auto_plan_trains_like_one_process_within_its_cap(client):
    cap = 64 << 20
    job = JobConfig(model="mlp", dataset="digits", schedule="auto", plan="auto", workers=2,
                    batch_size=8, microbatches=4, steps=3, lr=0.01, seed=7, optimizer="sgd",
                    memory_cap=cap)
    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    weights = client.weights(job_id)
    status = client.status(job_id)
    plan = plan_from_proto(status.plan)
    assert plan.schedule in ("gpipe", "1f1b", "pipefb") and plan.mode == "sync"
    assert plan.predicted_step_seconds > 0
    assert 0 < max(plan.predicted_peak_memory_bytes) <= cap
    planner = json.loads(status.planner_json)
    assert planner["candidates"][0]["note"] == ""
    assert planner["predicted_step_seconds"] == pytest.approx(plan.predicted_step_seconds)
    assert len(planner["profile"]["layers"]) == plan.forward_partition[-1]
    assert all(w.peak_memory_bytes <= cap for r in reports for w in r.workers)
    # sync plans train exactly what one process trains on the plan's micro-batches
    assert_same_training(replace(job, schedule="single", plan="", memory_cap=0,
                                 microbatches=plan.microbatches), reports, weights)


def test_a_second_auto_job_reuses_the_workers_profiles(client, cluster):
    """[Note: profile reuse]: the same model, data and sizes planned otherwise are not
    profiled again; the job's planner summary says how many workers' replies it reused."""
    job = JobConfig(model="mlp", dataset="digits", schedule="auto", plan="auto", workers=2,
                    batch_size=8, microbatches=4, steps=1, seed=11)
    planners = []
    for config in (job, replace(job, steps=2, schedule="gpipe", memory_cap=64 << 20)):
        job_id = client.submit(config).job_id
        list(client.train(job_id))
        planners.append(json.loads(client.status(job_id).planner_json))
    assert planners[1]["profiles_reused"] == 2
    assert planners[1]["profile"] == planners[0]["profile"]
    # a worker that registers again (a restarted process at the same address) is asked
    # anew; registering takes the service credential, as a worker has it
    service = Security(service_token=cluster.service_token_file.read_text().strip())
    with server.channel(cluster.coordinator, service) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for w in client.workers():
            stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(
                address=w.address, name=w.name), timeout=10)
    job_id = client.submit(replace(job, steps=3)).job_id
    list(client.train(job_id))
    assert json.loads(client.status(job_id).planner_json)["profiles_reused"] == 0


def test_auto_plan_refuses_an_impossible_cap(client):
    job = JobConfig(model="mlp", dataset="digits", schedule="auto", plan="auto", workers=2,
                    batch_size=8, microbatches=4, steps=1, memory_cap=1000)
    job_id = client.submit(job).job_id
    with pytest.raises(grpc.RpcError):
        list(client.train(job_id))
    status = client.status(job_id)
    assert "no plan fits" in status.error and "cap" in status.error


def _run(client, job: JobConfig) -> tuple[list, dict, object, Plan]:
    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    status = client.status(job_id)
    return reports, client.weights(job_id), status, plan_from_proto(status.plan)


def test_a_binding_cap_changes_the_plan_and_measured_peaks_respect_it(client):
    """Narrow layers and 256 samples: activations outweigh parameters. The cap is below the uncapped
    plan's predicted peak, so the planner must choose differently; every measured peak
    stays under it and training still equals one process."""
    job = JobConfig(model="mlp", dataset="digits", model_config={"hidden": 64, "depth": 4},
                    schedule="auto", plan="auto", workers=2, batch_size=256, steps=4,
                    lr=0.01, seed=7, optimizer="sgd")
    _, _, status, free = _run(client, job)
    peak = max(free.predicted_peak_memory_bytes)
    planner = json.loads(status.planner_json)
    profile = Profile.from_dict(planner["profile"])

    def fits(cap: int) -> bool:
        cluster = job_cluster(Cluster.uniform(2), 2, planner["speeds"], cap)
        try:
            plan_job(replace(job, memory_cap=cap), profile, cluster)
        except ConfigError:
            return False
        return True

    # the lowest of these caps that fits, plus slack: the second job profiles its layers again,
    # and other timings may move a stage boundary (and bytes) a little
    lowest = next((f for f in (0.5, 0.6, 0.7, 0.8) if fits(int(peak * f))), None)
    assert lowest is not None, f"no cap below 80% of the uncapped peak {peak} fits"
    cap = int(peak * (lowest + 0.1))
    capped = replace(job, memory_cap=cap)
    reports, weights, _, plan = _run(client, capped)
    assert max(plan.predicted_peak_memory_bytes) <= cap < peak
    assert (plan.schedule, plan.microbatches, plan.policy, plan.forward_partition) != (
        free.schedule, free.microbatches, free.policy, free.forward_partition)
    measured = [w.peak_memory_bytes for r in reports for w in r.workers]
    assert 0 < max(measured) <= cap, (max(measured), cap)
    assert_same_training(replace(capped, schedule="single", plan="", memory_cap=0,
                                 microbatches=plan.microbatches), reports, weights)


def test_a_capped_job_stashes_off_the_compute_thread_within_its_cap(client):
    """Under a memory cap the forward rank still hands its stashes to the I/O thread
    ([Note: background stash]): its stash bytes in flight show in its memory kinds, the
    planner's peaks count them ([Note: copy lane]) and the writer keeps the rank within
    its predicted peak, every measured peak stays under the cap, and training equals one
    process."""
    cap = 64 << 20
    job = make_job("gpt", "pipefb", 2, "adamw", plan="auto", mode="sync", memory_cap=cap)
    reports, weights, status, plan = _run(client, job)
    assert plan.schedule == "pipefb" and plan.mode == "sync"
    predicted = [int(b) for b in plan.predicted_peak_memory_bytes]
    assert 0 < max(predicted) <= cap
    workers = [w for r in reports for w in r.workers]
    forward = [w for w in workers if w.role == "forward"]
    assert forward and max(w.kind_peak_bytes["stash_in_flight"] for w in forward) > 0
    by_rank = json.loads(status.planner_json)["predicted_peak_memory_by_rank"]
    assert by_rank and all(int(b) <= cap for b in by_rank.values())
    assert all(0 < w.peak_memory_bytes <= cap for w in workers)
    assert all(w.peak_memory_bytes <= int(by_rank[str(w.rank)]) for w in forward)
    assert_same_training(replace(job, schedule="single", plan="", memory_cap=0,
                                 microbatches=plan.microbatches), reports, weights)


def test_in_situ_costs_are_fitted_to_steps_one_to_eight(client):
    """The coordinator fits per-kind factors to steps 1-8 and re-simulates; a loose bound
    (noise on a shared machine must not fail CI; bench/sim_accuracy.py measures it)."""
    job = JobConfig(model="gpt", dataset="text", loss="cross_entropy", schedule="1f1b",
                    plan="auto", workers=2, batch_size=16, microbatches=4, steps=12,
                    model_config={"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32},
                    dataset_config={"block_size": 32, "max_bytes": 200_000}, seed=1)
    reports, _, status, plan = _run(client, job)
    in_situ = json.loads(status.planner_json)["in_situ"]
    assert in_situ["steps"] == len(STEPS) == 8
    assert set(in_situ["factors"]) == {"F", "B", "OPT", "STASH", "latency"}
    assert all(f > 0 for f in in_situ["factors"].values())
    assert in_situ["factors"]["STASH"] == 1.0  # 1f1b keeps everything: nothing stashed
    # steps overlap, so single gaps come in bursts: their mean is the step time
    measured = statistics.mean(r.seconds for r in reports[STEPS.stop:])
    for predicted in (plan.predicted_step_seconds, in_situ["step_seconds"]):
        assert measured / 4 < predicted < measured * 4, (predicted, measured)
