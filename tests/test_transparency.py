"""The top acceptance test: pipelines over loopback gRPC, real Redis and real worker processes
give the same per-step losses and final weights as one process (`--schedule single`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from offload_store import job_pattern
from pipefb.job.config import JobConfig
from pipefb.runtime.reference import SingleProcess
from tests.conftest import store_client, worker_threads

MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"model": "mlp", "dataset": "digits", "loss": "cross_entropy",
            "model_config": {"hidden": 32, "depth": 3}},
    "gpt": {"model": "gpt", "dataset": "text", "loss": "cross_entropy",
            "model_config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16},
            "dataset_config": {"block_size": 16, "max_bytes": 200_000}},
    "convnet": {"model": "convnet", "dataset": "digits", "loss": "cross_entropy"},
}
# (schedule, workers, optimizer): every schedule with 2, 3 and 4 workers and both optimizers.
RUNS = [
    ("gpipe", 2, "sgd"), ("gpipe", 4, "adamw"),
    ("1f1b", 3, "sgd"), ("1f1b", 4, "adamw"),
    ("pipefb", 2, "adamw"), ("pipefb", 3, "sgd"), ("pipefb", 4, "adamw"),
]
STEPS = 3


def make_job(model: str, schedule: str, workers: int, optimizer: str, **extra: Any) -> JobConfig:
    """A short job: 3 steps of 4 micro-batches of 2 samples."""
    lr = 0.05 if optimizer == "sgd" else 0.01
    fields = {"model": model, "lr": lr, "seed": 7, "batch_size": 8, "microbatches": 4,
              "steps": STEPS, **MODELS.get(model, {}), **extra}
    return JobConfig(schedule=schedule, workers=workers, optimizer=optimizer, **fields)


def reference(job: JobConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of the same job in one process, with the workers' threads."""
    with worker_threads():
        single = SingleProcess(replace(job, schedule="single"))
        losses = [s.loss for s in single.run()]
        return losses, single.weights()


def run_on_cluster(client: Any, job: JobConfig) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """Submits the job, follows it to the end, and fetches its weights."""
    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    return reports, client.weights(job_id)


