"""A take's values received straight into buffers of their own ([Note: values received in
place] in offload_store/receive.py), against real redis-server processes on 127.0.0.1,
and a whole job whose every stash goes through Redis as values of one key equal to one
process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch
from redis.connection import ConnectionPool

from offload_store import OffloadStore, connect, job_pattern
from offload_store import receive as receive_module
from offload_store.receive import ALIGN, getdel_frames
from pipefb.codec import pack, unpack
from pipefb.errors import CodecError
from tests import test_offload_store
from tests.conftest import WORKER_THREADS, store_client
from tests.test_store_chunks import one_reply_peer, trains_bit_for_bit
from tests.test_transparency import make_job

server = test_offload_store.server  # the store tests' fixtures: a Redis for the module
client = test_offload_store.client  # (256 MB, noeviction) and a client of it per test


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _values() -> dict[str, torch.Tensor]:
    """Small values of the dtypes a stash holds, with a non-contiguous, a 0-d, an odd-sized
    and an empty one among them."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 10, generator=g)
    x[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {"f32": x,
            "f32_t": x.t(),  # non-contiguous
            "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
            "i64": torch.randint(-2**62, 2**62, (4, 2, 3), generator=g, dtype=torch.int64),
            "mask": torch.rand(13, generator=g) > 0.5,
            "scalar": torch.tensor(-2.5, dtype=torch.float64),
            "odd": torch.arange(7, dtype=torch.int8),
            "empty": torch.zeros(0, 4)}


def _getdels(observer: redis.Redis) -> int:
    """GETDEL commands the server has run so far."""
    return int(observer.info("commandstats").get("cmdstat_getdel", {}).get("calls", 0))


def _connections(observer: redis.Redis) -> int:
    """Connections the server has accepted so far."""
    return int(observer.info("stats")["total_connections_received"])


@pytest.fixture
def observer(server: Any) -> Iterator[redis.Redis]:
    """A client of its own, opened before the test looks at the server's counters."""
    conn = connect(server.address)
    conn.ping()
    yield conn
    conn.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_small_value_s_tensor_views_the_buffer_it_arrived_in(server: Any,
                                                               protocol: int) -> None:
    """Each value of one key comes back bit for bit in a buffer of its own: its storage is
    the frame plus at most `ALIGN` bytes (a copying decode's storage is the data alone),
    its data on an `ALIGN` boundary inside it; no two values share a buffer."""
    conn = connect(server.address, protocol=protocol)
    store, values = OffloadStore(conn, f"zc.view{protocol}"), _values()
    store.put(0, 1, 2, {3: values})
    got = store.take(0, 1, 2, {3: list(values)})[3]
    storages = set()
    for name, want in values.items():
        t = got[name]
        assert (t.dtype, t.shape) == (want.dtype, want.shape), name
        assert _bits(t) == _bits(want), name
        if not want.numel():  # nothing to view: a new empty tensor
            continue
        frame, storage = len(pack(want)), t.untyped_storage()
        assert frame <= storage.nbytes() <= frame + ALIGN, name
        start = storage.data_ptr()
        assert start < t.data_ptr() and t.data_ptr() + t.nbytes <= start + storage.nbytes()
        assert t.data_ptr() % ALIGN == 0 and t.is_contiguous(), name
        storages.add(start)
    assert len(storages) == len(values) - 1
    assert store.count_keys() == 0
    conn.close()


def test_taken_tensors_are_writable_and_independent(client: redis.Redis) -> None:
    store = OffloadStore(client, "zc.writable")
    t = torch.arange(100, dtype=torch.float32)
    store.put(0, 0, 0, {0: {"x": t, "y": t}, 1: {"z": t}})
    got = store.take(0, 0, 0, {0: ["x", "y"], 1: ["z"]})
    got[0]["x"] += 1
    got[1]["z"].mul_(2)
    assert torch.equal(got[0]["x"], t + 1) and torch.equal(got[0]["y"], t)
    assert torch.equal(got[1]["z"], t * 2)


def test_a_take_is_one_round_trip_of_one_getdel_per_key(
        client: redis.Redis, observer: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted client side (writes of packed commands by the store's connections) and by
    the server (INFO commandstats): one pipeline, one GETDEL per value."""
    store, values = OffloadStore(client, "zc.trips"), _values()
    store.put(0, 0, 0, {0: values, 1: {"x": torch.ones(3)}})
    sent = []
    connection = client.connection_pool.connection_class
    send = connection.send_packed_command

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(1)
        return send(self, *args, **kwargs)

    before = _getdels(observer)
    with monkeypatch.context() as patch:
        patch.setattr(connection, "send_packed_command", counted)
        store.take(0, 0, 0, {0: list(values), 1: ["x"]})
    assert len(sent) == 1
    assert _getdels(observer) - before == 9


def test_a_missing_key_raises_key_error_naming_it_and_the_rest_is_taken(
        client: redis.Redis) -> None:
    store = OffloadStore(client, "zc.missing", attempt=1)
    store.put(2, 0, 1, {4: {"a": torch.ones(2)}})
    with pytest.raises(KeyError) as info:
        store.take(2, 0, 1, {4: ["a", "nope"]})
    assert info.value.args[0] == "pipefb:zc.missing:1:2:0:4:1:nope"
    assert store.count_keys() == 0 and store.stats.keys_taken == 1
    store.put(3, 0, 1, {4: {"a": torch.ones(2)}})  # the connection serves the next take
    assert torch.equal(store.take(3, 0, 1, {4: ["a"]})[4]["a"], torch.ones(2))


FRAME = pack(torch.arange(6, dtype=torch.float32).reshape(2, 3))
BAD_VALUES = {
    "truncated": FRAME[:-3],
    "too long": FRAME + b"\x00" * 4,
    "cut header": FRAME[:10],
    "foreign": b"hello, not a tensor frame",
    "short": b"PFT",
    "empty": b"",
    "bad dtype": b"PFT1\x63\x00",
    "bad bool": pack(torch.ones(3, dtype=torch.bool))[:-1] + b"\x02",
    "huge shape": b"PFT1\x03\x01" + b"\xff" * 8,
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_bad_value_is_refused_as_unpack_refuses_it_and_the_connection_is_reused(
        client: redis.Redis, observer: redis.Redis, name: str) -> None:
    """A value written with plain redis-py that is no frame, or a damaged one, raises the
    `CodecError` `unpack` raises for its bytes; the other key of the take is deleted; the
    same pooled connection serves the next take."""
    raw = BAD_VALUES[name]
    with pytest.raises(CodecError) as want:
        unpack(raw)
    store = OffloadStore(client, "zc.bad")
    store.put(0, 0, 0, {0: {"good": torch.ones(3)}})
    client.set(store.key(0, 0, 0, 0, "bad"), raw)
    opened = _connections(observer)
    with pytest.raises(CodecError) as got:
        store.take(0, 0, 0, {0: ["good", "bad"]})
    assert str(got.value) == str(want.value)
    assert store.count_keys() == 0
    store.put(1, 0, 0, {0: {"x": torch.full((5,), 7.0)}})
    assert torch.equal(store.take(1, 0, 0, {0: ["x"]})[0]["x"], torch.full((5,), 7.0))
    assert _connections(observer) == opened


def test_a_value_of_the_wrong_type_raises_the_server_s_error(client: redis.Redis) -> None:
    store = OffloadStore(client, "zc.type")
    client.rpush(store.key(0, 0, 0, 0, "list"), b"x")
    store.put(0, 0, 0, {0: {"x": torch.ones(1)}})
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        store.take(0, 0, 0, {0: ["list", "x"]})
    assert store.count_keys() == 1  # GETDEL leaves a key of another type; "x" is gone
    store.clear_job()


def test_a_value_over_the_limit_is_refused_from_its_length_before_any_buffer(
        client: redis.Redis, observer: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value longer than `max_bytes` and a header is read and dropped without a buffer
    (`frame_buffer` is asked only for the other value), refused with a `CodecError` naming
    its key and length; the connection serves the next take."""
    store = OffloadStore(client, "zc.limit", max_bytes=1024)
    big, small = torch.zeros(2048, dtype=torch.uint8), torch.ones(256, dtype=torch.uint8)
    store.put(0, 0, 0, {0: {"big": big, "small": small}})
    allocated: list[int] = []
    frame_buffer = receive_module.frame_buffer

    def counted(frame_bytes: int, head_bytes: int) -> torch.Tensor:
        allocated.append(frame_bytes)
        return frame_buffer(frame_bytes, head_bytes)

    opened = _connections(observer)
    monkeypatch.setattr(receive_module, "frame_buffer", counted)
    key = store.key(0, 0, 0, 0, "big")
    with pytest.raises(CodecError, match=f"stash value '{key}' of {len(pack(big))} bytes "
                                         "exceeds the 1094 bytes a take accepts"):
        store.take(0, 0, 0, {0: ["big", "small"]})
    assert allocated == [len(pack(small))]
    assert store.count_keys() == 0
    store.put(1, 0, 0, {0: {"small": small}})
    assert torch.equal(store.take(1, 0, 0, {0: ["small"]})[0]["small"], small)
    assert _connections(observer) == opened
    with pytest.raises(ValueError, match="max_bytes -1 must be a non-negative int"):
        OffloadStore(client, "zc.limit", max_bytes=-1)


# --- a whole job --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A 2-worker cluster without the node-local tier: every stash goes to Redis, each
    value one key (the default chunk size)."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    with LocalServices(2, tmp_path_factory.mktemp("zerocopy"), threads=WORKER_THREADS,
                       extra_env={"PIPEFB_LOCAL_TIER_DIR": ""}) as cluster, \
            CoordinatorClient(cluster.coordinator) as coordinator:
        coordinator.wait_for_workers(2)
        yield coordinator, cluster


def test_a_job_whose_stashes_all_go_through_redis_trains_as_one_process(
        redis_only: tuple[Any, Any]) -> None:
    """PipeFB on 2 workers, every stash taken from Redis into buffers of its own: the
    losses and weights are `single`'s bit for bit, and the store keeps no key of the job."""
    coordinator, cluster = redis_only
    assert cluster.tier_dir is None
    job = make_job("mlp", "pipefb", 2, "adamw", batch_size=64,
                   model_config={"hidden": 256, "depth": 3})
    observer = store_client(cluster)
    before = _getdels(observer)
    job_id, reports = trains_bit_for_bit(coordinator, job)
    assert sum(w.bytes_stashed for r in reports for w in r.workers) > 3 * 4 * 16 * 256 * 4
    assert _getdels(observer) > before
    assert list(observer.scan_iter(match=job_pattern(job_id))) == []


# --- the replies (offload_store/receive.py) -----------------------------------------------


def test_every_kind_of_reply_comes_back_as_its_own_kind() -> None:
    """From a peer that answers five GETDELs with a RESP2 nil, a RESP3 nil, an error, a
    frame and a foreign value: None, None, the error, a frame in an aligned buffer,
    bytes."""
    frame = pack(torch.arange(5, dtype=torch.int64))
    replies = (b"$-1\r\n_\r\n-ERR no\r\n$%d\r\n%s\r\n$3\r\nabc\r\n" % (len(frame), frame))
    port, thread, seen = one_reply_peer(replies, close=True)
    pool = ConnectionPool(host="127.0.0.1", port=port, protocol=2, socket_timeout=10,
                          driver_info=None)
    got = getdel_frames(pool, ["a", "b", "c", "d", "e"], 1 << 20)
    pool.disconnect()
    thread.join(10)
    assert got[:2] == [None, None] and isinstance(got[2], redis.ResponseError)
    assert isinstance(got[3], torch.Tensor) and bytes(got[3].numpy()) == frame
    assert (got[3].data_ptr() + 6 + 8) % ALIGN == 0  # the data, after a header of rank 1
    assert got[4] == b"abc"
    assert seen[0].count(b"GETDEL") == 5


def test_a_value_cut_short_raises_and_the_connection_is_closed() -> None:
    frame = pack(torch.zeros(100))
    port, thread, seen = one_reply_peer(b"$%d\r\n%s" % (len(frame), frame[:50]), close=True)
    pool = ConnectionPool(host="127.0.0.1", port=port, protocol=2, socket_timeout=10,
                          driver_info=None)
    with pytest.raises(redis.ConnectionError, match="closed the connection"):
        getdel_frames(pool, ["pipefb:k"], 1 << 20)
    thread.join(10)
    assert seen == [b"*2\r\n$6\r\nGETDEL\r\n$8\r\npipefb:k\r\n"]  # sent once
    assert pool._available_connections[0]._sock is None  # disconnected in the pool
