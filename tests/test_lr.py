"""Learning-rate schedules (pipefb.job.lr) and the job fields of schedules and clipping: the
rates torch's schedulers give, the same in the one-process reference, and bad values
refused by name."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.job.lr import LearningRates
from pipefb.runtime.reference import SingleProcess
from protos.convert import job_from_proto, job_to_proto

MLP: dict[str, Any] = {"model": "mlp", "dataset": "digits", "loss": "cross_entropy",
                       "model_config": {"hidden": 16, "depth": 2}, "schedule": "single",
                       "batch_size": 8, "microbatches": 2}


def closed_form(schedule: str, lr: float, steps: int, warmup: int, floor: float, k: int
                ) -> float:
    """The schedule's textbook formula (torch's recursive form agrees to rounding)."""
    if k < warmup:
        return lr * (k + 1) / (warmup + 1)
    t, span = k - warmup, steps - warmup
    if schedule == "cosine":
        return floor + (lr - floor) * (1 + math.cos(math.pi * t / span)) / 2
    if schedule == "linear":
        return lr + (floor - lr) * t / span
    return lr


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_rates_follow_warmup_then_the_decay(schedule: str, warmup: int) -> None:
    rates = LearningRates(schedule, 0.1, 12, warmup, 0.01)
    got = [rates.at(k) for k in range(12)]
    want = [closed_form(schedule, 0.1, 12, warmup, 0.01, k) for k in range(12)]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert got[warmup] == 0.1  # the peak after warm-up
    if warmup:
        assert got[0] == pytest.approx(0.1 / (warmup + 1))
    # a rank resumed at step 7 (a fresh object) and one asked again for an earlier step
    # get the same floats as the one that stepped through
    assert LearningRates(schedule, 0.1, 12, warmup, 0.01).at(7) == got[7]
    assert rates.at(2) == got[2]


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_single_steps_torchs_scheduler_with_the_same_rates(schedule: str) -> None:
    """The reference's optimizer, driven by torch's scheduler, takes exactly the rates a
    pipeline's owner reads for each step."""
    job = JobConfig(**MLP, steps=6, lr=0.05, optimizer="sgd", lr_schedule=schedule,
                    warmup_steps=2, min_lr=0.001)
    rates = LearningRates(schedule, 0.05, 6, 2, 0.001)
    steps = list(SingleProcess(job).run())
    assert [s.lr for s in steps] == [rates.at(k) for k in range(6)]
    assert [s.grad_norm for s in steps] == [None] * 6


def test_single_clips_with_torchs_clip_grad_norm() -> None:
    job = JobConfig(**MLP, steps=2, lr=0.05, optimizer="sgd", clip_grad_norm=0.01)
    steps = list(SingleProcess(job).run())
    assert all(s.grad_norm is not None and s.grad_norm > 0.01 for s in steps)
    assert not any(s.skipped for s in steps)


@pytest.mark.parametrize(("fields", "message"), [
    ({"warmup_steps": -1}, "warmup_steps -1 must be an integer >= 0"),
    ({"warmup_steps": 20, "steps": 20}, "warmup_steps 20 must be fewer"),
    ({"min_lr": 0.5, "lr": 0.1}, "min_lr 0.5 must be a finite number in 0..lr"),
    ({"min_lr": math.nan}, "min_lr nan"),
    ({"lr_schedule": "step"}, "unknown lr schedule 'step'"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm -1.0 must be a finite number > 0"),
    ({"clip_grad_norm": math.inf}, "clip_grad_norm inf"),
])
def test_bad_schedule_and_clip_values_are_refused_by_name(fields: dict[str, Any], message: str
                                                          ) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig(**fields)


def test_the_fields_travel_in_the_job_spec() -> None:
    job = JobConfig(lr_schedule="cosine", warmup_steps=3, min_lr=1e-5, clip_grad_norm=1.5)
    assert job_from_proto(job_to_proto(job)) == job
    assert JobConfig.from_dict(job.to_dict()) == job
