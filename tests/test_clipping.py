"""Global gradient-norm clipping across stages and learning-rate schedules on real clusters:
every schedule equals the one process running torch's scheduler and clip_grad_norm_, a
resumed job takes the learning rate of its step, and the norm exchange itself over real
gloo process groups."""

from __future__ import annotations

import math
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipefb.app.cli import main
from pipefb.job.config import JobConfig
from pipefb.runtime.allreduce import GroupAllReduce
from pipefb.runtime.clipping import GlobalNormClip
from pipefb.runtime.reference import SingleProcess
from protos.convert import job_to_proto
from tests.conftest import assert_submit_refused, worker_threads
from tests.test_migration import trained_with_a_move
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

MAX_NORM = 0.05  # well below the mlp's gradient norms (about 0.3 to 1.5): every step clips
SCHEDULED: dict[str, Any] = {"lr_schedule": "cosine", "warmup_steps": 1, "min_lr": 0.001,
                             "clip_grad_norm": MAX_NORM, "steps": 4}
# (schedule, workers, groups): combined and split kinds, and two groups where they apply
RUNS = [("gpipe", 2, 1), ("1f1b", 4, 1), ("pipefb", 4, 1), ("pipefb", 4, 2), ("1f1b", 4, 2)]


def single_steps(job: JobConfig) -> list[Any]:
    with worker_threads():
        return list(SingleProcess(replace(job, schedule="single", groups=1)).run())


@pytest.mark.parametrize(("schedule", "workers", "groups"), RUNS)
def test_clipped_scheduled_pipeline_equals_torch_in_one_process(
        client: Any, schedule: str, workers: int, groups: int) -> None:
    job = make_job("mlp", schedule, workers, "adamw", groups=groups, **SCHEDULED)
    reports, weights = run_on_cluster(client, job)
    want = single_steps(job)
    assert all(s.grad_norm is not None and s.grad_norm > MAX_NORM for s in want)  # it clips
    assert [r.lr for r in reports] == [s.lr for s in want]  # bit for bit, every step
    assert all(r.HasField("grad_norm") and not r.skipped for r in reports)
    got_norms = torch.tensor([r.grad_norm for r in reports], dtype=torch.float64)
    want_norms = torch.tensor([s.grad_norm for s in want], dtype=torch.float64)
    if groups == 1:  # the same numbers added in the same order
        assert got_norms.tolist() == want_norms.tolist()
    else:  # the groups' all-reduce adds the gradients in another order
        torch.testing.assert_close(got_norms, want_norms, rtol=1e-6, atol=0)
    assert_same_training(job, reports, weights, atol=1e-7 if groups == 1 else 1e-6)


