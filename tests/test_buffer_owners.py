"""BatchNorm's running statistics come from the rank that runs the layer's forward ([Note:
buffer owners] in pipefb.runtime.state) in all three places a job hands its weights out:
the held-out evaluation of a kept version (`eval_every`), a checkpoint, and the exported
weights. In PipeFB that rank is a forward rank, which steps no optimizer; on combined
schedules it is the rank that owns the parameters too."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipefb.job.config import JobConfig, build_layers
from pipefb.runtime.checkpoint import load_rank
from pipefb.runtime.evaluate import evaluate
from pipefb.runtime.reference import SingleProcess
from tests.conftest import worker_threads
from tests.test_any_model import DIGITS
from tests.test_transparency import make_job, run_on_cluster

STEPS = 5
EVERY = 2  # evaluated and checkpointed at versions 2 and 4


def statistics(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the BatchNorm statistics among `weights`."""
    return sorted(k for k in weights if "running" in k or "num_batches" in k)


def single_versions(job: JobConfig) -> dict[int, dict[str, torch.Tensor]]:
    """One process's weights and statistics at every version (0: as built)."""
    with worker_threads():
        single = SingleProcess(replace(job, schedule="single", mode="sync",
                                       eval_every=0, checkpoint_every=0, checkpoint_dir=""))
        out = {0: {k: v.clone() for k, v in single.weights().items()}}
        for s in single.run():
            out[s.step + 1] = {k: v.clone() for k, v in single.weights().items()}
        return out


def checkpoint(root: Path, version: int) -> dict[str, torch.Tensor]:
    """Every rank file's weights and buffers in a checkpoint of step `version` (not the old
    versions kept beside them)."""
    saved: dict[str, torch.Tensor] = {}
    for path in sorted((root / f"step-{version:06d}").glob("rank-*.safetensors")):
        saved.update({k: v for k, v in load_rank(path)[0].items() if not k.startswith("kept.")})
    return saved


def different(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
              names: list[str]) -> list[str]:
    return [k for k in names if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("model", ["zoo_batchnorm", "zoo_convbn"])
@pytest.mark.parametrize(("schedule", "workers"), [("gpipe", 2), ("1f1b", 2), ("pipefb", 2),
                                                   ("pipefb", 4)])
def test_sync_statistics_are_one_process_s_in_evaluation_checkpoint_and_export(
        client: Any, cluster: Any, model: str, schedule: str, workers: int) -> None:
    """Sync mode: at versions 2 and 4, the statistics checkpointed and evaluated are one
    process's after that many steps, bit for bit, and the exported ones after the last."""
    name = f"owners-{model}-{schedule}-{workers}"
    job = make_job(model, schedule, workers, "adamw", steps=STEPS, eval_every=EVERY,
                   checkpoint_every=EVERY, checkpoint_dir=name, **DIGITS)
    reports, weights = run_on_cluster(client, job)
    want = single_versions(job)
    stats = statistics(want[0])
    assert len(stats) == (6 if model == "zoo_batchnorm" else 3)
    assert different(weights, want[STEPS], stats) == []
    assert int(weights[stats[0]]) == STEPS * job.microbatches
    evaluated = {r.step + 1: dict(r.eval) for r in reports if r.eval}
    assert sorted(evaluated) == [2, 4]
    for version, metrics in evaluated.items():
        saved = checkpoint(cluster.checkpoint_root / name, version)
        assert sorted(saved) == sorted(want[version])
        assert different(saved, want[version], sorted(want[version])) == []
        right = evaluate(job, want[version])["loss"]
        stale = evaluate(job, {**want[version], **{k: want[0][k] for k in stats}})["loss"]
        assert abs(right - stale) > 1e-4 * abs(right)  # the statistics matter to the loss
        assert metrics["loss"] == pytest.approx(right, rel=1e-6)


@pytest.mark.parametrize("model", ["zoo_batchnorm", "zoo_convbn"])
@pytest.mark.parametrize(("mode", "groups"), [("async", 1), ("sync", 2)])
def test_pipefb_version_2_has_the_statistics_a_2_step_job_ends_with(
        client: Any, cluster: Any, model: str, mode: str, groups: int) -> None:
    """Async PipeFB has no one-process reference, and two sync groups' all-reduce rounds
    the weights otherwise than one process; there a job of 2 steps ends where the longer
    job's version 2 is: its checkpoint and evaluation of version 2 hold the statistics of
    the forwards of steps 0 and 1, which the forward ranks ran (with groups, replayed in
    one process's order: [Note: group statistics]), never the built ones."""
    name = f"owners-{mode}-{groups}-{model}"
    job = make_job(model, "pipefb", 4, "adamw", steps=STEPS, eval_every=EVERY,
                   checkpoint_every=EVERY, checkpoint_dir=name, mode=mode, groups=groups,
                   **DIGITS)
    reports, weights = run_on_cluster(client, job)
    _, two = run_on_cluster(client, replace(job, steps=EVERY, eval_every=0,
                                            checkpoint_every=0, checkpoint_dir=""))
    built = {f"layers.{i}.{k}": v for i, layer in enumerate(build_layers(job))
             for k, v in layer.state_dict().items()}
    stats = statistics(built)
    assert int(weights[stats[0]]) == STEPS * job.microbatches
    assert int(two[stats[0]]) == EVERY * job.microbatches
    saved = checkpoint(cluster.checkpoint_root / name, EVERY)
    assert sorted(saved) == sorted(two)
    assert different(saved, two, sorted(two)) == []
    [evaluated] = [dict(r.eval) for r in reports if r.step + 1 == EVERY]
    right = evaluate(job, two)["loss"]
    stale = evaluate(job, {**two, **{k: built[k] for k in stats}})["loss"]
    assert abs(right - stale) > 1e-4 * abs(right)
    assert evaluated["loss"] == pytest.approx(right, rel=1e-6)
