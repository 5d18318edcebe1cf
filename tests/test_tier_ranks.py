"""Per-layer use of the node-local tier ([Note: tier ranks] in offload_store/tierranks.py):
a producer writes a layer to the tier when the rank that takes it shares its tier and to
Redis otherwise, and a consumer takes a layer whose producer is on another tier from
Redis in one round trip, against a real redis-server with two tier directories standing
for two hosts; and whole PipeFB jobs on worker processes spread over tiers train as one
process with each pair's bytes where its placement puts them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from offload_store import RedisServer, connect, open_store
from offload_store.keys import segment_key
from offload_store.segments import SegmentError
from offload_store.shm import SharedTierStore
from pipefb.job.config import build_layers
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import Plan
from pipefb.plan.stashpath import stash_consumers, stash_producers
from tests.conftest import WORKER_THREADS, store_client
from tests.test_shm_cluster import redis_input_bytes, segments_left
from tests.test_shm_tier import assert_same, names, segment_files, stash, tier
from tests.test_transparency import assert_same_training, make_job, run_on_cluster


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="64mb") as srv:
        yield srv


def rank_store(server: RedisServer, base: Path, job: str, rank: int, ranks: int = 3,
               consumers: dict[int, int] | None = None,
               producers: dict[int, int] | None = None) -> SharedTierStore:
    return tier(server, base, job, ranks=ranks, local_tier_rank=rank,
                local_tier_consumers=consumers, local_tier_producers=producers)


def command_calls(client: Any) -> dict[str, int]:
    """The server's calls so far per command (INFO commandstats)."""
    return {name.removeprefix("cmdstat_"): int(stat["calls"])
            for name, stat in client.info("commandstats").items()}


