"""Checkpoint integrity under attack ([Note: manifests] in pipefb/runtime/manifest.py): two
jobs at once, flipped bytes, truncated files, another job's files copied in, a NaN loss and
a full disk, each against the real local cluster; what a resume loads is intact and of its
own job, and every failure is one clear line."""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator.ranks import Ranks, diagnose
from coordinator.registry import WorkerRecord
from pipefb.errors import WorkerFailed
from pipefb.runtime.checkpoint import rank_file
from pipefb.runtime.manifest import committed, newest_intact
from protos.coordinator_pb2 import DONE, FAILED
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

# a 2-rank 1F1B job checkpointing after steps 2 and 4; resumed, it runs to step 6
BASE = make_job("mlp", "1f1b", 2, "adamw", lr=0.02, steps=4, checkpoint_every=2)


@pytest.fixture(scope="module")
def trained(client: Any, cluster: Any) -> tuple[Path, list[Any], dict[str, torch.Tensor]]:
    """BASE's checkpoints (steps 2 and 4) in `base/`, and the reports and weights of the
    same job run whole for 6 steps."""
    run_on_cluster(client, replace(BASE, checkpoint_dir="base"))
    whole, weights = run_on_cluster(client, replace(BASE, steps=6, checkpoint_dir="whole"))
    return cluster.checkpoint_root / "base", whole, weights


def _copy(cluster: Any, source: Path, name: str) -> Path:
    """A copy of a checkpoint directory under a new name in the checkpoint root."""
    target = cluster.checkpoint_root / name
    shutil.copytree(source, target)
    return target


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0x01  # a bit in the last tensor's bytes
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-64])


def _foreign_file(path: Path, other: Path) -> None:
    shutil.copyfile(other / "step-000004" / path.name, path)


def _foreign_step(path: Path, other: Path) -> None:
    shutil.rmtree(path.parent)
    shutil.copytree(other / "step-000004", path.parent)


ATTACKS = {
    "flipped": (lambda p, o: _flip(p), "rank-1.safetensors does not match the SHA-256"),
    "truncated": (lambda p, o: _truncate(p), "rank-1.safetensors has"),
    "foreign-file": (_foreign_file, "rank-1.safetensors does not match the SHA-256"),
    "foreign-step": (_foreign_step, "step 4 is of another job: lr 0.01 there, 0.02 here"),
}


@pytest.fixture(scope="module")
def other_job(client: Any, cluster: Any) -> Path:
    """The checkpoints of another job (learning rate 0.01) with the same layout."""
    run_on_cluster(client, replace(BASE, lr=0.01, checkpoint_dir="other"))
    return cluster.checkpoint_root / "other"


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_damaged_newest_checkpoint_is_refused_and_the_older_one_resumes_exactly(
        client: Any, cluster: Any, trained: Any, other_job: Path, attack: str) -> None:
    """Step 4's rank-1 file is altered one way or another: the resume names it, starts
    from step 2 and trains bit for bit what the whole run trained."""
    base, whole, want = trained
    name = f"attack-{attack}"
    root = _copy(cluster, base, name)
    damage, why = ATTACKS[attack]
    damage(rank_file(root, 4, 1), other_job)
    job = replace(BASE, steps=6, resume=True, checkpoint_dir=name)
    job_id = client.submit(job).job_id
    rest = list(client.train(job_id))
    status = client.status(job_id)
    assert status.state == DONE and status.start_step == 2
    assert len(status.refused_checkpoints) == 1 and why in status.refused_checkpoints[0]
    assert status.refused_checkpoints[0].startswith("step 4: ") or attack == "foreign-step"
    assert [r.step for r in rest] == [2, 3, 4, 5]
    assert [r.loss for r in rest] == [r.loss for r in whole[2:]]  # bit for bit
    got = client.weights(job_id)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def test_with_no_intact_checkpoint_the_resume_fails_in_one_line(
        client: Any, cluster: Any, trained: Any) -> None:
    root = _copy(cluster, trained[0], "none-intact")
    _flip(rank_file(root, 4, 0))
    _truncate(rank_file(root, 2, 1))
    job = replace(BASE, steps=6, resume=True, checkpoint_dir="none-intact")
    with pytest.raises(grpc.RpcError) as failed:
        run_on_cluster(client, job)
    details = failed.value.details()
    assert "\n" not in details
    assert details.endswith("no intact checkpoint of this job to resume from in "
                            "'none-intact': step 4: rank-0.safetensors does not match the "
                            "SHA-256 in its manifest (altered or torn)")
    status = client.status(details.split()[1])
    assert status.state == FAILED
    assert status.refused_checkpoints[1].startswith("step 2: rank-1.safetensors has ")


