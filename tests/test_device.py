"""`--device cuda`: workers and the single process compute on a CUDA device, and report the
CUDA allocator's statistics beside the accounted memory; machines without CUDA refuse it.

The CUDA tests run where a GPU is present (several worker processes share it) and skip
elsewhere; the refusals run where there is none.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_store import job_pattern
from pipefb.app.cli import main
from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.memory import DEVICE_STATS
from pipefb.runtime.reference import SingleProcess
from protos.convert import job_from_proto, job_to_proto
from tests.conftest import store_client
from tests.test_transparency import make_job, run_on_cluster

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
needs_no_cuda = pytest.mark.skipif(CUDA, reason="this machine has a CUDA device")
SUBMIT = ["--model", "mlp", "--dataset", "digits", "--loss", "cross_entropy", "--schedule",
          "gpipe", "--workers", "2", "--batch-size", "8", "--microbatches", "4", "--steps", "1",
          "--optimizer", "sgd", "--lr", "0.1"]


def test_device_is_validated_and_travels_in_the_job_spec() -> None:
    with pytest.raises(ConfigError, match="'tpu'"):
        JobConfig(device="tpu")
    job = JobConfig(device="cuda", schedule="gpipe", workers=2)
    assert job_from_proto(job_to_proto(job)).device == "cuda"
    assert job_from_proto(job_to_proto(JobConfig())).device == "cpu"


def test_an_unknown_device_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["local", "train", *SUBMIT, "--device", "tpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tpu'" in err


@needs_no_cuda
def test_local_cuda_without_a_gpu_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "train", *SUBMIT, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "device 'cuda'" in err and "no CUDA device" in err


@needs_no_cuda
def test_cuda_job_on_cpu_workers_fails_naming_the_worker(
        cluster: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The coordinator accepts the job (it may have no GPU itself); the workers refuse it
    at assignment, and the job fails with their reason. The cluster keeps serving."""
    assert main(["submit", "--coordinator", cluster.coordinator, *SUBMIT, "--device", "cuda",
                 "--job-id", "cuda-on-cpu", "--follow"]) == 1
    err = capsys.readouterr().err
    assert "rank" in err and "no CUDA device" in err, err
    reports, _ = run_on_cluster(client, make_job("mlp", "gpipe", 2, "sgd"))
    assert len(reports) == 3


# -- on a GPU ------------------------------------------------------------------------------

CUDA_RUNS = [  # (model, schedule, workers, optimizer, extra)
    ("mlp", "gpipe", 2, "sgd", {}),
    ("gpt", "1f1b", 4, "adamw", {}),
    ("gpt", "pipefb", 4, "adamw", {}),
    ("gpt", "pipefb", 2, "adamw", {"policy": "recompute"}),
    ("convnet", "1f1b", 3, "sgd", {"policy": "offload"}),
]


def cuda_reference(job: JobConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    single = SingleProcess(replace(job, schedule="single"))
    return [s.loss for s in single.run()], single.weights()


@needs_cuda
@pytest.mark.parametrize(("model", "schedule", "workers", "optimizer", "extra"), CUDA_RUNS)
def test_cuda_pipeline_equals_cuda_single_process(
        client: Any, cluster: Any, model: str, schedule: str, workers: int, optimizer: str,
        extra: dict[str, Any]) -> None:
    job = make_job(model, schedule, workers, optimizer, device="cuda", **extra)
    reports, weights = run_on_cluster(client, job)
    want_losses, want_weights = cuda_reference(job)
    torch.testing.assert_close(torch.tensor([r.loss for r in reports], dtype=torch.float64),
                               torch.tensor(want_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert sorted(weights) == sorted(want_weights)
    for name, want in want_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert list(store_client(cluster).scan_iter(match=job_pattern(reports[0].job_id))) == []
    for report in reports:
        for w in report.workers:
            assert_device_stats(dict(w.device_memory_bytes), w.peak_memory_bytes)


def assert_device_stats(stats: dict[str, int], accounted_peak: int) -> None:
    """The allocator saw at least what the runtime holds: the accounted tensors all live
    on the device, and the allocator also counts temporaries and block rounding."""
    assert sorted(stats) == sorted(DEVICE_STATS)
    assert accounted_peak <= stats["allocated_peak"] <= stats["reserved_peak"]
    assert 0 < stats["allocated"] <= stats["allocated_peak"]


@needs_cuda
def test_cuda_single_is_close_to_cpu_single() -> None:
    """The same job on both devices: equal up to the kernels' rounding."""
    job = make_job("gpt", "single", 1, "adamw")
    cpu_losses, cpu_weights = cuda_reference(job)
    gpu_losses, gpu_weights = cuda_reference(replace(job, device="cuda"))
    torch.testing.assert_close(gpu_losses, cpu_losses, rtol=1e-4, atol=1e-5)
    for name, want in cpu_weights.items():
        torch.testing.assert_close(gpu_weights[name], want, rtol=1e-3, atol=1e-4, msg=name)


@needs_cuda
def test_local_train_on_cuda_reports_allocator_peaks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["local", "train", *SUBMIT, "--steps", "2", "--device", "cuda", "--out",
                 str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    device = report["device"]
    assert device["type"] == "cuda" and device["name"]
    assert sorted(device["peak_allocated_bytes"]) == ["0", "1"]
    for rank, peak in report["peak_memory_bytes"].items():
        assert peak <= device["peak_allocated_bytes"][rank] <= device["peak_reserved_bytes"][rank]
    for step in report["steps"]:
        for w in step["workers"]:
            assert_device_stats(w["device_memory_bytes"], w["peak_memory_bytes"])
