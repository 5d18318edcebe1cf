"""`pipefb submit / status / stop / checkpoint` and the Python client, against a live
coordinator."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from pipefb.app.cli import main
from pipefb.runtime.manifest import committed

JOB = ["--model", "mlp", "--dataset", "digits", "--loss", "cross_entropy", "--schedule", "1f1b",
       "--workers", "2", "--batch-size", "8", "--microbatches", "2", "--optimizer", "sgd",
       "--lr", "0.05"]


def test_submit_follow_then_status(cluster: Any, client: Any,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "--coordinator", cluster.coordinator, *JOB, "--steps", "2",
                 "--job-id", "cli-follow", "--follow"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cli-follow"
    assert [line.split()[:2] for line in out[1:]] == [["step", "0"], ["step", "1"]]
    assert main(["status", "--coordinator", cluster.coordinator, "cli-follow"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "DONE" and status["step"] == "2"
    assert main(["status", "--coordinator", cluster.coordinator]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 4 and all("alive" in r for r in rows)


def test_submit_a_yaml_job_file_and_stop_it(cluster: Any, client: Any, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: mlp\ndataset: digits\nloss: cross_entropy\nschedule: gpipe\n"
                   "workers: 2\nbatch_size: 8\nmicrobatches: 4\nsteps: 100000\n"
                   "optimizer: sgd\nlr: 0.01\njob_id: cli-stop\ncheckpoint_dir: cli-stop\n")
    assert main(["submit", "--coordinator", cluster.coordinator, str(job)]) == 0
    assert capsys.readouterr().out.strip() == "cli-stop"
    deadline = time.monotonic() + 120
    while client.status("cli-stop").step < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    capsys.readouterr()
    assert main(["checkpoint", "--coordinator", cluster.coordinator, "cli-stop"]) == 0
    saved = client.status("cli-stop").checkpointed
    assert saved > 2 and capsys.readouterr().out.strip() == (
        f"cli-stop: checkpoint committed; a resume starts at step {saved} (--resume with "
        "the job's checkpoint directory)")
    assert committed(cluster.checkpoint_root / "cli-stop")[0].step == saved
    assert main(["stop", "--coordinator", cluster.coordinator, "cli-stop"]) == 0
    while client.status("cli-stop").state not in (7, 8, 9) and time.monotonic() < deadline:
        time.sleep(0.1)
    status = client.status("cli-stop")
    assert status.state == 9  # STOPPED
    assert 2 <= status.step < 100000
    with pytest.raises(grpc.RpcError) as info:
        client.weights("cli-stop")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_unknown_job_and_duplicate_id(cluster: Any, client: Any,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--coordinator", cluster.coordinator, "no-such-job"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["submit", "--coordinator", cluster.coordinator, *JOB, "--steps", "1",
                 "--job-id", "dup"]) == 0
    assert main(["submit", "--coordinator", cluster.coordinator, *JOB, "--steps", "1",
                 "--job-id", "dup"]) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    list(client.train("dup"))


def test_bad_job_is_refused_with_invalid_argument(cluster: Any,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "--coordinator", cluster.coordinator, *JOB, "--steps", "1",
                 "--workers", "9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pipefb: INVALID_ARGUMENT") and "9 workers" in err
