"""Checkpoints: atomic safetensors + JSON files that never unpickle, and a job resumed from
one trains exactly what the uninterrupted job trains."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.runtime.checkpoint import (
    due,
    file_digest,
    load_optimizer,
    load_rank,
    rank_file,
    resolve_under,
    save_rank,
)
from pipefb.runtime.manifest import committed, newest_intact, write_manifest
from protos.coordinator_pb2 import RUNNING
from tests.test_transparency import make_job, run_on_cluster


def _trained_adamw() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.01)
    for _ in range(2):
        layer(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
    return layer, opt


def test_rank_file_round_trips_weights_and_optimizer_state(tmp_path: Path) -> None:
    layer, opt = _trained_adamw()
    names = ["0.weight", "0.bias"]
    path = rank_file(tmp_path, 2, 1)
    save_rank(path, {"layers.0.weight": layer.weight, "layers.0.bias": layer.bias}, opt, names)
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank-1.safetensors"]  # no tmp
    weights, optim, meta = load_rank(path)
    torch.testing.assert_close(weights["layers.0.weight"], layer.weight.detach(), rtol=0, atol=0)
    assert sorted(optim) == sorted(f"optimizer.{n}.{k}" for n in names
                                   for k in ("step", "exp_avg", "exp_avg_sq"))
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    load_optimizer(fresh, names, optim, meta)
    want, got = opt.state_dict(), fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]  # lr 0.1 and weight decay came back
    for i in (0, 1):
        for key, value in want["state"][i].items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=0, atol=0)


def test_optimizer_state_naming_another_parameter_is_refused(tmp_path: Path) -> None:
    _, opt = _trained_adamw()
    path = tmp_path / "r.safetensors"
    save_rank(path, {}, opt, ["0.weight", "0.bias"])
    _, optim, meta = load_rank(path)
    with pytest.raises(ConfigError, match="do not match this rank's parameters"):
        load_optimizer(opt, ["1.weight", "1.bias"], optim, meta)


def test_a_truncated_or_foreign_file_is_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.safetensors"
    save_file({"layers.0.weight": torch.ones(4, 4)}, str(path))
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ConfigError, match="cannot read checkpoint file"):
        load_rank(path)
    pickled = tmp_path / "rank-1.safetensors"
    torch.save({"w": torch.ones(2)}, pickled)  # a pickle under the expected name
    with pytest.raises(ConfigError, match="cannot read checkpoint file"):
        load_rank(pickled)


def test_only_committed_checkpoints_count_and_the_newest_wins(tmp_path: Path) -> None:
    job = {"model": "mlp", "lr": 0.1}
    assert newest_intact(tmp_path, job) == (None, [])
    digest = save_rank(rank_file(tmp_path, 3, 0), {"w": torch.ones(2)}, None, [])
    assert digest == file_digest(rank_file(tmp_path, 3, 0))
    write_manifest(tmp_path, 3, job, {}, {"rank-0.safetensors": digest})
    save_rank(rank_file(tmp_path, 6, 0), {"w": torch.ones(2)}, None, [])  # no manifest
    found, refused = newest_intact(tmp_path, job)
    assert found is not None and found.step == 3 and found.files == {"rank-0.safetensors":
                                                                     digest}
    assert refused == ["step 6: no manifest (never committed)"]
    (tmp_path / "step-000003" / "manifest.json").write_text("[1, 2]")
    assert newest_intact(tmp_path, job)[0] is None
    assert newest_intact(tmp_path, job)[1][1].startswith("step 3: malformed manifest")
    assert committed(tmp_path) == []


def test_checkpoint_paths_stay_inside_the_root(tmp_path: Path) -> None:
    assert resolve_under(tmp_path, "ckpt/a") == tmp_path.resolve() / "ckpt" / "a"
    for bad in ("../elsewhere", "/etc", "ckpt/../../x"):
        with pytest.raises(PermissionError, match="outside the checkpoint root"):
            resolve_under(tmp_path, bad)
    with pytest.raises(PermissionError, match="no checkpoint root"):
        resolve_under("", "ckpt")


def test_cadence_and_job_validation() -> None:
    assert [s for s in range(8) if due(s, 3, 8)] == [2, 5, 7]
    assert not any(due(s, 0, 8) for s in range(8))
    assert JobConfig(schedule="1f1b", checkpoint_every=2).checkpoint_dir == ""  # its own
    with pytest.raises(ConfigError, match="resume needs the checkpoint directory"):
        JobConfig(schedule="1f1b", resume=True)
    assert JobConfig(schedule="1f1b", resume=True, job_id="j").checkpoint_dir == ""
    assert JobConfig(schedule="pipedream", resume=True, checkpoint_dir="c").resume
    assert JobConfig(schedule="pipefb", mode="async", staleness=2, resume=True,
                     checkpoint_dir="c").resume


# (schedule, workers, groups): combined ranks, split ranks whose forward workers load
# their layers from the backward workers' files, in two groups, and PipeDream, whose
# files hold the version step 3's warm-up forwards ran on ([Note: resumed leads]).
RESUMES = [("1f1b", 4, 1), ("pipefb", 4, 2), ("pipedream", 4, 1)]


@pytest.mark.parametrize(("schedule", "workers", "groups"), RESUMES)
def test_resumed_job_trains_exactly_what_the_uninterrupted_one_trains(
        client: Any, cluster: Any, schedule: str, workers: int, groups: int) -> None:
    job = make_job("mlp", schedule, workers, "adamw", groups=groups, steps=6,
                   checkpoint_every=3, checkpoint_dir=f"whole-{schedule}")
    whole, want = run_on_cluster(client, job)
    first = replace(job, steps=3, checkpoint_dir=f"parts-{schedule}")
    run_on_cluster(client, first)
    root = cluster.checkpoint_root / first.checkpoint_dir
    found, refused = newest_intact(root, first.to_dict())
    assert found is not None and refused == []
    assert found.step == 3 and found.plan["groups"] == groups
    owners = sorted(a["rank"] for a in found.plan["assignment"] if a["role"] != "forward")
    assert sorted(p.name for p in (root / "step-000003").iterdir()) == sorted(
        [f"rank-{r}.safetensors" for r in owners] + ["manifest.json"])
    assert sorted(found.files) == [f"rank-{r}.safetensors" for r in owners]
    assert all(not n.startswith(".") for n in load_file(str(rank_file(root, 3, owners[0]))))
    rest, got = run_on_cluster(client, replace(first, steps=6, resume=True))
    assert [r.step for r in rest] == [3, 4, 5]
    assert [r.loss for r in rest] == [r.loss for r in whole[3:]]  # bit for bit
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert committed(root)[0].step == 6


def test_pipedream_resumed_mid_run_from_a_checkpoint_its_lead_forwards_passed(
        client: Any, cluster: Any) -> None:
    """The checkpoint of step 3 of a 6-step PipeDream job is written after step 3's lead
    forwards ran on version 2 ([Note: resumed leads]): its files hold that version, and
    the job resumed from it (the step-6 checkpoint removed) ends bit for bit where the
    uninterrupted job ended."""
    job = make_job("gpt", "pipedream", 3, "adamw", steps=6, checkpoint_every=3,
                   checkpoint_dir="mid-pipedream")
    whole, want = run_on_cluster(client, job)
    root = cluster.checkpoint_root / job.checkpoint_dir
    assert any(n.startswith("kept.2.layers.") for n in load_file(str(rank_file(root, 3, 0))))
    for path in (root / "step-000006").iterdir():
        path.unlink()
    (root / "step-000006").rmdir()
    assert_resumes_from_step_3(client, job, whole, want)


# (staleness S, K, groups): the default K (1 of 4 micro-batches stale on one group, all
# of them on two) and every micro-batch stale
ASYNC_RESUMES = [(1, 0, 1), (2, 0, 1), (1, 4, 1), (2, 4, 1), (2, 0, 2)]


def async_pipefb_job(staleness: int, k: int, name: str, groups: int = 1) -> JobConfig:
    """A 6-step async PipeFB job on 4 workers that checkpoints every 3 steps into `name`."""
    return make_job("gpt", "pipefb", 4, "adamw", mode="async", staleness=staleness,
                    staleness_microbatches=k, groups=groups, steps=6, checkpoint_every=3,
                    checkpoint_dir=f"{name}-s{staleness}-k{k}-g{groups}")


def kept_versions(root: Path, step: int, rank: int) -> list[int]:
    """The old weight versions a rank file holds (`kept.{v}.layers.*`)."""
    names = load_file(str(rank_file(root, step, rank)))
    return sorted({int(n.split(".")[1]) for n in names if n.startswith("kept.")})


@pytest.mark.parametrize(("staleness", "k", "groups"), ASYNC_RESUMES)
def test_async_pipefb_resumed_mid_run_runs_its_first_forwards_on_the_kept_versions(
        client: Any, cluster: Any, staleness: int, k: int, groups: int) -> None:
    """The checkpoint of step 3 of a 6-step async PipeFB job: the owners' files hold
    versions 3 - S .. 2, which steps 3 .. 2 + S's forwards run on ([Note: resumed stale
    forwards] in pipefb/runtime/state.py); the job resumed from it (the step-6 checkpoint
    removed) reports steps 3-5 and ends bit for bit where the uninterrupted job ended."""
    job = async_pipefb_job(staleness, k, "mid-async", groups)
    whole, want = run_on_cluster(client, job)
    root = cluster.checkpoint_root / job.checkpoint_dir
    found, _ = newest_intact(root, job.to_dict(), 3)
    assert found is not None and found.step == 3
    owners = [a["rank"] for a in found.plan["assignment"] if a["role"] != "forward"]
    assert len(owners) == 2
    for owner in owners:
        assert kept_versions(root, 3, owner) == list(range(3 - staleness, 3))
    for path in (root / "step-000006").iterdir():
        path.unlink()
    (root / "step-000006").rmdir()
    assert_resumes_from_step_3(client, job, whole, want)


def test_an_async_pipefb_checkpoint_after_its_last_step_resumes_a_longer_job(
        client: Any, cluster: Any) -> None:
    """A 3-step async PipeFB job (S = 2) checkpoints after its last step: its owners kept
    versions 1 and 2 as if the job went on, and a 6-step job resumed from it ends bit for
    bit where the uninterrupted 6-step job ends."""
    job = async_pipefb_job(2, 0, "last-async")
    whole, want = run_on_cluster(client, replace(job, checkpoint_dir="whole-last-async"))
    run_on_cluster(client, replace(job, steps=3))
    root = cluster.checkpoint_root / job.checkpoint_dir
    assert [m.step for m in committed(root)] == [3]
    assert kept_versions(root, 3, 2) == [1, 2]
    assert_resumes_from_step_3(client, job, whole, want)


def assert_resumes_from_step_3(client: Any, job: Any, whole: list[Any],
                               want: dict[str, torch.Tensor]) -> None:
    """`job` resumed from its step-3 checkpoint reports steps 3-5 with the losses of the
    uninterrupted run `whole` and ends with its weights `want`, bit for bit."""
    rest, got = run_on_cluster(client, replace(job, resume=True))
    assert [r.step for r in rest] == [3, 4, 5]
    assert [r.loss for r in rest] == [r.loss for r in whole[3:]]  # bit for bit
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def checkpoint_in_first_step(client: Any, job_id: str, settle: float) -> int:
    """Asks for a checkpoint (`Checkpoint`) `settle` s after the job starts running steps,
    when every rank has its first Step calls; returns the checkpoint's step."""
    while client.status(job_id).state != RUNNING:
        time.sleep(0.01)
    time.sleep(settle)
    return int(client.checkpoint(job_id).checkpointed)


