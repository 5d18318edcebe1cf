"""fp16 jobs on real clusters, on the cpu: sync pipelines equal the one process running
torch's GradScaler under the same autocast, an overflowed step is skipped on every owner and
reported, and the loss scale goes through checkpoints, `--resume` and layer moves.

A first scale of 2**20 (GradScaler's default is 2**16) makes the tiny gpt's float16
gradients overflow on its first steps, and a window of 2 steps lets the scale grow again
within the job, so both of GradScaler's rules run."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from coordinator.metrics import CoordinatorMetrics
from coordinator.registry import Registry
from pipefb.app.cli import main
from pipefb.job.config import JobConfig
from pipefb.runtime.checkpoint import load_rank, rank_file
from pipefb.runtime.lossscale import METADATA_KEY
from pipefb.runtime.reference import SingleProcess
from protos import coordinator_pb2
from protos.convert import job_from_proto, job_to_proto
from tests.conftest import assert_submit_refused, worker_threads
from tests.test_migration import trained_with_a_move
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

FP16: dict[str, Any] = {"precision": "fp16", "initial_loss_scale": 2.0**20,
                        "loss_scale_window": 2, "steps": 6}
# (schedule, workers, groups): combined and split kinds, and two groups
RUNS = [("gpipe", 2, 1), ("1f1b", 3, 1), ("pipefb", 4, 1), ("pipefb", 4, 2)]


def fp16_job(schedule: str, workers: int, groups: int = 1, **extra: Any) -> JobConfig:
    return make_job("gpt", schedule, workers, "adamw", groups=groups, **{**FP16, **extra})


def single_steps(job: JobConfig) -> list[Any]:
    with worker_threads():
        return list(SingleProcess(replace(job, schedule="single", groups=1)).run())


def assert_scale_halves_and_grows(steps: list[Any]) -> None:
    """The steps overflowed and grew: some skipped (each halving the scale), then two
    finite steps in a row doubling it."""
    scales = [s.loss_scale for s in steps]
    assert steps[0].skipped and scales[0] == FP16["initial_loss_scale"] / 2
    assert any(b == 2 * a for a, b in itertools.pairwise(scales))
    assert not all(s.skipped for s in steps)


@pytest.mark.parametrize(("schedule", "workers", "groups"), RUNS)
def test_fp16_pipeline_equals_one_process_with_torchs_grad_scaler(
        client: Any, schedule: str, workers: int, groups: int) -> None:
    job = fp16_job(schedule, workers, groups)
    reports, weights = run_on_cluster(client, job)
    want, want_weights = single_weights(job)
    assert_scale_halves_and_grows(want)
    # every owner skipped the same steps and holds GradScaler's scale after each
    assert [r.skipped for r in reports] == [s.skipped for s in want]
    assert [r.loss_scale for r in reports] == [s.loss_scale for s in want]
    if groups == 1:  # the same kernels on the same numbers: bit for bit
        assert [r.loss for r in reports] == [s.loss for s in want]
        assert sorted(weights) == sorted(want_weights)
        for name, value in want_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    else:  # the groups' all-reduce adds float32 gradients in another order
        assert_same_training(job, reports, weights, atol=1e-6)


def single_weights(job: JobConfig) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """The one process's steps and final weights."""
    with worker_threads():
        single = SingleProcess(replace(job, schedule="single", groups=1))
        steps = list(single.run())
        return steps, single.weights()


def test_fp16_with_clipping_skips_as_one_process_and_reports_an_infinite_norm(
        client: Any) -> None:
    job = fp16_job("1f1b", 4, clip_grad_norm=0.5, lr_schedule="cosine", warmup_steps=1)
    reports, weights = run_on_cluster(client, job)
    want, want_weights = single_weights(job)
    assert [r.skipped for r in reports] == [s.skipped for s in want]
    assert [r.grad_norm for r in reports] == [s.grad_norm for s in want]  # inf where skipped
    assert [r.lr for r in reports] == [s.lr for s in want]
    assert [r.loss for r in reports] == [s.loss for s in want]
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