@contextmanager
def traffic(server: RedisServer, monkeypatch: pytest.MonkeyPatch, store: SharedTierStore
            ) -> Iterator[dict[str, int]]:
    """Counts what reaches Redis within the block: "round trips", each write of packed
    commands by a connection of `store`'s class (a pipeline is one; only `store` may talk
    to Redis meanwhile), and the server's calls per command that ran (INFO's own left
    out)."""
    observer = connect(server.address)
    before = command_calls(observer)
    counts = {"round trips": 0}
    connection = store.inner.client.connection_pool.connection_class
    send = connection.send_packed_command

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["round trips"] += 1
        return send(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(connection, "send_packed_command", counted)
        yield counts
    after = command_calls(observer)
    counts.update({name: n - before.get(name, 0) for name, n in after.items()
                   if name != "info" and n != before.get(name, 0)})
    observer.close()


def two_layers() -> dict[int, dict[str, torch.Tensor]]:
    """`stash`'s two layers as layers 1 and 2."""
    layers = stash()
    return {1: layers[0], 2: layers[2]}


def test_a_refused_take_removes_the_segments_whose_keys_it_took_after_it(
        server: RedisServer, tmp_path: Path) -> None:
    """Rank 2 takes layers 1 and 2 from rank 0 and layer 3 from rank 1; a take that asks
    for layer 1 alone is refused at rank 0's segment, and rank 1's, whose index key the
    same round trip took, goes too rather than wait for the job's end."""
    base = tmp_path / "host"
    first = rank_store(server, base, "refused", 0, consumers={1: 2, 2: 2})
    second = rank_store(server, base, "refused", 1, consumers={3: 2})
    consumer = rank_store(server, base, "refused", 2, producers={1: 0, 2: 0, 3: 1})
    want = two_layers()
    first.put(0, 0, 0, want)
    second.put(0, 0, 0, {3: want[1]})
    assert len(segment_files(base)) == 2
    with pytest.raises(SegmentError, match=r"holds layers \[1, 2\]; a take asked for \[1\]"):
        consumer.take(0, 0, 0, {1: names(want)[1], 3: names(want)[1]})
    assert segment_files(base) == []
    assert connect(server.address).keys("pipefb:refused:0:0:*") == []
    for store in (first, second, consumer):
        store.close()


def test_a_layer_goes_to_the_tier_only_when_its_consumer_shares_it(
        server: RedisServer, tmp_path: Path) -> None:
    """Rank 0 stashes layer 1 for rank 1 (its host) and layer 2 for rank 2 (another)."""
    here, there = tmp_path / "host-a", tmp_path / "host-b"
    producer = rank_store(server, here, "pair", 0, consumers={1: 1, 2: 2})
    first, second = rank_store(server, here, "pair", 1), rank_store(server, there, "pair", 2)
    assert producer.node == first.node != second.node
    want, redis = two_layers(), connect(server.address)
    producer.put(4, 1, 3, want)
    (segment,) = segment_files(here)  # layer 1's, in rank 1's tier
    assert segment.stat().st_size > 0 and segment_files(there) == []
    assert redis.exists(segment_key("pair", 0, 4, 1, 1, 3))  # its index entry
    assert not any(redis.exists(producer.inner.key(4, 1, 1, 3, n)) for n in want[1])
    assert not redis.exists(segment_key("pair", 0, 4, 1, 2, 3))  # layer 2: values in Redis
    assert all(redis.exists(producer.inner.key(4, 1, 2, 3, n)) for n in want[2])
    assert_same(first.take(4, 1, 3, {1: names(want)[1]}), {1: want[1]})
    assert_same(second.take(4, 1, 3, {2: names(want)[2]}), {2: want[2]})
    assert segment_files(here) == [] and redis.keys("pipefb:pair:0:4:*") == []
    for store in (producer, first, second):
        store.close()
    assert redis.keys("pipefb:pair:*") == []  # the tier ranks' set went with the last one


def test_a_layer_goes_to_redis_until_its_consumer_has_opened(
        server: RedisServer, tmp_path: Path) -> None:
    base = tmp_path / "host"
    producer = rank_store(server, base, "late", 0, ranks=2, consumers={1: 1, 2: 1})
    want = two_layers()
    producer.put(0, 0, 0, want)  # rank 1 has not opened its store yet
    assert segment_files(base) == []
    consumer = rank_store(server, base, "late", 1, ranks=2)
    assert_same(consumer.take(0, 0, 0, names(want)), want)  # from Redis, as spilled ones
    producer.put(0, 1, 0, want)
    assert len(segment_files(base)) == 1  # now known: both layers to the tier, one segment
    assert_same(consumer.take(0, 1, 0, names(want)), want)
    producer.close()
    consumer.close()


def test_the_layers_one_consumer_takes_share_one_segment(
        server: RedisServer, tmp_path: Path) -> None:
    """[Note: local tier index]: layers 1 and 2 both go to rank 1: one file, one read."""
    base = tmp_path / "host"
    producer = rank_store(server, base, "group", 0, ranks=2, consumers={1: 1, 2: 1})
    consumer = rank_store(server, base, "group", 1, ranks=2, producers={1: 0, 2: 0})
    want, redis = two_layers(), connect(server.address)
    size = producer.put(0, 0, 0, want)
    (segment,) = segment_files(base)
    assert segment.stat().st_size == size  # counted once, not once per layer
    assert producer.stats.bytes_put == size and producer.stats.keys_put == 1
    assert redis.exists(segment_key("group", 0, 0, 0, 1, 0))  # one index key, the first
    assert not redis.exists(segment_key("group", 0, 0, 0, 2, 0))  # layer's
    got = consumer.take(0, 0, 0, names(want))
    assert_same(got, want)
    assert got[1]["x"].untyped_storage().data_ptr() == got[2]["m"].untyped_storage().data_ptr()
    assert segment_files(base) == [] and redis.keys("pipefb:group:0:0:*") == []
    assert consumer.stats.bytes_taken == size and consumer.stats.keys_taken == 1
    producer.put(0, 1, 0, want)  # a take of one layer of the two is refused by name
    with pytest.raises(SegmentError, match=r"holds layers \[1, 2\]; a take asked for \[1\]"):
        consumer.take(0, 1, 0, {1: names(want)[1]})
    assert segment_files(base) == []  # its index key was taken: the file went too
    assert producer.release(0, 1, 0, names(want)) == 0
    producer.put(0, 2, 0, want)  # release frees the one file, every layer's tensors counted
    assert producer.release(0, 2, 0, names(want)) == 4
    assert segment_files(base) == [] and redis.keys("pipefb:group:0:2:*") == []
    producer.close()
    consumer.close()


def test_a_layer_with_no_named_consumer_needs_every_rank_on_the_tier(
        server: RedisServer, tmp_path: Path) -> None:
    here, there = tmp_path / "host-a", tmp_path / "host-b"
    producer = rank_store(server, here, "unnamed", 0, consumers={1: 1})
    stores = [rank_store(server, here, "unnamed", 1), rank_store(server, there, "unnamed", 2)]
    want = two_layers()
    producer.put(0, 0, 0, want)  # layer 2's consumer unknown, and rank 2 is elsewhere
    assert len(segment_files(here)) == 1
    assert not connect(server.address).exists(segment_key("unnamed", 0, 0, 0, 2, 0))
    assert_same(stores[0].take(0, 0, 0, names(want)), want)
    for store in (producer, *stores):
        store.close()


def test_a_consumer_whose_producer_is_on_another_tier_takes_from_redis_in_one_round_trip(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 (host b) stashes both layers for rank 1 (host a) in Redis; rank 1 knows
    its producer is elsewhere, so it GETDELs the four values and no index key."""
    here, there = tmp_path / "host-a", tmp_path / "host-b"
    producer = rank_store(server, there, "apart", 0, ranks=2, consumers={1: 1, 2: 1})
    consumer = rank_store(server, here, "apart", 1, ranks=2, producers={1: 0, 2: 0})
    want = two_layers()
    for microbatch in range(2):
        producer.put(0, microbatch, 0, want)
        assert segment_files(here) == segment_files(there) == []
        with traffic(server, monkeypatch, consumer) as sent:
            got = consumer.take(0, microbatch, 0, names(want))
        assert sent == {"round trips": 1, "getdel": 4}
        assert_same(got, want)
        for named in got.values():  # each received in place ([Note: values received in
            for t in named.values():  # place]): its data on a 64-byte boundary past a header
                assert t.data_ptr() % 64 == 0 and t.data_ptr() > t.untyped_storage().data_ptr()
    assert connect(server.address).keys("pipefb:apart:0:0:*") == []
    producer.close()
    consumer.close()


def test_a_consumer_whose_producer_shares_its_tier_takes_the_segments(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path / "host"
    producer = rank_store(server, base, "near", 0, ranks=2, consumers={1: 1, 2: 1})
    consumer = rank_store(server, base, "near", 1, ranks=2, producers={1: 0, 2: 0})
    want = two_layers()
    producer.put(0, 0, 0, want)
    assert len(segment_files(base)) == 1  # one consumer takes both layers: one segment
    with traffic(server, monkeypatch, consumer) as sent:
        assert_same(consumer.take(0, 0, 0, names(want)), want)
    assert sent == {"round trips": 1, "getdel": 1}  # the segment's one index key
    assert segment_files(base) == []
    producer.close()
    consumer.close()


def test_a_take_from_producers_here_and_elsewhere_is_one_round_trip(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 1 comes from rank 0 on this host's tier, layer 2 from rank 2's Redis keys."""
    here, there = tmp_path / "host-a", tmp_path / "host-b"
    near = rank_store(server, here, "both", 0, consumers={1: 1})
    far = rank_store(server, there, "both", 2, consumers={2: 1})
    consumer = rank_store(server, here, "both", 1, producers={1: 0, 2: 2})
    want = two_layers()
    near.put(3, 0, 1, {1: want[1]})
    far.put(3, 0, 1, {2: want[2]})
    assert len(segment_files(here)) == 1 and segment_files(there) == []
    with traffic(server, monkeypatch, consumer) as sent:
        assert_same(consumer.take(3, 0, 1, names(want)), want)
    assert sent == {"round trips": 1, "getdel": 3}  # layer 1's index key, layer 2's values
    assert segment_files(here) == []
    for store in (near, far, consumer):
        store.close()


def test_a_producer_not_in_the_tier_ranks_yet_is_taken_through_the_index(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 has no tier store at first (its values are in Redis), then opens one on
    rank 1's tier: rank 1 looks its producer's segment up in the index meanwhile, and
    finds both layers."""
    base = tmp_path / "host"
    consumer = rank_store(server, base, "unseen", 1, ranks=2, producers={1: 0, 2: 0})
    want = two_layers()
    plain = open_store(server.address, "unseen", 0)
    plain.put(0, 0, 0, want)
    with traffic(server, monkeypatch, consumer) as sent:
        assert_same(consumer.take(0, 0, 0, names(want)), want)
    # the set read and the producer's index key in one round trip, then the four values
    assert sent == {"round trips": 2, "smembers": 1, "getdel": 5}
    producer = rank_store(server, base, "unseen", 0, ranks=2, consumers={1: 1, 2: 1})
    producer.put(0, 1, 0, want)
    assert len(segment_files(base)) == 1
    with traffic(server, monkeypatch, consumer) as sent:
        assert_same(consumer.take(0, 1, 0, names(want)), want)
    assert sent == {"round trips": 1, "smembers": 1, "getdel": 1}
    assert segment_files(base) == []
    for store in (plain, producer, consumer):
        store.close()


@pytest.mark.parametrize(("options", "named"), [
    ({"local_tier_rank": 3}, "rank 3"), ({"local_tier_rank": -1}, "rank -1"),
    ({"local_tier_consumers": {1: 3}}, "consumer of layer 1: rank 3"),
    ({"local_tier_consumers": {-2: 0}}, "layer -2"),
    ({"local_tier_producers": {4: 5}}, "producer of layer 4: rank 5"),
    ({"local_tier_producers": {0: -1}}, "producer of layer 0: rank -1"),
    ({"local_tier_producers": {-3: 1}}, "producer of layer -3")])
def test_a_rank_or_consumer_out_of_range_is_refused(
        server: RedisServer, tmp_path: Path, options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        open_store(server.address, "bad", 0, local_tier_dir=str(tmp_path / "t"),
                   local_tier_ranks=3, **options)


def example_plans() -> dict[str, Plan]:
    """PipeFB on 4 ranks (forward 0, 1; backward 2, 3), on 3 (one forward stage, two
    backward), 1F1B on 2, and PipeFB on 4 as 2 groups of one pair each; 6 layers."""
    costs = [1.0] * 6
    return {"split": balanced_plan("pipefb", 4, costs, 8, 4),
            "uneven": balanced_plan("pipefb", 3, costs, 8, 4),
            "combined": balanced_plan("1f1b", 2, costs, 8, 4),
            "groups": balanced_plan("pipefb", 4, costs, 8, 4, groups=2)}


def by_rank(plans: dict[str, Plan], of: Any) -> dict[str, list[dict[int, int]]]:
    return {name: [of(plan, r) for r in range(len(plan.assignment))]
            for name, plan in plans.items()}


def test_the_consumers_of_a_ranks_layers_follow_the_plan() -> None:
    assert by_rank(example_plans(), stash_consumers) == {
        "split": [{0: 2, 1: 2, 2: 2}, {3: 3, 4: 3, 5: 3}, {}, {}],
        "uneven": [{0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 5: 2}, {}, {}],
        "combined": [{0: 0, 1: 0, 2: 0}, {3: 1, 4: 1, 5: 1}],
        "groups": [{i: 1 for i in range(6)}, {}, {i: 3 for i in range(6)}, {}]}


def test_the_producers_of_a_ranks_layers_follow_the_plan() -> None:
    plans = example_plans()
    assert by_rank(plans, stash_producers) == {
        "split": [{}, {}, {0: 0, 1: 0, 2: 0}, {3: 1, 4: 1, 5: 1}],
        "uneven": [{}, {0: 0, 1: 0, 2: 0}, {3: 0, 4: 0, 5: 0}],
        "combined": [{0: 0, 1: 0, 2: 0}, {3: 1, 4: 1, 5: 1}],
        "groups": [{}, {i: 0 for i in range(6)}, {}, {i: 2 for i in range(6)}]}
    for plan in plans.values():  # each rank's producer names it as that layer's consumer
        for rank in range(len(plan.assignment)):
            for layer, producer in stash_producers(plan, rank).items():
                assert stash_consumers(plan, producer)[layer] == rank


# worker -> its tier ("main": the cluster's own): worker i registers i-th, so it is rank i
# of a job on all four. PipeFB on 4 puts forward stage s on rank s and its backward on
# rank 2 + s: ranks 0 and 2 share the main tier, rank 1 (tier b) and 3 (tier c) do not.
TIERS = ["main", "b", "main", "c"]
BATCH = 256  # samples per step: the mlp's stash, far above the store's own traffic


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, dict[str, Path]]]:
    """A local cluster whose 4 workers use 3 tier directories (`TIERS`), as on 3 hosts."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    root = tmp_path_factory.mktemp("spread")
    with LocalServices(0, root / "logs", threads=WORKER_THREADS) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        assert cluster.tier_dir is not None
        dirs = {"main": cluster.tier_dir, "b": root / "tier-b", "c": root / "tier-c"}
        for index, name in enumerate(TIERS):  # one at a time: registry ids in this order
            flags = [] if name == "main" else ["--local-tier-dir", str(dirs[name])]
            cluster.add_worker(index, flags).wait_ready()
            client.wait_for_workers(index + 1)
        yield client, cluster, dirs


def rank_tiers(client: Any, job_id: str) -> list[str]:
    """The tier of each rank of the job, from the registry ids the coordinator gave them."""
    names = {w.worker_id: w.name for w in client.workers()}
    return [TIERS[int(names[i].rpartition("-")[2])] for i in client.status(job_id).worker_ids]


def train_spread(client: Any, cluster: Any, workers: int) -> tuple[list[str], list[Any], int]:
    """Runs an mlp PipeFB job on `workers` ranks, checks it against one process; returns
    its ranks' tiers, its reports and the bytes Redis received meanwhile.

    Each key the job sets is taken once, so GETDELs past SETs are index look-ups that
    found nothing; a backward rank takes from Redis straight once it has seen its forward
    rank on another tier, which its first take (one on each of its two threads, the
    compute thread's and the prefetch's, at most) may not have yet.
    """
    job = make_job("mlp", "pipefb", workers, "adamw", batch_size=BATCH)
    before, calls = redis_input_bytes(cluster), command_calls(store_client(cluster))
    reports, weights = run_on_cluster(client, job)
    after = command_calls(store_client(cluster))
    missed = after["getdel"] - calls.get("getdel", 0) - (after["set"] - calls.get("set", 0))
    layers = len(build_layers(job))
    assert 0 <= missed <= 2 * layers, (missed, layers)
    assert_same_training(job, reports, weights)
    return rank_tiers(client, reports[0].job_id), reports, redis_input_bytes(cluster) - before


def stashed(reports: list[Any]) -> list[int]:
    """The bytes each rank stashed, all steps."""
    return [sum(r.workers[k].bytes_stashed for r in reports)
            for k in range(len(reports[0].workers))]


def in_tier(reports: list[Any]) -> list[list[int]]:
    """Each rank's peak bytes in the node-local tier (memory kind `node_tier`), by step."""
    return [[r.workers[k].kind_peak_bytes["node_tier"] for r in reports]
            for k in range(len(reports[0].workers))]


def test_the_pair_on_one_tier_uses_it_and_the_pair_across_tiers_redis(
        spread: tuple[Any, Any, dict[str, Path]]) -> None:
    client, cluster, dirs = spread
    tiers, reports, to_redis = train_spread(client, cluster, 4)
    assert tiers == TIERS
    put = stashed(reports)
    assert put[0] > 0 and put[1] > 0 and put[2:] == [0, 0]
    peaks = in_tier(reports)
    assert max(peaks[0]) > 0  # rank 0's stashes went to rank 2 through the main tier
    assert peaks[1:] == [[0] * len(reports)] * 3  # rank 1's to rank 3 through Redis
    assert put[1] <= to_redis < put[1] + put[0] / 2, (to_redis, put)
    assert all(segments_left(folder) == [] for folder in dirs.values())  # all consumed


def test_a_job_with_every_rank_on_another_tier_stashes_in_redis(
        spread: tuple[Any, Any, dict[str, Path]]) -> None:
    client, cluster, dirs = spread
    tiers, reports, to_redis = train_spread(client, cluster, 2)  # workers 0 and 1
    assert tiers == TIERS[:2]
    put = sum(stashed(reports))
    assert put > 0 and to_redis > put
    assert in_tier(reports) == [[0] * len(reports)] * 2
    assert all(segments_left(folder) == [] for folder in dirs.values())