def test_a_pipedream_checkpoint_requested_after_its_last_step_resumes_a_longer_job(
        client: Any, cluster: Any) -> None:
    """A 3-step PipeDream job takes no checkpoint by cadence; rank 0's compute is slowed
    (seconds a step) so `Checkpoint` arrives in step 0, when steps 0 and 1 are issued (2
    Step calls in flight per rank) and only the last is left: the checkpoint after the
    last step still holds the version 2 that step 3's warm-up forwards run on ([Note:
    resumed leads]), and a 6-step job resumed from it ends bit for bit where the
    uninterrupted 6-step job ends."""
    job = make_job("gpt", "pipedream", 3, "adamw", steps=6, checkpoint_dir="last-pipedream")
    whole, want = run_on_cluster(client, job)
    short = replace(job, steps=3, slowdown="0=100,L0=4")
    job_id = client.submit(short).job_id
    assert checkpoint_in_first_step(client, job_id, 0.3) == 3  # after the job's last step
    assert [r.step for r in client.train(job_id)] == [0, 1, 2]
    root = cluster.checkpoint_root / job.checkpoint_dir
    assert [m.step for m in committed(root)] == [3]
    assert any(n.startswith("kept.2.layers.") for n in load_file(str(rank_file(root, 3, 0))))
    assert_resumes_from_step_3(client, job, whole, want)


