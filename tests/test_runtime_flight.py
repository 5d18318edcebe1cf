"""A rank releases what it holds between actions: after every step of a one-rank job
(the loss stage combined, nothing sent) no activation, gradient or loss is left in flight,
so neither memory nor the per-action memory count grows with the steps."""

from __future__ import annotations

import pytest
import torch

from calibration.overheads import _NoPeers
from pipefb.job.checks import check_job
from pipefb.job.config import JobConfig
from pipefb.plan.partition import balanced_plan
from pipefb.runtime.stage import StageRuntime

STEPS = 6


@pytest.mark.parametrize(("schedule", "mode"), [("gpipe", "sync"), ("1f1b", "sync"),
                                                ("pipedream", "async")])
def test_a_combined_loss_stage_keeps_nothing_after_a_step(schedule: str, mode: str) -> None:
    job = JobConfig(model="mlp", dataset="synthetic", loss="mse", schedule=schedule, workers=1,
                    batch_size=4, microbatches=2, steps=STEPS, optimizer="sgd",
                    model_config={"in_features": 8, "hidden": 8, "depth": 2},
                    dataset_config={"in_features": 8})
    plan = balanced_plan(schedule, 1, check_job(job), job.batch_size, job.microbatches,
                         mode=mode)
    with torch.random.fork_rng(devices=[]):
        runtime = StageRuntime(job, plan, 0, _NoPeers())  # type: ignore[arg-type]
        for step in range(STEPS):
            result = runtime.run_step(step)
            assert len(result.losses) == 2  # both micro-batches' losses were reported
            flight = runtime.flight
            left = {name: len(getattr(flight, name)) for name in
                    ("inputs", "outputs", "grads", "input_grads", "losses", "saved")}
            assert left == dict.fromkeys(left, 0), (step, left)
            assert runtime.memory.current["activations"] == 0
