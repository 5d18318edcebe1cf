"""Held-out evaluation: at the end of `pipefb local train`, and every K steps in the step
reports, computed by the coordinator from the weight version the owners kept for it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.runtime.evaluate import evaluate, load_weights
from pipefb.runtime.reference import SingleProcess
from tests.conftest import worker_threads
from tests.test_transparency import make_job, run_on_cluster


def single_evals(job: JobConfig, every: int) -> dict[int, dict[str, float]]:
    """Held-out metrics of one process's weights after every `every` steps."""
    with worker_threads():
        single = SingleProcess(replace(job, schedule="single", mode="sync"))
        out = {}
        for s in single.run():
            if (s.step + 1) % every == 0 and s.step + 1 < job.steps:
                out[s.step] = evaluate(job, single.weights())
        return out


@pytest.mark.parametrize(("schedule", "workers"), [("1f1b", 3), ("pipefb", 4)])
def test_step_reports_carry_held_out_metrics_of_that_version(client: Any, schedule: str,
                                                             workers: int) -> None:
    job = make_job("mlp", schedule, workers, "adamw", steps=5, eval_every=2)
    reports, _ = run_on_cluster(client, job)
    got = {r.step: dict(r.eval) for r in reports if r.eval}
    assert sorted(got) == [1, 3]  # after versions 2 and 4; the end is evaluated by the client
    want = single_evals(job, 2)
    for step, metrics in want.items():
        assert set(got[step]) == {"loss", "accuracy"}
        assert got[step]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
        assert got[step]["accuracy"] == metrics["accuracy"]
    assert all(w.weight_version == 5 for w in reports[-1].workers if w.role != "forward")


def test_evaluate_uses_the_whole_digits_held_out_set() -> None:
    job = JobConfig(schedule="single", model="mlp", dataset="digits", loss="cross_entropy",
                    model_config={"hidden": 16, "depth": 2})
    single = SingleProcess(job)
    metrics = evaluate(job, single.weights())
    assert set(metrics) == {"loss", "accuracy"}
    n_eval = round(1797 * 0.2)
    assert metrics["accuracy"] * n_eval == pytest.approx(round(metrics["accuracy"] * n_eval))
    assert 0.0 <= metrics["accuracy"] <= 0.3  # untrained: about chance


def test_load_weights_names_a_missing_or_misshapen_tensor() -> None:
    job = JobConfig(schedule="single", model="mlp", dataset="digits",
                    model_config={"hidden": 16, "depth": 2})
    weights = SingleProcess(job).weights()
    layers = SingleProcess(job).layers
    key = next(iter(weights))  # layers.0.0.weight
    missing = {k: v for k, v in weights.items() if k != key}
    with pytest.raises(ConfigError, match=f"weights lack {key}"):
        load_weights(layers, missing)
    wrong = {**weights, key: torch.zeros(3, 3)}
    with pytest.raises(ConfigError, match=rf"weights {key} is \[3, 3\]"):
        load_weights(layers, wrong)


def test_eval_every_is_validated() -> None:
    with pytest.raises(ConfigError, match="eval_every -1"):
        JobConfig(eval_every=-1)
