"""The local tier ([Note: local tier] in offload_store/local.py): a combined rank keeps the
stash it takes back itself in its own memory, up to a cap, and uses the shared store past
it; training is unchanged either way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_store.local import LocalTier, local_tier_cap
from tests.conftest import WORKER_THREADS, store_client
from tests.test_transparency import assert_same_training, make_job, run_on_cluster


def test_a_stash_within_the_cap_comes_back_as_it_went() -> None:
    tier = LocalTier(torch.device("cpu"), cap_bytes=1000)
    x, y = torch.arange(50.0), torch.ones(2, 3)
    assert tier.put(0, 1, {3: {"a": x, "b": y}}) == 224
    assert tier.holds(0, 1) and tier.held_bytes == 224
    assert tier.put(0, 2, {3: {"a": torch.zeros(200)}}) is None  # 800 more: past the cap
    back = tier.take(0, 1, {3: ["a", "b"]})
    assert back is not None and back[3]["a"] is x and back[3]["b"] is y
    assert tier.held_bytes == 0 and not tier.holds(0, 1)
    assert tier.take(0, 1, {3: ["a"]}) is None


def test_the_cpu_default_is_the_shared_store() -> None:
    assert local_tier_cap(-1, torch.device("cpu")) == 0
    assert local_tier_cap(-1, torch.device("cuda")) == 1 << 30
    assert local_tier_cap(4096, torch.device("cpu")) == 4096


def sets(cluster: Any) -> int:
    """SET commands the cluster's store has served."""
    stats = store_client(cluster).info("commandstats")
    return int(stats.get("cmdstat_set", {}).get("calls", 0))


@pytest.fixture(scope="module", params=[1 << 30, 64], ids=["kept", "spilled"])
def tier_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Any, Any, int]]:
    """A 2-worker cluster whose workers keep up to `param` stash bytes in a local tier."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    env = {"PIPEFB_LOCAL_STASH_BYTES": str(request.param)}
    with LocalServices(2, tmp_path_factory.mktemp("tier"), threads=WORKER_THREADS,
                       extra_env=env) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(2)
        yield client, cluster, request.param


def test_offload_through_the_local_tier_trains_as_one_process(
        tier_client: tuple[Any, Any, int]) -> None:
    client, cluster, cap = tier_client
    before = sets(cluster)
    job = make_job("gpt", "1f1b", 2, "adamw", policy="offload")
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    assert sum(w.bytes_stashed for r in reports for w in r.workers) > 0
    in_node_tier = max(w.kind_peak_bytes["node_tier"] for r in reports for w in r.workers)
    if cap > 1 << 20:  # every stash fits: the shared store served no write
        assert sets(cluster) == before and in_node_tier == 0
    else:  # none fits: every stash went to the shared store (its node tier, whose index
        assert in_node_tier > 0  # a combined rank keeps itself: [Note: private index])


def test_pipefb_ranks_keep_using_the_store(tier_client: tuple[Any, Any, int]) -> None:
    client, cluster, _ = tier_client
    before = sets(cluster)
    job = make_job("mlp", "pipefb", 2, "adamw")
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    assert sets(cluster) > before  # a forward rank's stash is another rank's to take


def test_the_worker_flag_sets_the_cap(tmp_path: Path) -> None:
    from worker.__main__ import parse_args

    assert parse_args(["--local-stash-bytes", "123"]).local_stash_bytes == 123
    assert parse_args([]).local_stash_bytes == -1
