"""BatchNorm's statistics with two data-parallel groups: in PipeFB across a live layer move,
on a cluster of 6 workers (each group: forward and backward ranks of its own), where the
session's cluster of 4 has too few for a PipeFB group of two stages to move layers; every
micro-batch counted once ([Note: group statistics] in pipefb.runtime.groupstats); and the
warning at submit where each group keeps its own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.client import CoordinatorClient
from pipefb.app.cli import main
from pipefb.app.local import LocalServices
from pipefb.job.checks import group_statistics_warning
from pipefb.job.shapes import TensorSpec
from pipefb.runtime.splitcheck import check_submit
from protos.security import Security
from tests.conftest import WORKER_THREADS
from tests.test_any_model import DIGITS
from tests.test_migration import wait_running
from tests.test_transparency import make_job, reference, run_on_cluster

WORKERS = 6


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory, plugin_path: Path
        ) -> Iterator[CoordinatorClient]:
    """Redis, a coordinator and 6 workers, with the zoo's models importable."""
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    with LocalServices(WORKERS, tmp_path_factory.mktemp("six"), threads=WORKER_THREADS,
                       extra_env=env) as cluster, \
            CoordinatorClient(cluster.coordinator, Security(token=cluster.token)) as client:
        client.wait_for_workers(WORKERS)
        yield client


def test_pipefb_groups_keep_their_statistics_across_a_move(six: Any) -> None:
    """Each group's forward ranks hand their statistics to the group's new forward ranks
    (a `buffers_only` Migrate); the moved job ends bit for bit where the unmoved one does,
    statistics included."""
    job = make_job("zoo_batchnorm", "pipefb", WORKERS, "adamw", steps=10, groups=2, **DIGITS)
    _, want = run_on_cluster(six, job)
    client = six
    client.submit(replace(job, job_id="bn-groups-move"))
    status = wait_running(client, "bn-groups-move", 3)
    fwd, bwd = list(status.plan.forward_partition), list(status.plan.backward_partition)
    assert len(fwd) == 3 or len(bwd) == 3  # a group has two stages on one side
    new_fwd = next((p for p in ([0, 2, 7], [0, 5, 7]) if p != fwd), []) if len(fwd) == 3 else []
    new_bwd = next((p for p in ([0, 5, 7], [0, 2, 7]) if p != bwd), []) if len(bwd) == 3 else []
    client.repartition("bn-groups-move", new_fwd, new_bwd)
    list(client.train("bn-groups-move"))
    [move] = client.status("bn-groups-move").migrations
    assert not move.rolled_back and move.bytes > 0
    got = client.weights("bn-groups-move")
    stats = [k for k in want if "running" in k or "num_batches" in k]
    assert len(stats) == 6
    assert [k for k in stats if not torch.equal(got[k], want[k])] == []
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []


# [Note: group statistics]: the line of a job whose groups keep their own statistics
GROUP_STATS = ("updates buffers in the forward (running statistics); with 2 groups each "
               "group's statistics follow only its own micro-batches ({}), and the exported, "
               "checkpointed and evaluated ones are group 0's, not where one process leaves "
               "them (parameters and training losses are not affected)")


@pytest.mark.parametrize(("model", "schedule", "fields", "reason"), [
    ("zoo_convbn", "1f1b", {}, None),
    ("zoo_batchnorm", "pipefb", {}, None),
    ("zoo_convbn", "pipedream", {},
     "one process's are replayed in sync schedules only, not in pipedream"),
    ("zoo_batchnorm", "pipefb", {"mode": "async"},
     "one process's are replayed in sync schedules only, not in async mode"),
    ("zoo_convbn", "1f1b", {"precision": "bf16"},
     "one process's are replayed at fp32 precision only, not at bf16"),
    ("zoo_convbn", "1f1b", {"device": "cuda"},
     "one process's are replayed on the cpu only, not on cuda"),
    ("zoo_convbn", "1f1b", {"groups": 1}, None),
    ("mlp", "1f1b", {}, None),
])
def test_submit_warns_in_one_line_where_groups_keep_their_own_statistics(
        plugin_path: Path, model: str, schedule: str, fields: dict[str, Any],
        reason: str | None) -> None:
    job = make_job(model, schedule, 4, "adamw", **{"groups": 2, **DIGITS, **fields})
    layers = ("layers 1 (BatchNorm1d), 4 (BatchNorm1d) update" if model == "zoo_batchnorm"
              else "layer 2 (BatchNorm2d) updates")
    want = [f"model {model!r}: {layers} " + GROUP_STATS.format(reason).split(" ", 1)[1]]
    assert check_submit(job).warnings == (want if reason else [])


def test_a_layer_that_is_not_a_float32_batchnorm_keeps_its_groups_statistics() -> None:
    """A float64 BatchNorm's update is not the float32 kernel's that the ranks replay."""
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3).double()]
    specs = [[TensorSpec((2, 4), torch.float32)], [TensorSpec((2, 3), torch.float64)]]
    job = make_job("mlp", "1f1b", 4, "adamw", groups=2)
    assert group_statistics_warning(job, layers, specs) == (
        "model 'mlp': layer 1 (BatchNorm1d) " + GROUP_STATS.format(
            "one process's are replayed for float32 nn.BatchNorm layers only"))


@pytest.mark.parametrize("schedule", ["1f1b", "pipefb"])
def test_a_grouped_batchnorm_job_counts_every_microbatch_without_a_warning(
        cluster: Any, client: Any, capsys: pytest.CaptureFixture[str], schedule: str) -> None:
    """Two micro-batches per group: the parameters are one process's to rounding (the
    groups' all-reduce adds in another order), and so are the statistics, which follow
    them; every micro-batch is counted once ([Note: group statistics]). `pipefb submit`
    prints no warning."""
    # SGD: AdamW scales the conv bias's gradient, zero in exact arithmetic before a
    # BatchNorm, up to the learning rate, whatever the groups' all-reduce rounding
    job = make_job("zoo_convbn", schedule, 4, "sgd", groups=2, **DIGITS)
    reports, weights = run_on_cluster(client, job)
    want_losses, want = reference(job)
    torch.testing.assert_close(torch.tensor([r.loss for r in reports], dtype=torch.float64),
                               torch.tensor(want_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert sorted(weights) == sorted(want)
    for name in sorted(want):
        torch.testing.assert_close(weights[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    count = "layers.2.num_batches_tracked"
    assert int(weights[count]) == int(want[count]) == job.steps * job.microbatches
    assert main(["submit", "--coordinator", cluster.coordinator, "--model", "zoo_convbn",
                 "--dataset", "digits", "--loss", "cross_entropy", "--schedule", schedule,
                 "--workers", "4", "--groups", "2", "--batch-size", "8", "--microbatches", "4",
                 "--steps", "1", "--follow"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines()[0].startswith("job-")
    assert captured.out.splitlines()[1].startswith("step 0 loss ")
