"""BatchNorm's statistics in PipeFB with two data-parallel groups across a live layer move:
a cluster of 6 workers (each group: forward and backward ranks of its own), where the
session's cluster of 4 has too few for a PipeFB group of two stages to move layers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.client import CoordinatorClient
from pipefb.app.local import LocalServices
from protos.security import Security
from tests.conftest import WORKER_THREADS
from tests.test_any_model import DIGITS
from tests.test_migration import wait_running
from tests.test_transparency import make_job, run_on_cluster

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