def test_two_jobs_at_once_with_default_directories_do_not_collide(
        client: Any, cluster: Any) -> None:
    """Two jobs that name no checkpoint directory run at once: each writes its own
    checkpoints/JOB_ID, whose manifests are its own, and resuming one trains what one
    process trains; a third job naming a running job's directory is refused."""
    jobs = [replace(BASE, lr=lr, checkpoint_every=1, steps=3) for lr in (0.02, 0.03)]
    # job 0 last, the third right after it: a busy directory is refused before the
    # submit's model checks, so job 0 is still running then
    ids = [client.submit(job).job_id for job in reversed(jobs)][::-1]
    with pytest.raises(grpc.RpcError) as refused:
        client.submit(replace(jobs[0], checkpoint_dir=f"checkpoints/{ids[0]}"))
    threads = [threading.Thread(target=lambda i=i: list(client.train(i))) for i in ids]
    for t in threads:
        t.start()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().endswith(
        f"checkpoint directory 'checkpoints/{ids[0]}' is in use by job {ids[0]}; name "
        "another --checkpoint-dir")
    for t in threads:
        t.join()
    for job, job_id in zip(jobs, ids, strict=True):
        status = client.status(job_id)
        assert status.state == DONE and status.spec.checkpoint_dir == f"checkpoints/{job_id}"
        root = cluster.checkpoint_root / "checkpoints" / job_id
        assert [m.step for m in committed(root)] == [3, 2, 1]
        found, refused_steps = newest_intact(root, job.to_dict())
        assert found is not None and found.step == 3 and refused_steps == []
    resumed = replace(jobs[1], steps=5, resume=True, checkpoint_dir=f"checkpoints/{ids[1]}")
    reports, weights = run_on_cluster(client, resumed)
    assert [r.step for r in reports] == [3, 4]
    whole = replace(jobs[1], steps=5, checkpoint_every=0)
    assert_same_training(whole, [*client.train(ids[1]), *reports], weights)


def test_a_fresh_job_does_not_write_over_another_jobs_checkpoints(
        client: Any, cluster: Any, trained: Any) -> None:
    _copy(cluster, trained[0], "taken")
    with pytest.raises(grpc.RpcError) as refused:
        client.submit(replace(BASE, lr=0.5, checkpoint_dir="taken"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().endswith(
        "checkpoint directory 'taken' holds another job's checkpoints (step 4 is of another "
        "job: lr 0.02 there, 0.5 here); name another --checkpoint-dir or resume that job")


def test_a_non_finite_loss_fails_the_job_naming_the_step(client: Any, cluster: Any) -> None:
    """lr 1e308: the first update makes the weights infinite; the job fails at the first
    non-finite loss, commits no checkpoint past it and never ends DONE."""
    job = make_job("mlp", "1f1b", 2, "sgd", lr=1e308, steps=6, checkpoint_every=1,
                   checkpoint_dir="nan")
    job_id = client.submit(job).job_id
    reports: list[Any] = []
    with pytest.raises(grpc.RpcError) as failed:
        reports.extend(client.train(job_id))
    status = client.status(job_id)
    assert status.state == FAILED
    assert failed.value.code() == grpc.StatusCode.ABORTED and "\n" not in status.error
    bad = len(reports)  # every step reported before it had a finite loss
    assert bad >= 1 and all(r.loss == r.loss and abs(r.loss) != float("inf") for r in reports)
    assert status.error.startswith(f"step {bad} has a non-finite loss (")
    assert status.error.endswith("on rank 1); the job fails rather than go on training on it")
    assert max(m.step for m in committed(cluster.checkpoint_root / "nan")) <= bad
    with pytest.raises(grpc.RpcError):
        client.weights(job_id)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def test_a_full_checkpoint_disk_fails_the_job_with_resource_exhausted(
        client: Any, cluster: Any) -> None:
    """The checkpoint directory is a real 64 KiB tmpfs; a rank file of 340 KB does not fit:
    the job fails naming the file and the full disk (RESOURCE_EXHAUSTED, not INTERNAL),
    and no temporary file is left on the disk."""
    disk = cluster.checkpoint_root / "full"
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        job = make_job("mlp", "1f1b", 2, "sgd", steps=4, checkpoint_every=2,
                       checkpoint_dir="full/job", model_config={"hidden": 256, "depth": 3})
        job_id = client.submit(job).job_id
        with pytest.raises(grpc.RpcError):
            list(client.train(job_id))
        status = client.status(job_id)
        assert status.state == FAILED and "\n" not in status.error
        assert "failed: RESOURCE_EXHAUSTED: DiskFullError: cannot write step-000002/rank-" in (
            status.error)
        assert status.error.endswith(".safetensors: No space left on device")
        assert [p.name for p in disk.rglob("*") if p.is_file()] == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_dead_worker_is_named_once() -> None:
    """A failed call of a worker that then does not answer its health check."""
    ranks = Ranks.connect([WorkerRecord(0, "127.0.0.1:9", "worker-0", 0.0)])
    try:
        who = ranks.describe(0)
        error = WorkerFailed(f"{who} failed: UNAVAILABLE: Socket closed")
        assert diagnose(error, ranks) == f"{who} died: UNAVAILABLE: Socket closed"
    finally:
        ranks.close()


def test_the_in_process_reference_fails_on_a_non_finite_loss_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pipefb local train --schedule single --lr 1e308`: exit 1, one line naming the step."""
    from pipefb.app.cli import main

    code = main(["local", "train", "--schedule", "single", "--model", "mlp", "--dataset",
                 "digits", "--optimizer", "sgd", "--lr", "1e308", "--steps", "5",
                 "--batch-size", "8", "--microbatches", "2", "--no-progress",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("pipefb: error: step ") and "has a non-finite loss (" in err[-1]
    assert not (tmp_path / "report.json").exists()