def test_a_resumed_fp16_job_takes_the_loss_scale_of_its_checkpoint(
        client: Any, cluster: Any) -> None:
    """The 6-step job resumed from its checkpoint of step 3 (the one of step 6 removed)
    goes on with the scale and growth tracker of step 3: the same steps skip, and the
    losses and weights are the uninterrupted job's, bit for bit."""
    job = fp16_job("pipefb", 4, checkpoint_every=3, checkpoint_dir="fp16-whole")
    whole, want = run_on_cluster(client, job)
    root = cluster.checkpoint_root / "fp16-whole"
    _, _, metadata = load_rank(rank_file(root, 3, 3))  # a backward rank's file
    assert json.loads(metadata[METADATA_KEY])["scale"] == whole[2].loss_scale
    shutil.rmtree(root / "step-000006")
    rest, got = run_on_cluster(client, replace(job, resume=True))
    assert [r.step for r in rest] == [3, 4, 5]
    assert [r.skipped for r in rest] == [r.skipped for r in whole[3:]]
    assert [r.loss_scale for r in rest] == [r.loss_scale for r in whole[3:]]
    assert [r.loss for r in rest] == [r.loss for r in whole[3:]]
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_a_moved_fp16_job_keeps_its_loss_scale(client: Any) -> None:
    """A layer move re-assigns every rank with attempt + 1; each owner takes the scale of
    its paused attempt, so training goes on as in one process."""
    job = fp16_job("pipefb", 4, steps=12, job_id="fp16-move")
    reports = trained_with_a_move(client, job)
    want, want_weights = single_weights(job)
    assert [r.step for r in reports] == list(range(job.steps))
    assert [r.skipped for r in reports] == [s.skipped for s in want]
    assert [r.loss_scale for r in reports] == [s.loss_scale for s in want]
    assert [r.loss for r in reports] == [s.loss for s in want]
    weights = client.weights("fp16-move")
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


BAD = [({"initial_loss_scale": -1.0}, "initial_loss_scale -1.0 must be a finite number > 0"),
       ({"initial_loss_scale": float("inf")}, "initial_loss_scale inf must be a finite"),
       ({"loss_scale_window": -3}, "loss_scale_window -3 must be an integer >= 1"),
       ({"precision": "bf16", "initial_loss_scale": 1024.0},
        "initial_loss_scale 1024.0 applies to precision 'fp16' only; this job's is 'bf16'"),
       ({"loss_scale_window": 10}, "loss_scale_window 10 applies to precision 'fp16' only")]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_submit_refuses_bad_loss_scaling_naming_the_value(
        client: Any, fields: dict[str, Any], message: str) -> None:
    assert_submit_refused(client, job_to_proto(make_job("mlp", "1f1b", 2, "sgd")), fields,
                          message)


def test_local_single_fp16_reports_the_skipped_steps_and_the_scale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pipefb local train` on the cpu: report.json has each step's `skipped` and
    `loss_scale` (GradScaler's), and progress says which steps overflowed."""
    code = main(["local", "train", "--schedule", "single", "--model", "mlp", "--dataset",
                 "digits", "--steps", "4", "--batch-size", "8", "--microbatches", "2",
                 "--precision", "fp16", "--initial-loss-scale", str(2.0**40),
                 "--loss-scale-window", "2", "--out", str(tmp_path), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]
    job = JobConfig(model="mlp", dataset="digits", schedule="single", workers=1, steps=4,
                    batch_size=8, microbatches=2, precision="fp16",
                    initial_loss_scale=2.0**40, loss_scale_window=2)
    want = single_steps(job)
    assert [s["skipped"] for s in steps] == [s.skipped for s in want]
    assert [s["loss_scale"] for s in steps] == [s.loss_scale for s in want]
    assert steps[0]["skipped"]
    assert "step 1: the fp16 gradients overflowed" in capsys.readouterr().err


def test_the_loss_scaling_fields_travel_in_the_job_spec() -> None:
    job = JobConfig(precision="fp16", initial_loss_scale=1024.0, loss_scale_window=7)
    assert job_from_proto(job_to_proto(job)) == job
    assert JobConfig.from_dict(job.to_dict()) == job
    spec = job_to_proto(JobConfig(precision="fp16"))
    spec.ClearField("initial_loss_scale")
    spec.ClearField("loss_scale_window")  # unset: GradScaler's defaults
    got = job_from_proto(spec)
    assert (got.initial_loss_scale, got.loss_scale_window) == (2.0**16, 2000)


def test_the_coordinator_exports_the_loss_scale_and_counts_skipped_steps() -> None:
    """`pipefb_job_loss_scale` is the last fp16 step's; `pipefb_job_skipped_steps_total`
    counts its overflowed steps (the store is not read here: no address)."""
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(Registry(), "", registry)
    metrics.job_started("j")
    for step, (skipped, scale) in enumerate([(True, 512.0), (False, 512.0), (True, 256.0)]):
        metrics.step_done(coordinator_pb2.StepReport(job_id="j", step=step, skipped=skipped,
                                                     loss_scale=scale), 0.0)
    labels = {"job": "j"}
    assert registry.get_sample_value("pipefb_job_loss_scale", labels) == 256.0
    assert registry.get_sample_value("pipefb_job_skipped_steps_total", labels) == 2.0