def assert_same_training(job: JobConfig, reports: list[Any], weights: dict[str, torch.Tensor],
                         atol: float = 1e-7) -> None:
    want_losses, want_weights = reference(job)
    got_losses = [r.loss for r in reports]
    torch.testing.assert_close(torch.tensor(got_losses, dtype=torch.float64),
                               torch.tensor(want_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert sorted(weights) == sorted(want_weights)
    for name, want in want_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize(("schedule", "workers", "optimizer"), RUNS)
def test_pipeline_equals_single_process(client: Any, cluster: Any, model: str, schedule: str,
                                        workers: int, optimizer: str) -> None:
    job = make_job(model, schedule, workers, optimizer)
    reports, weights = run_on_cluster(client, job)
    assert [r.step for r in reports] == list(range(STEPS))
    assert_same_training(job, reports, weights)
    store = store_client(cluster)
    assert list(store.scan_iter(match=job_pattern(reports[0].job_id))) == []
    stashed = sum(w.bytes_stashed for r in reports for w in r.workers)
    if schedule == "pipefb":
        assert stashed > 0, "PipeFB must move saved tensors through the offload store"
    else:
        assert stashed == 0


@pytest.mark.parametrize(("schedule", "workers"), [("gpipe", 2), ("1f1b", 3), ("pipefb", 2),
                                                   ("pipefb", 4)])
def test_entry_point_model_trains(client: Any, schedule: str, workers: int) -> None:
    job = make_job("toy", schedule, workers, "adamw", dataset="digits", loss="cross_entropy")
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    assert "layers.1.scale" in weights


@pytest.mark.parametrize(("schedule", "workers", "mode"), [
    ("gpipe", 2, "sync"), ("pipefb", 4, "sync"), ("pipefb", 4, "async")])
def test_a_stage_without_parameters_trains(client: Any, schedule: str, workers: int,
                                           mode: str) -> None:
    """mlp depth 0 is Linear then the loss: each stage holds one layer, so the last stage
    (or its backward worker) owns no parameters and has nothing to update."""
    job = make_job("mlp", schedule, workers, "adamw", model_config={"depth": 0}, mode=mode)
    reports, weights = run_on_cluster(client, job)
    status = client.status(reports[0].job_id)
    assert list(status.plan.forward_partition) == [0, 1, 2]
    if mode == "sync":
        assert_same_training(job, reports, weights)
    else:
        assert [r.step for r in reports] == list(range(STEPS))
        assert all(math.isfinite(r.loss) for r in reports)


# (model, schedule, workers, policy): sync mode under every activation policy, mixed lists
# included (one entry per layer, loss last). mlp depth 3 has 4 layers + loss; gpt 2 blocks
# has embedding, 2 blocks, head + loss; convnet has 4 layers + loss.
POLICY_RUNS = [
    ("mlp", "gpipe", 2, "offload"),
    ("gpt", "gpipe", 3, "recompute"),
    ("gpt", "1f1b", 4, "offload"),
    ("convnet", "1f1b", 2, "recompute"),
    ("gpt", "1f1b", 3, "keep,recompute,recompute,offload,keep"),
    ("gpt", "pipefb", 3, "recompute"),
    ("mlp", "pipefb", 4, "offload,recompute,recompute,offload,recompute"),
]


@pytest.mark.parametrize(("schedule", "workers", "policy"), [
    ("1f1b", 3, "recompute"), ("pipefb", 4, "recompute"), ("gpipe", 2, "offload")])
def test_dropout_is_reproduced_by_recompute_and_offload(client: Any, schedule: str,
                                                        workers: int, policy: str) -> None:
    """Random ops are seeded by (step, micro-batch, layer): a recomputed forward draws the
    same dropout masks as the first, and both equal one process's."""
    config = {**MODELS["gpt"]["model_config"], "dropout": 0.2}
    job = make_job("gpt", schedule, workers, "adamw", policy=policy, model_config=config)
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)


@pytest.mark.parametrize(("model", "schedule", "workers", "policy"), POLICY_RUNS)
def test_every_policy_equals_single_process(client: Any, cluster: Any, model: str, schedule: str,
                                            workers: int, policy: str) -> None:
    job = make_job(model, schedule, workers, "adamw", policy=policy)
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    plan = client.status(reports[0].job_id).plan
    assert len(plan.policy) == len(policy.split(",")) or set(plan.policy) == {policy}
    stashed = sum(w.bytes_stashed for r in reports for w in r.workers)
    # the last stage's offloaded layers stay in the worker ([Note: back-to-back stash])
    before_last = plan.forward_partition[-2] if schedule != "pipefb" else plan.forward_partition[-1]
    assert (stashed > 0) == (schedule == "pipefb" or "offload" in plan.policy[:before_last])
    for w in (w for r in reports for w in r.workers):  # [Note: step metrics]
        on_store = w.action_seconds.get("STASH", 0.0) + w.action_seconds.get("FETCH", 0.0)
        assert dict(w.metrics) == {"store_blocked_seconds": pytest.approx(on_store, rel=1e-9)}
    store = store_client(cluster)
    assert list(store.scan_iter(match=job_pattern(reports[0].job_id))) == []
    assert all(not w.kept_versions for w in reports[-1].workers)


def test_a_later_stage_sends_its_input_gradient_before_its_weight_grads(client: Any) -> None:
    """[Note: input grads first] on stage 1 of 2 (one micro-batch's weight grads may wait):
    its B of micro-batch 0 runs only the input halves, its B of micro-batch 1 (the last)
    runs the input halves, sends, then both micro-batches' weight halves; stage 0 holds the
    last gradient before that B ends. Wide layers make the weight halves take far longer
    than a hop. Training still equals one process."""
    job = JobConfig(model="mlp", dataset="synthetic", loss="mse", schedule="1f1b", workers=2,
                    model_config={"in_features": 256, "hidden": 1024, "depth": 4,
                                  "out_features": 256},
                    dataset_config={"in_features": 256, "out_features": 256},
                    batch_size=512, microbatches=2, steps=STEPS, optimizer="sgd", lr=0.01,
                    seed=7)
    reports, weights = run_on_cluster(client, job)
    for report in reports:
        spans = {s.action: s.end - s.start for w in report.workers for s in w.spans}
        ends = {s.action: s.end for w in report.workers for s in w.spans}
        assert spans["1B1"] > 1.5 * spans["1B0"], (report.step, spans)
        assert ends["0RECV_B1"] < ends["1B1"], report.step
    assert_same_training(job, reports, weights)