def test_resume_of_another_job_fails_naming_the_field(client: Any) -> None:
    job = make_job("mlp", "1f1b", 2, "sgd", steps=2, checkpoint_every=2,
                   checkpoint_dir="other-job")
    run_on_cluster(client, job)
    with pytest.raises(grpc.RpcError) as failed:
        run_on_cluster(client, replace(job, steps=4, resume=True, lr=0.5))
    assert ("no intact checkpoint of this job to resume from in 'other-job': step 2 is of "
            "another job: lr 0.05 there, 0.5 here") in failed.value.details()
    with pytest.raises(grpc.RpcError) as escaped:
        run_on_cluster(client, replace(job, checkpoint_dir="../../outside"))
    assert "outside the checkpoint root" in escaped.value.details()


WRITER = """
import sys, torch
from pathlib import Path
from pipefb.runtime.checkpoint import rank_file, save_rank
from pipefb.runtime.manifest import write_manifest
root = Path(sys.argv[1])
for step in range(1, 10**6):
    files = {f"rank-{rank}.safetensors": save_rank(
        rank_file(root, step, rank), {"w": torch.full((1 << 22,), float(step))}, None, [])
        for rank in (0, 1)}
    write_manifest(root, step, {}, {}, files)
    print(step, flush=True)
"""


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.31])
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(
        tmp_path: Path, delay: float) -> None:
    """A real writer process (16 MiB rank files, two ranks per step) is SIGKILLed at some
    point after its first commit: the newest committed checkpoint loads whole, each rank
    file holds that step's values, and what the kill left are hidden temporary files."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=root,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "1"  # one checkpoint committed
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    found, _ = newest_intact(tmp_path, {})
    assert found is not None
    step = found.step
    for rank in (0, 1):
        weights, _, _ = load_rank(rank_file(tmp_path, step, rank))
        assert weights["w"].eq(float(step)).all()
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file()
                 and p.name not in ("manifest.json", "rank-0.safetensors", "rank-1.safetensors")]
    assert all(n.startswith(".") for n in leftovers), leftovers  # hidden temporaries only


def test_a_checkpoint_on_request_resumes_to_the_same_training(client: Any, cluster: Any
                                                              ) -> None:
    """`Checkpoint` mid-run (no cadence) commits the step boundary after the steps already
    issued, without stopping the job; a resume from it trains what the whole run trains."""
    job = make_job("mlp", "pipefb", 4, "adamw", steps=12, checkpoint_dir="on-request")
    job_id = client.submit(job).job_id
    stream = client.train(job_id)
    first = next(stream)
    status = client.checkpoint(job_id)
    reports = [first, *stream]
    step = status.checkpointed
    assert 1 < step < job.steps and [r.step for r in reports] == list(range(job.steps))
    root = cluster.checkpoint_root / job.checkpoint_dir
    assert [m.step for m in committed(root)] == [step]  # the only checkpoint
    assert client.status(job_id).checkpointed == step
    want = client.weights(job_id)
    with pytest.raises(grpc.RpcError) as done:
        client.checkpoint(job_id)
    assert done.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is DONE" in done.value.details()
    rest, got = run_on_cluster(client, replace(job, resume=True))
    assert [r.step for r in rest] == list(range(step, job.steps))
    assert [r.loss for r in rest] == [r.loss for r in reports[step:]]  # bit for bit
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_checkpoint_without_a_directory_or_of_an_unknown_job_is_refused(client: Any) -> None:
    job = make_job("mlp", "1f1b", 2, "sgd", steps=2)
    job_id = client.submit(job).job_id
    with pytest.raises(grpc.RpcError) as missing:
        client.checkpoint(job_id)
    assert missing.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no checkpoint directory" in missing.value.details()
    list(client.train(job_id))
    with pytest.raises(grpc.RpcError) as unknown:
        client.checkpoint("no-such-job")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
