"""Chunked values in the Redis store ([Note: chunked values] in offload_store/chunks.py),
against real redis-server processes on 127.0.0.1, and a whole job whose stashes go
through Redis in chunks equal to one process."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis.connection import ConnectionPool

from offload_store import (
    OffloadStore,
    RedisServer,
    StashFullError,
    StoreStats,
    connect,
    job_pattern,
    open_admin,
    open_store,
)
from offload_store.chunks import CHUNK_ENV, MAGIC, MIN_CHUNK_BYTES, Manifest, split
from offload_store.frames import Frame
from offload_store.keys import chunk_key
from offload_store.receive import ALIGN, getdel_into
from pipefb.codec import pack
from pipefb.errors import CodecError
from tests import test_offload_store
from tests.conftest import WORKER_THREADS, store_client
from tests.test_transparency import make_job, reference

server = test_offload_store.server  # the store tests' fixtures: a Redis for the module
client = test_offload_store.client  # (256 MB, noeviction) and a client of it per test
KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB  # the chunk size of these tests' stores


def _store(client: redis.Redis, job: str, **options: Any) -> OffloadStore:
    return OffloadStore(client, job, 1, chunk_bytes=options.pop("chunk_bytes", CHUNK),
                        **options)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _stash() -> dict[int, dict[str, torch.Tensor]]:
    """Large values of several dtypes (a non-contiguous one among them) beside small ones,
    over three layers."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(256, 300, generator=g)
    wide[0, :5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -float("inf")])
    return {
        0: {"f32": torch.randn(3, 100, 250, generator=g),  # 300,000 bytes: 5 chunks
            "small": torch.randn(4, 6, generator=g),
            "bf16": torch.randn(500, 203, generator=g).to(torch.bfloat16)},
        2: {"i64": torch.randint(-2**62, 2**62, (20_000,), generator=g, dtype=torch.int64),
            "wide_t": wide.t(),  # non-contiguous, 307,200 bytes
            "mask": torch.rand(9, generator=g) > 0.5},
        5: {"at_limit": torch.zeros(CHUNK - len(pack(torch.zeros(1, dtype=torch.uint8))) + 1,
                                    dtype=torch.uint8),  # a frame of exactly CHUNK bytes
            "past_limit": torch.arange(CHUNK // 4 - 3, dtype=torch.float32)},  # CHUNK + 2:
    }  # its data fits one chunk


def _names(tensors: dict[int, dict[str, torch.Tensor]]) -> dict[int, list[str]]:
    return {layer: list(named) for layer, named in tensors.items()}


def _keys_of(tensors: dict[int, dict[str, torch.Tensor]]) -> int:
    """Keys the stash takes in a store of chunk size CHUNK: one per value, plus a value's
    chunks where its frame is longer than a chunk."""
    keys = 0
    for named in tensors.values():
        for t in named.values():
            frame = Frame.of(t)
            keys += 1 + (-(-frame.body.nbytes // CHUNK) if len(frame) > CHUNK else 0)
    return keys


def _assert_same(got: dict[int, dict[str, torch.Tensor]],
                 want: dict[int, dict[str, torch.Tensor]]) -> None:
    assert got.keys() == want.keys()
    for layer, named in want.items():
        assert got[layer].keys() == named.keys()
        for name, t in named.items():
            assert (got[layer][name].dtype, got[layer][name].shape) == (t.dtype, t.shape)
            assert _bits(got[layer][name]) == _bits(t), (layer, name)


def test_chunk_key_literal_is_under_the_job_pattern() -> None:
    assert chunk_key("pipefb:j1:0:3:1:7:2:s0", 12) == "pipefb:j1:0:3:1:7:2:s0:12"
    assert job_pattern("j1") == "pipefb:j1:*"
    with pytest.raises(ValueError, match="chunk"):
        chunk_key("pipefb:j1:0:3:1:7:2:s0", -1)


def test_a_multi_chunk_stash_round_trips_bit_for_bit_and_leaves_nothing(
        client: redis.Redis) -> None:
    store, tensors = _store(client, "chunks.rt"), _stash()
    nbytes = sum(len(pack(t)) for named in tensors.values() for t in named.values())
    assert store.put(4, 1, 2, tensors) == nbytes
    assert store.count_keys() == _keys_of(tensors) == 8 + 5 + 4 + 3 + 5 + 1
    # the value key holds the manifest; its chunks, in order, the frame's data
    key = store.key(4, 1, 0, 2, "f32")
    manifest = client.get(key)
    assert manifest is not None and manifest.startswith(MAGIC)
    layout = Manifest.parse(manifest, key)
    assert (layout.count, layout.chunk_bytes) == (5, CHUNK)
    data = b"".join(client.get(chunk_key(key, i)) or b"" for i in range(layout.count))
    assert layout.head + data == pack(tensors[0]["f32"])
    assert client.get(chunk_key(key, 5)) is None
    # values up to the chunk size stay one key holding the frame
    assert client.get(store.key(4, 1, 5, 2, "at_limit")) == pack(tensors[5]["at_limit"])
    assert len(pack(tensors[5]["at_limit"])) == CHUNK
    assert len(pack(tensors[5]["past_limit"])) == CHUNK + 2
    assert client.get(store.key(4, 1, 0, 2, "small")) == pack(tensors[0]["small"])
    _assert_same(store.take(4, 1, 2, _names(tensors)), tensors)
    assert store.count_keys() == 0  # every chunk key went with the take
    assert store.stats == StoreStats(nbytes, nbytes, 8, 8, 0)  # counted per value


def test_taken_tensors_are_writable_and_independent(client: redis.Redis) -> None:
    store = _store(client, "chunks.writable")
    t = torch.arange(50_000, dtype=torch.float32)
    store.put(0, 0, 0, {0: {"x": t, "y": t}})
    got = store.take(0, 0, 0, {0: ["x", "y"]})[0]
    got["x"] += 1
    assert torch.equal(got["x"], t + 1) and torch.equal(got["y"], t)


def test_a_chunked_value_s_tensor_views_the_buffer_its_chunks_arrived_in(
        client: redis.Redis) -> None:
    """Zero-copy decode: each value's tensor, chunked or of one key, lies in its own receive
    buffer (its storage is that buffer: the frame plus at most `ALIGN` bytes, its data on
    an `ALIGN` boundary), equal to what was put."""
    store, tensors = _store(client, "chunks.view"), _stash()
    store.put(4, 1, 2, tensors)
    got = store.take(4, 1, 2, _names(tensors))
    _assert_same(got, tensors)
    chunked = {(0, "f32"), (0, "bf16"), (2, "i64"), (2, "wide_t"), (5, "past_limit")}
    for layer, named in tensors.items():
        for name, want in named.items():
            t, frame = got[layer][name], len(pack(want))
            assert (frame > CHUNK) == ((layer, name) in chunked), name
            assert frame <= t.untyped_storage().nbytes() <= frame + ALIGN, name
            assert t.data_ptr() % ALIGN == 0 and t.is_contiguous(), name


def test_every_chunk_key_has_the_ttl(client: redis.Redis) -> None:
    store = _store(client, "chunks.ttl", ttl_seconds=90)
    store.put(0, 0, 0, {1: {"x": torch.randn(100_000)}})
    keys = list(client.scan_iter(match=job_pattern("chunks.ttl")))
    assert len(keys) == 1 + 7
    assert all(0 < client.ttl(key) <= 90 for key in keys)
    assert store.clear_job() == 8


def test_a_missing_chunk_raises_key_error_naming_it_and_every_key_goes(
        client: redis.Redis) -> None:
    store, tensors = _store(client, "chunks.missing"), _stash()
    store.put(0, 0, 0, tensors)
    gone = chunk_key(store.key(0, 0, 2, 0, "i64"), 1)
    assert client.delete(gone) == 1
    with pytest.raises(KeyError) as info:
        store.take(0, 0, 0, _names(tensors))
    assert info.value.args[0] == "pipefb:chunks.missing:1:0:0:2:0:i64:1"
    assert store.count_keys() == 0  # the other values and chunks were consumed anyway
    assert store.stats.keys_taken == 8 and store.stats.live_bytes == 0


@pytest.mark.parametrize(("chunk", "value", "error"), [
    (2, b"short", "holds 5 bytes; its manifest says 65536"),
    (2, b"x" * (CHUNK + 1), "holds 65537 bytes; its manifest says 65536"),
    (4, b"", "holds 0 bytes; its manifest says 37856"),  # the last, shorter chunk
])
def test_a_chunk_of_the_wrong_length_is_refused_with_codec_error(
        client: redis.Redis, chunk: int, value: bytes, error: str) -> None:
    store, tensors = _store(client, "chunks.corrupt"), _stash()
    store.put(0, 0, 0, tensors)
    client.set(chunk_key(store.key(0, 0, 0, 0, "f32"), chunk), value)
    with pytest.raises(CodecError, match=error):
        store.take(0, 0, 0, _names(tensors))
    assert store.count_keys() == 0
    store.put(1, 0, 0, tensors)  # the replies after the bad chunk were read in step
    _assert_same(store.take(1, 0, 0, _names(tensors)), tensors)


def test_a_chunk_of_the_wrong_type_raises_the_server_s_error(client: redis.Redis) -> None:
    store, tensors = _store(client, "chunks.type"), _stash()
    store.put(0, 0, 0, tensors)
    wrong = chunk_key(store.key(0, 0, 2, 0, "wide_t"), 3)
    client.delete(wrong)
    client.rpush(wrong, b"x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        store.take(0, 0, 0, _names(tensors))
    client.delete(wrong)
    assert store.count_keys() == 0
    store.put(1, 0, 0, tensors)
    _assert_same(store.take(1, 0, 0, _names(tensors)), tensors)


def test_a_corrupt_manifest_is_refused_before_anything_is_allocated(
        client: redis.Redis) -> None:
    """A manifest is bounded as a frame is: a data size past the codec's limit, a tiny
    chunk size, or a codec header that `unpack` refuses are `CodecError`s."""
    store = _store(client, "chunks.manifest")
    key = store.key(0, 0, 0, 0, "x")
    layout = struct.Struct("<4sQQ")
    for manifest, error in [
            (layout.pack(MAGIC, 1 << 40, CHUNK), "declares 1099511627776 data bytes"),
            (layout.pack(MAGIC, 10 * CHUNK, 16), "in chunks of 16"),
            (MAGIC + b"\0", "malformed")]:
        client.set(key, manifest)
        with pytest.raises(CodecError, match=error):
            store.take(0, 0, 0, {0: ["x"]})
    store.put(0, 0, 0, {0: {"x": torch.randn(40_000)}})
    value = bytearray(client.get(key) or b"")
    value[len(value) - 9] = 99  # the rank byte of the codec header (rank 1)
    client.set(key, bytes(value))
    with pytest.raises(CodecError, match="rank 99"):
        store.take(0, 0, 0, {0: ["x"]})
    assert store.count_keys() == 0


def test_clear_job_removes_a_half_written_chunked_value(client: redis.Redis) -> None:
    """A writer that died midway left the manifest and some chunks: the take refuses it;
    one that died before its manifest left chunks alone, which clearing the job (SCAN by
    its pattern) finds."""
    store = _store(client, "chunks.half")
    t = torch.randn(200_000)  # 800,000 bytes: 13 chunks
    key = store.key(3, 0, 1, 0, "x")
    items = split(key, Frame.of(t), CHUNK)
    assert len(items) == 14

    def write(keys: list[str]) -> None:
        for written in keys:
            value = items[written]
            client.set(written, value if isinstance(value, bytes) else bytes(value.body))

    write(list(items)[:7])  # the manifest and chunks 0-5
    assert store.count_keys() == 7
    with pytest.raises(KeyError) as info:
        store.take(3, 0, 0, {1: ["x"]})
    assert info.value.args[0] == chunk_key(key, 6)
    assert store.count_keys() == 0
    write(list(items)[1:4])  # chunks 0-2, no manifest
    store.put(3, 1, 0, {1: {"x": t}})  # and another micro-batch's whole stash
    assert store.count_keys() == 3 + 14
    assert store.clear_job() == 3 + 14 and store.count_keys() == 0


def test_a_consumer_on_another_tier_takes_chunked_values_straight_from_redis(
        server: RedisServer, tmp_path: Path) -> None:
    """A node-local tier's producer stashes for a consumer on another tier in Redis, its
    large values in chunks; the consumer, which takes such layers from Redis ([Note: tier
    ranks]), gets every value back whole and no key stays."""
    from tests.test_shm_tier import tier

    producer = tier(server, tmp_path / "host-b", "chunks.apart", ranks=2,
                    local_tier_rank=0, local_tier_consumers={0: 1, 2: 1}, chunk_bytes=CHUNK)
    consumer = tier(server, tmp_path / "host-a", "chunks.apart", ranks=2,
                    local_tier_rank=1, local_tier_producers={0: 0, 2: 0}, chunk_bytes=CHUNK)
    try:
        tensors = {layer: named for layer, named in _stash().items() if layer in (0, 2)}
        producer.put(0, 0, 0, tensors)
        assert producer.inner.count_keys() == _keys_of(tensors)  # all in Redis, chunked
        _assert_same(consumer.take(0, 0, 0, _names(tensors)), tensors)
        assert producer.inner.count_keys() == 0
    finally:
        producer.close()
        consumer.close()


def test_release_frees_every_chunk(client: redis.Redis) -> None:
    store, tensors = _store(client, "chunks.release"), _stash()
    store.put(1, 1, 1, tensors)
    assert store.release(1, 1, 1, _names(tensors)) == 8  # values, not chunk keys
    assert store.count_keys() == 0
    assert store.release(1, 1, 1, _names(tensors)) == 0


def test_the_store_memory_counts_chunks_until_the_take(server: RedisServer,
                                                       client: redis.Redis) -> None:
    """The coordinator's `used_memory` (INFO memory) holds a chunked stash's bytes while
    it is stored, and no longer once it is taken."""
    admin = open_admin(server.address)
    store = _store(client, "chunks.memory")
    try:
        before = admin.used_memory()
        store.put(0, 0, 0, {0: {"x": torch.randn(4 * MiB)}})  # 16 MiB in 256 chunks
        assert admin.used_memory() - before >= 16 * MiB
        store.take(0, 0, 0, {0: ["x"]})
        assert admin.used_memory() - before < 2 * MiB
    finally:
        admin.close()


def test_a_full_store_refuses_a_chunked_put_and_keeps_no_chunk() -> None:
    """Redis at maxmemory with noeviction refuses the chunks past what fits: the put backs
    off, raises StashFullError, and unlinks the chunks it did write."""
    with RedisServer(maxmemory="8mb") as srv:
        client = connect(srv.address)
        store = _store(client, "chunks.full", max_wait_seconds=0.3, chunk_bytes=MiB)
        x = torch.randn(4 * MiB)  # 16 MiB in 16 chunks; about half of them fit
        with pytest.raises(StashFullError) as info:
            store.put(2, 1, 0, {0: {"x": x}})
        assert info.value.nbytes == len(pack(x))
        assert store.stats.retries > 0 and store.stats.keys_put == 0
        assert int(client.info("commandstats")["cmdstat_set"]["calls"]) > 3  # some fitted
        assert store.count_keys() == 0
        assert client.info("stats")["evicted_keys"] == 0
        y = torch.randn(MiB // 2)  # 2 MiB in 2 chunks fits again
        store.put(2, 1, 0, {0: {"y": y}})
        assert torch.equal(store.take(2, 1, 0, {0: ["y"]})[0]["y"], y)
        client.close()


def test_the_chunk_size_is_an_option_and_an_env_var(server: RedisServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    t = torch.randn(2 * MiB)  # 8 MiB: chunked at the default size (4 MiB)
    for options, env, keys in [({}, None, 1 + 2), ({"chunk_bytes": 0}, None, 1),
                               ({}, "0", 1), ({}, str(MIN_CHUNK_BYTES), 1 + 2048),
                               ({"chunk_bytes": 2 * MiB}, "0", 1 + 4)]:
        if env is not None:
            monkeypatch.setenv(CHUNK_ENV, env)
        store = open_store(server.address, "chunks.opt", **options)
        try:
            store.put(0, 0, 0, {0: {"t": t}})
            assert store.count_keys() == keys, (options, env)
            assert torch.equal(store.take(0, 0, 0, {0: ["t"]})[0]["t"], t)
        finally:
            store.close()
    for bad in ("12", "lots", "-1"):
        monkeypatch.setenv(CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=f"PIPEFB_STORE_CHUNK_BYTES {bad!r}"):
            open_store(server.address, "chunks.opt")
    monkeypatch.delenv(CHUNK_ENV)
    with pytest.raises(ValueError, match="chunk_bytes 100"):
        open_store(server.address, "chunks.opt", chunk_bytes=100)
    with pytest.raises(ValueError, match="chunk_connections 0 must be a positive int"):
        open_store(server.address, "chunks.opt", chunk_connections=0)


# --- a whole job --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chunking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """A 2-worker cluster without the node-local tier (every stash goes to Redis) whose
    stores chunk values over 4 KiB."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    env = {"PIPEFB_LOCAL_TIER_DIR": "", CHUNK_ENV: str(MIN_CHUNK_BYTES)}
    with LocalServices(2, tmp_path_factory.mktemp("chunks"), threads=WORKER_THREADS,
                       extra_env=env) as cluster, \
            CoordinatorClient(cluster.coordinator) as coordinator:
        coordinator.wait_for_workers(2)
        yield coordinator, cluster


def _getdels(cluster: Any) -> int:
    stats = store_client(cluster).info("commandstats")
    return int(stats.get("cmdstat_getdel", {}).get("calls", 0))


def trains_bit_for_bit(coordinator: Any, job: Any) -> tuple[str, list[Any]]:
    """Runs `job` on a cluster, checks that its losses and weights are `single`'s bit for
    bit, and returns its id and step reports."""
    job_id = coordinator.submit(job).job_id
    reports = list(coordinator.train(job_id))
    weights = coordinator.weights(job_id)
    want_losses, want_weights = reference(job)
    assert [r.loss for r in reports] == want_losses
    assert sorted(weights) == sorted(want_weights)
    for name, want in want_weights.items():
        assert torch.equal(weights[name], want), name
    return job_id, reports


def test_a_job_with_chunked_stashes_trains_as_one_process(chunking: tuple[Any, Any]) -> None:
    """PipeFB on 2 workers, every stash value of 16 samples of a 512-wide mlp (32 KiB) in
    chunks of 4 KiB through Redis: the losses and weights are `single`'s bit for bit, each
    chunk was taken with a GETDEL of its own, and the store keeps no key of the job."""
    coordinator, cluster = chunking
    assert cluster.tier_dir is None
    job = make_job("mlp", "pipefb", 2, "adamw", batch_size=64,
                   model_config={"hidden": 512, "depth": 3})
    before = _getdels(cluster)
    job_id, reports = trains_bit_for_bit(coordinator, job)
    stashed = sum(w.bytes_stashed for r in reports for w in r.workers)
    assert stashed > 3 * 4 * 32 * KiB  # steps x micro-batches x one 32 KiB value at least
    assert _getdels(cluster) - before >= stashed // MIN_CHUNK_BYTES
    assert list(store_client(cluster).scan_iter(match=job_pattern(job_id))) == []


# --- replies received into buffers (offload_store/receive.py) ------------------------------


def one_reply_peer(reply: bytes, close: bool) -> tuple[int, threading.Thread, list[bytes]]:
    """A TCP peer that reads one command, answers `reply`, then closes (`close`) or waits
    for the client to close; what it read (the command, then b"" on the client's close)
    lands in the returned list."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            seen.append(conn.recv(65536))
            conn.sendall(reply)
            if not close:
                conn.settimeout(10)
                seen.append(conn.recv(65536))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread, seen


@pytest.mark.parametrize(("reply", "close", "error", "match"), [
    (b"$100\r\n" + b"x" * 10, True, redis.ConnectionError, "closed the connection"),
    (b"+OK\r\n", False, redis.InvalidResponse, "unexpected reply to GETDEL: b'\\+OK'"),
    (b"$5\r\nabcdeXY", False, redis.InvalidResponse, "followed by b'XY', not CRLF"),
])
def test_a_bad_or_cut_reply_raises_and_the_connection_is_closed(
        reply: bytes, close: bool, error: type[Exception], match: str) -> None:
    port, thread, seen = one_reply_peer(reply, close)
    pool = ConnectionPool(host="127.0.0.1", port=port, protocol=2, socket_timeout=10,
                          driver_info=None)  # no HELLO, no CLIENT SETINFO: just the GETDEL
    view = memoryview(bytearray(100 if close else 5))
    with pytest.raises(error, match=match):
        getdel_into(pool, [("pipefb:k", view)])
    thread.join(10)
    assert seen[0] == b"*2\r\n$6\r\nGETDEL\r\n$8\r\npipefb:k\r\n"  # sent once
    assert close or seen[1] == b""  # the client hung up: no half-read reply is reused


def test_a_push_before_the_reply_is_dropped() -> None:
    """A RESP3 push (a server's notice, here an invalidation with a nested array and a
    map) before the GETDEL's reply is read past; the value still lands in its view."""
    push = (b">4\r\n$10\r\ninvalidate\r\n*1\r\n$3\r\nkey\r\n:7\r\n"
            b"%1\r\n+a\r\n$-1\r\n")
    port, thread, seen = one_reply_peer(push + b"$3\r\nabc\r\n", close=True)
    pool = ConnectionPool(host="127.0.0.1", port=port, protocol=2, socket_timeout=10,
                          driver_info=None)
    view = memoryview(bytearray(3))
    assert getdel_into(pool, [("pipefb:k", view)]) == [3]
    pool.disconnect()
    thread.join(10)
    assert bytes(view) == b"abc" and seen == [b"*2\r\n$6\r\nGETDEL\r\n$8\r\npipefb:k\r\n"]
