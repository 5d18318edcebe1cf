"""BatchNorm's statistics with two data-parallel groups: in PipeFB across a live layer move,
on a cluster of 6 workers (each group: forward and backward ranks of its own), where the
session's cluster of 4 has too few for a PipeFB group of two stages to move layers; and
the warning at submit that they are group 0's, not one process's."""

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


# [Note: mutated buffers] with groups: each group's statistics follow its own micro-batches
GROUP_STATS = ("updates buffers in the forward (running statistics); with 2 groups each "
               "group's statistics follow only its own micro-batches, and the exported, "
               "checkpointed and evaluated ones are group 0's, not where one process leaves "
               "them (parameters and training losses are not affected)")


@pytest.mark.parametrize(("model", "groups", "warnings"), [
    ("zoo_convbn", 2, [f"model 'zoo_convbn': layer 2 (BatchNorm2d) {GROUP_STATS}"]),
    ("zoo_batchnorm", 2, ["model 'zoo_batchnorm': layers 1 (BatchNorm1d), 4 (BatchNorm1d) "
                          + GROUP_STATS.replace("updates", "update", 1)]),
    ("zoo_convbn", 1, []),
    ("mlp", 2, []),
])
def test_submit_warns_of_group_statistics_in_one_line(plugin_path: Path, model: str,
                                                      groups: int, warnings: list[str]) -> None:
    job = make_job(model, "1f1b", 4, "adamw", groups=groups, **DIGITS)
    assert check_submit(job).warnings == warnings


@pytest.mark.parametrize("schedule", ["1f1b", "pipefb"])
def test_a_grouped_batchnorm_job_warns_and_exports_group_zeros_statistics(
        cluster: Any, client: Any, capsys: pytest.CaptureFixture[str], schedule: str) -> None:
    """The job runs (its parameters are one process's, as for any model with groups), and
    its statistics are group 0's: half the micro-batches counted. `pipefb submit` prints
    the warning on stderr, one line."""
    # SGD: AdamW scales the conv bias's gradient, zero in exact arithmetic before a
    # BatchNorm, up to the learning rate, whatever the groups' all-reduce rounding
    job = make_job("zoo_convbn", schedule, 4, "sgd", groups=2, **DIGITS)
    reports, weights = run_on_cluster(client, job)
    want_losses, want = reference(job)
    torch.testing.assert_close(torch.tensor([r.loss for r in reports], dtype=torch.float64),
                               torch.tensor(want_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    stats = {k for k in want if "running" in k or "num_batches" in k}
    assert sorted(weights) == sorted(want) and len(stats) == 3
    for name in sorted(set(want) - stats):
        torch.testing.assert_close(weights[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    count = "layers.2.num_batches_tracked"
    assert int(weights[count]) == job.steps * job.microbatches // 2
    assert int(want[count]) == job.steps * job.microbatches
    assert main(["submit", "--coordinator", cluster.coordinator, "--model", "zoo_convbn",
                 "--dataset", "digits", "--loss", "cross_entropy", "--schedule", schedule,
                 "--workers", "4", "--groups", "2", "--batch-size", "8", "--microbatches", "4",
                 "--steps", "1", "--follow"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"pipefb: warning: model 'zoo_convbn': layer 2 (BatchNorm2d) " \
                           f"{GROUP_STATS}\n"
    assert captured.out.splitlines()[0].startswith("job-")
    assert captured.out.splitlines()[1].startswith("step 0 loss ")