def test_resumed_job_takes_the_learning_rate_of_its_step(client: Any, cluster: Any) -> None:
    """The 6-step job resumed from its checkpoint of step 3 (the one of step 6 removed):
    the decay spans the job's steps, so the resumed job is the same 6-step job."""
    job = make_job("mlp", "1f1b", 4, "adamw", **{**SCHEDULED, "steps": 6},
                   checkpoint_every=3, checkpoint_dir="lr-whole")
    whole, want = run_on_cluster(client, job)
    shutil.rmtree(cluster.checkpoint_root / "lr-whole" / "step-000006")
    rest, got = run_on_cluster(client, replace(job, resume=True))
    assert [r.step for r in rest] == [3, 4, 5]
    assert [r.lr for r in rest] == [r.lr for r in whole[3:]]
    assert [r.grad_norm for r in rest] == [r.grad_norm for r in whole[3:]]
    assert [r.loss for r in rest] == [r.loss for r in whole[3:]]  # bit for bit
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def exchange(grads: list[list[torch.Tensor | None]], places: list[list[int]], total: int
             ) -> list[tuple[float, list[torch.Tensor | None]]]:
    """Each owner's clip over a real gloo group of len(grads) owners: (norm, grads after)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    out: list[Any] = [None] * len(grads)

    def owner(rank: int) -> None:
        group = GroupAllReduce(f"127.0.0.1:{store.port}", "t/", rank, len(grads),
                               torch.device("cpu"), timeout_seconds=20)
        params = []
        for g in grads[rank]:
            p = torch.zeros(g.shape if g is not None else (1,), requires_grad=True)
            p.grad = None if g is None else g.clone()
            params.append(p)
        clip = GlobalNormClip(1.0, places[rank], total, torch.float32, torch.device("cpu"),
                              group)
        out[rank] = (clip.clip_(params), [p.grad for p in params])
        group.close()

    threads = [threading.Thread(target=owner, args=(r,)) for r in range(len(grads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_norm_exchange_equals_clip_grad_norm_of_the_whole_model() -> None:
    torch.manual_seed(3)
    grads: list[torch.Tensor | None] = [torch.randn(40, 30) * 2, torch.randn(30), None,
                                        torch.randn(7, 5) * 5]
    # owner 0 holds parameters 0 and 3 (places out of order), owner 1 holds 1 and 2
    got = exchange([[grads[0], grads[3]], [grads[1], grads[2]]], [[0, 3], [1, 2]], 4)
    params = [torch.zeros(g.shape if g is not None else (1,), requires_grad=True)
              for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()
    want = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    assert want > 1.0 and got[0][0] == got[1][0] == want
    for got_grad, p in zip([*got[0][1], *got[1][1]], [params[0], params[3], params[1],
                                                       params[2]], strict=True):
        if p.grad is None:
            assert got_grad is None
        else:
            assert torch.equal(got_grad, p.grad)


def test_a_non_finite_norm_is_seen_by_every_owner_and_leaves_the_gradients() -> None:
    bad = torch.tensor([1.0, math.inf])
    got = exchange([[torch.ones(3)], [bad]], [[0], [1]], 2)
    assert math.isinf(got[0][0]) and math.isinf(got[1][0])
    assert torch.equal(got[0][1][0], torch.ones(3))  # not scaled: the step is skipped


@pytest.mark.parametrize(("schedule", "workers"), [("1f1b", 2), ("pipefb", 4)])
def test_a_non_finite_norm_skips_the_step_on_every_owner(client: Any, schedule: str,
                                                         workers: int) -> None:
    """zoo_inf_grad's first linear layer gets infinite gradients, its last one finite
    ones, on another stage: that stage skips too, as the one process does."""
    job = make_job("zoo_inf_grad", schedule, workers, "sgd", dataset="digits",
                   loss="cross_entropy", clip_grad_norm=1.0, steps=2)
    reports, weights = run_on_cluster(client, job)
    want = single_steps(job)
    assert all(s.skipped and not math.isfinite(s.grad_norm or 0.0) for s in want)
    assert [r.skipped for r in reports] == [True, True]
    assert all(not math.isfinite(r.grad_norm) and math.isfinite(r.loss) for r in reports)
    # nothing was updated anywhere: the weights are the initial ones, as in one process
    initial = SingleProcess(replace(job, schedule="single")).weights()
    assert sorted(weights) == sorted(initial)
    for name, value in initial.items():
        assert torch.equal(weights[name], value), name
    assert [r.loss for r in reports] == [s.loss for s in want]


def test_a_moved_job_keeps_its_schedule_and_clipping(client: Any) -> None:
    """A layer move re-assigns every rank with attempt + 1 (a fresh norm exchange, the
    lr from the step number): training goes on as in one process."""
    job = make_job("mlp", "pipefb", 4, "adamw", **{**SCHEDULED, "steps": 12},
                   job_id="clip-move")
    reports = trained_with_a_move(client, job)
    want = single_steps(job)
    assert [r.step for r in reports] == list(range(job.steps))
    assert [r.lr for r in reports] == [s.lr for s in want]
    assert [r.grad_norm for r in reports] == [s.grad_norm for s in want]
    assert_same_training(job, reports, client.weights("clip-move"))


BAD_SPECS = [
    ({"warmup_steps": -1}, "warmup_steps -1 must be an integer >= 0"),
    ({"min_lr": 0.5}, "min_lr 0.5 must be a finite number in 0..lr (0.05)"),
    ({"lr_schedule": "exponential"}, "unknown lr schedule 'exponential'"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm -1.0 must be a finite number > 0"),
    ({"clip_grad_norm": math.inf}, "clip_grad_norm inf"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_SPECS)
def test_submit_refuses_bad_schedules_and_clips_naming_the_value(
        client: Any, fields: dict[str, Any], message: str) -> None:
    assert_submit_refused(client, job_to_proto(make_job("mlp", "1f1b", 2, "sgd")), fields,
                          message)


def test_a_yaml_job_file_sets_schedule_and_clipping(
        cluster: Any, client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: mlp\ndataset: digits\nloss: cross_entropy\nschedule: 1f1b\n"
                   "workers: 2\nbatch_size: 8\nmicrobatches: 2\nsteps: 3\noptimizer: sgd\n"
                   "lr: 0.05\nlr_schedule: linear\nwarmup_steps: 1\nmin_lr: 0.0\n"
                   "clip_grad_norm: 0.05\njob_id: yaml-clip\n")
    assert main(["submit", "--coordinator", cluster.coordinator, str(job), "--follow"]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = client.status("yaml-clip")
    assert (status.spec.lr_schedule, status.spec.warmup_steps, status.spec.min_lr,
            status.spec.clip_grad_norm) == ("linear", 1, 0.0, 0.05)
    reports = list(client.train("yaml-clip"))
    # warm-up to 0.05 / 2, the peak, then half way down the line to 0
    assert [r.lr for r in reports] == [0.025, 0.05, 0.025]
    assert lines[0] == "yaml-clip" and [line.split()[5] for line in lines[1:]] == [
        "0.025", "0.05", "0.025"]
    assert all(f"grad norm {r.grad_norm:.4g}" in line for r, line in zip(reports, lines[1:],
                                                                             strict=True))
