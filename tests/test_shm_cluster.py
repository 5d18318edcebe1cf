"""Training through the node-local shared-memory tier ([Note: local tier index] in
offload_store/shm.py) on real worker processes: every sync schedule that offloads equals
one process bit for bit, the stash bytes bypass Redis, each rank reports its bytes in the
tier, and stashes past the tier's cap spill to Redis and still train the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import WORKER_THREADS, store_client
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

# (model, schedule, workers, policy): each sync schedule with stashes that leave a rank
OFFLOADING = [("gpt", "1f1b", 3, "offload"), ("mlp", "gpipe", 2, "offload"),
              ("gpt", "pipefb", 2, ""), ("mlp", "pipefb", 4, "")]
BATCH = {"mlp": 64}  # samples per step: the mlp's stash, far above the store's own traffic


def redis_input_bytes(cluster: Any) -> int:
    """Bytes the cluster's Redis has received so far."""
    return int(store_client(cluster).info("stats")["total_net_input_bytes"])


def redis_getdels(cluster: Any) -> int:
    """GETDEL calls the cluster's Redis has served so far (each take of a stash from
    Redis, or of a tier index entry, makes one)."""
    stats = store_client(cluster).info("commandstats")
    return int(stats.get("cmdstat_getdel", {}).get("calls", 0))


def segments_left(tier: Path) -> list[Path]:
    return sorted(tier.glob("*/[0-9]*.seg"))  # segments, not spares


def train(client: Any, cluster: Any, model: str, schedule: str, workers: int, policy: str,
          in_tier: bool = True) -> tuple[int, int]:
    """Trains the job, checks it against one process and each rank's `node_tier` bytes
    (`in_tier`: the stashes fit the tier; else all spill); returns (stash bytes, bytes
    Redis received meanwhile)."""
    extra: dict[str, Any] = {"policy": policy} if policy else {}
    if model in BATCH:
        extra["batch_size"] = BATCH[model]
    job = make_job(model, schedule, workers, "adamw", **extra)
    before = redis_input_bytes(cluster)
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    stashed = sum(w.bytes_stashed for r in reports for w in r.workers)
    assert stashed > 0
    assert_node_tier(reports, in_tier)
    return stashed, redis_input_bytes(cluster) - before


def assert_node_tier(reports: list[Any], in_tier: bool) -> None:
    """Each rank reports its bytes in the tier (memory kind `node_tier`): none for a rank
    that never stashes, or with every stash spilled (not `in_tier`); for one that
    stashes in the tier, some bytes at some step (its segments, or the spares its taken
    segments left; how many depends on when the background writer ran, which a loaded
    host delays); never in its own total."""
    by_rank: dict[int, list[Any]] = {}
    for r in reports:
        for rank, w in enumerate(r.workers):
            by_rank.setdefault(rank, []).append(w)
    for rank, steps in by_rank.items():
        peaks = [w.kind_peak_bytes["node_tier"] for w in steps]
        stash = max(w.bytes_stashed for w in steps)
        if stash == 0 or not in_tier:
            assert peaks == [0] * len(steps), (rank, peaks)
        else:
            assert max(peaks) > 0, (rank, peaks, stash)
        for w in steps:
            own = sum(v for k, v in w.memory_bytes.items() if k != "node_tier")
            assert own == w.peak_memory_bytes


@pytest.mark.parametrize(("model", "schedule", "workers", "policy"), OFFLOADING)
def test_stashes_through_the_tier_train_as_one_process(
        client: Any, cluster: Any, model: str, schedule: str, workers: int,
        policy: str) -> None:
    assert cluster.tier_dir is not None  # the local cluster turns the tier on
    getdels = redis_getdels(cluster)
    stashed, to_redis = train(client, cluster, model, schedule, workers, policy)
    assert to_redis < stashed / 2, (to_redis, stashed)  # only index entries and control
    assert segments_left(cluster.tier_dir) == []  # every segment consumed
    if schedule != "pipefb":  # combined ranks index their own stashes ([Note: private
        assert redis_getdels(cluster) == getdels  # index]): no take asks Redis


def unix_connections(socket: Path) -> int:
    """Connected unix sockets bound to `socket` (the server's ends of its clients'
    connections), from /proc/net/unix."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return sum(1 for line in lines
               if line.split()[-1] == str(socket) and line.split()[5] == "03")


def test_the_cluster_reaches_redis_over_its_unix_socket(client: Any, cluster: Any) -> None:
    """The workers and the coordinator connect through PIPEFB_STORE_SOCKET while a job
    runs; this test's own client keeps TCP."""
    job = make_job("mlp", "pipefb", 4, "adamw", steps=20)
    seen = 0
    for _ in client.train(client.submit(job).job_id):
        seen = max(seen, unix_connections(cluster.socket_dir / "redis.sock"))
    assert seen >= 4  # a stash client per rank, at least
    assert store_client(cluster).ping()


@pytest.fixture(scope="module")
def spilling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A 4-worker cluster whose tier holds at most 64 bytes: every stash spills."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    with LocalServices(4, tmp_path_factory.mktemp("spill"), threads=WORKER_THREADS,
                       extra_env={"PIPEFB_LOCAL_TIER_BYTES": "64"}) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(4)
        yield client, cluster


@pytest.mark.parametrize(("model", "schedule", "workers", "policy"),
                         [("gpt", "1f1b", 3, "offload"), ("mlp", "pipefb", 4, "")])
def test_stashes_past_the_cap_spill_to_redis_and_train_as_one_process(
        spilling: tuple[Any, Any], model: str, schedule: str, workers: int,
        policy: str) -> None:
    client, cluster = spilling
    stashed, to_redis = train(client, cluster, model, schedule, workers, policy, in_tier=False)
    assert to_redis > stashed / 2  # Redis got them (less those taken back from the queue)
    assert segments_left(cluster.tier_dir) == []
