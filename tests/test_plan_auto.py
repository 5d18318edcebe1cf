"""plan "auto" on a real local cluster: the coordinator profiles its workers, plans,
simulates, and trains exactly what one process trains; bad requests are refused."""

from __future__ import annotations

import json
from dataclasses import replace

import grpc
import pytest

from pipefb.config import JobConfig
from protos.convert import plan_from_proto
from tests.test_transparency import assert_same_training


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


def test_auto_plan_refuses_an_impossible_cap(client):
    job = JobConfig(model="mlp", dataset="digits", schedule="auto", plan="auto", workers=2,
                    batch_size=8, microbatches=4, steps=1, memory_cap=1000)
    job_id = client.submit(job).job_id
    with pytest.raises(grpc.RpcError):
        list(client.train(job_id))
    status = client.status(job_id)
    assert "no plan fits" in status.error and "cap" in status.error
