"""Tests of offload_store against real redis-server processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from redis._parsers.hiredis import _HiredisParser
from redis.backoff import NoBackoff
from redis.retry import Retry

from offload_store import (
    OffloadStore,
    RedisServer,
    StoreStats,
    acl,
    connect,
    find_redis_server,
    job_pattern,
    parse_address,
    stash_key,
)
from offload_store.acl import SERVICE_USER, USER_ENV
from offload_store.frames import Frame
from offload_store.keys import PREFIX
from offload_store.store import PASSWORD_ENV
from pipefb.codec import pack
from pipefb.errors import CodecError, StoreFullError

MB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="256mb") as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="8mb") as srv:
        yield srv


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    conn = connect(server.address)
    yield conn
    conn.close()


@pytest.fixture
def small_client(small_server: RedisServer) -> Iterator[redis.Redis]:
    conn = connect(small_server.address)
    yield conn
    conn.flushall()
    conn.close()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert _bits(a) == _bits(b)


def _sample() -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    x[0, 0] = float("nan")
    return {
        0: {
            "x": x,
            "xt": x.t(),  # non-contiguous
            "h": torch.randn(2, 3, 5, generator=g).to(torch.float16),
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
        },
        3: {
            "d": torch.randn(3, generator=g, dtype=torch.float64),
            "i8": torch.randint(-128, 127, (5, 2), generator=g, dtype=torch.int8),
            "i64": torch.tensor(-(2**62)),  # rank 0
            "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
            "mask": torch.rand(2, 2, generator=g) > 0.5,
            "empty": torch.empty(0, 4),
        },
    }


def _names(tensors: dict[int, dict[str, torch.Tensor]]) -> dict[int, list[str]]:
    return {layer: list(named) for layer, named in tensors.items()}


def _blob(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 255, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


# --- keys ---------------------------------------------------------------------------------


def test_stash_key_literal() -> None:
    assert stash_key("j1", 0, 3, 1, 7, 2, "s0") == "pipefb:j1:0:3:1:7:2:s0"
    assert job_pattern("j1") == "pipefb:j1:*"


@pytest.mark.parametrize("job", ["", "a:b", "a*", "a?", "a[b]", "a b", "é", "a\\b", None])
def test_bad_job_ids_rejected(job: object) -> None:
    with pytest.raises(ValueError, match="job"):
        stash_key(job, 0, 0, 0, 0, 0, "s")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job"):
        job_pattern(job)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "x:y", "x*", "s/0"])
def test_bad_names_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=repr(name).replace("*", r"\*")):
        stash_key("j", 0, 0, 0, 0, 0, name)


@pytest.mark.parametrize("index", [-1, True, 1.0, "1"])
def test_bad_indices_rejected(index: object) -> None:
    with pytest.raises(ValueError, match="step"):
        stash_key("j", 0, index, 0, 0, 0, "s")  # type: ignore[arg-type]


# --- connect ------------------------------------------------------------------------------


def test_connect_uses_hiredis(client: redis.Redis) -> None:
    assert client.ping()
    conn = client.connection_pool.get_connection()
    try:
        assert isinstance(conn._parser, _HiredisParser)
    finally:
        client.connection_pool.release(conn)


@pytest.mark.parametrize("address", ["", "localhost", ":6379", "host:", "host:0", "h:99999", "h:x"])
def test_bad_address_rejected(address: str) -> None:
    with pytest.raises(ValueError, match="address"):
        parse_address(address)


def test_parse_address() -> None:
    assert parse_address("redis.default.svc:6379") == ("redis.default.svc", 6379)
    assert parse_address("[::1]:7000") == ("::1", 7000)


def test_decoding_client_refused(server: RedisServer) -> None:
    with pytest.raises(ValueError, match="decode"):
        connect(server.address, decode_responses=True)


def test_connect_authenticates_with_the_env_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """$PIPEFB_STORE_PASSWORD is the AUTH password (Kubernetes passes the Redis Secret so).

    (No retries: redis-py would retry a refused AUTH with backoff, and the test would wait.)
    """
    once = Retry(NoBackoff(), 0)
    with RedisServer(maxmemory="8mb") as srv:
        admin = connect(srv.address)
        admin.config_set("requirepass", "s3cret-pw")
        admin.close()
        for value in (None, ""):  # unset and empty both mean: no AUTH
            if value is None:
                monkeypatch.delenv(PASSWORD_ENV, raising=False)
            else:
                monkeypatch.setenv(PASSWORD_ENV, value)
            with pytest.raises(redis.AuthenticationError):
                connect(srv.address, retry=once).ping()
        monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
        assert connect(srv.address).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(srv.address, password="wrong", retry=once).ping()


def test_the_service_user_may_only_stash_under_its_prefix(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """[Note: store ACL]: the store works as the service user (found through
    $PIPEFB_STORE_USER and _PASSWORD), which gets NOPERM on FLUSHALL, CONFIG, EVAL, other
    commands and keys outside the prefix; the default user cannot even PING."""
    once = Retry(NoBackoff(), 0)
    with RedisServer(maxmemory="8mb", password="acl-pw-1") as srv:
        monkeypatch.setenv(USER_ENV, SERVICE_USER)
        monkeypatch.setenv(PASSWORD_ENV, "acl-pw-1")
        client = connect(srv.address, retry=once)
        store = OffloadStore(client, "acl", attempt=1)
        store.put(0, 0, 0, {3: {"x": torch.arange(4.0)}})
        assert torch.equal(store.take(0, 0, 0, {3: ["x"]})[3]["x"], torch.arange(4.0))
        store.put(1, 0, 0, {3: {"x": torch.ones(2)}})
        assert store.clear_job() == 1 and client.info("memory")["used_memory"] > 0
        refused = [client.flushall, lambda: client.config_get("*"),
                   lambda: client.eval("return 1", 0),
                   lambda: client.set("other:key", b"1"),  # outside the prefix
                   lambda: client.get(f"{PREFIX}:acl:x"), lambda: client.keys("*"),
                   lambda: client.publish("channel", 1)]
        for call in refused:
            with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"):
                call()
        for user, password in ((None, None), (SERVICE_USER, "wrong")):
            with pytest.raises(redis.AuthenticationError):
                connect(srv.address, username=user, password=password, retry=once).ping()
    with pytest.raises(ValueError, match="without whitespace"):
        acl.service_rule("two words")


# --- put / take ---------------------------------------------------------------------------


def test_round_trip_is_bitwise_and_deletes(client: redis.Redis) -> None:
    store = OffloadStore(client, "rt", attempt=1)
    tensors = _sample()
    written = store.put(5, 2, 9, tensors)
    nbytes = sum(len(pack(t)) for named in tensors.values() for t in named.values())
    assert written == nbytes
    assert store.count_keys() == 10
    got = store.take(5, 2, 9, _names(tensors))
    assert got.keys() == tensors.keys()
    for layer, named in tensors.items():
        assert got[layer].keys() == named.keys()
        for name, t in named.items():
            _assert_same(got[layer][name], t)
    assert store.count_keys() == 0
    assert store.stats == StoreStats(nbytes, nbytes, 10, 10, 0)
    assert (store.stats.live_bytes, store.stats.live_keys) == (0, 0)


def test_taken_tensors_are_writable(client: redis.Redis) -> None:
    store = OffloadStore(client, "writable")
    store.put(0, 0, 0, {0: {"x": torch.zeros(3)}})
    got = store.take(0, 0, 0, {0: ["x"]})[0]["x"]
    got += 1
    assert got.tolist() == [1.0, 1.0, 1.0]


def test_ttl_set_on_every_key(client: redis.Redis) -> None:
    store = OffloadStore(client, "ttl", ttl_seconds=120)
    store.put(1, 0, 0, _sample())
    keys = list(client.scan_iter(match=job_pattern("ttl")))
    assert len(keys) == 10
    assert all(0 < client.ttl(key) <= 120 for key in keys)
    store.clear_job()


def test_missing_key_names_the_key(client: redis.Redis) -> None:
    store = OffloadStore(client, "missing", attempt=2)
    store.put(4, 1, 3, {7: {"a": torch.ones(2)}})
    with pytest.raises(KeyError) as info:
        store.take(4, 1, 3, {7: ["a", "nope"]})
    assert info.value.args[0] == "pipefb:missing:2:4:1:7:3:nope"
    assert store.count_keys() == 0  # the present key was consumed anyway
    assert store.stats.keys_taken == 1


def test_version_is_part_of_the_key(client: redis.Redis) -> None:
    store = OffloadStore(client, "version")
    store.put(0, 0, 1, {0: {"a": torch.ones(2)}})
    with pytest.raises(KeyError, match="pipefb:version:0:0:0:0:2:a"):
        store.take(0, 0, 2, {0: ["a"]})
    store.clear_job()


def test_corrupt_value_raises_codec_error_and_deletes_the_rest(client: redis.Redis) -> None:
    store = OffloadStore(client, "corrupt")
    store.put(0, 0, 0, {0: {"good": torch.arange(4)}})
    bad = store.key(0, 0, 0, 0, "bad")
    client.set(bad, b"PFT1\x03\x01" + b"\xff" * 8)  # float32 of 2**64-1 elements
    with pytest.raises(CodecError):
        store.take(0, 0, 0, {0: ["bad", "good"]})
    assert store.count_keys() == 0


def test_clear_job_removes_only_that_job(client: redis.Redis) -> None:
    mine0, mine1 = OffloadStore(client, "job.a", 0), OffloadStore(client, "job.a", 1)
    other, prefix = OffloadStore(client, "job.ab"), OffloadStore(client, "job")
    for store in (mine0, mine1, other, prefix):
        store.put(0, 0, 0, {0: {"x": torch.ones(1)}, 1: {"y": torch.ones(1)}})
    assert mine0.clear_job() == 4
    assert mine0.count_keys() == mine1.count_keys() == 0
    assert other.count_keys() == prefix.count_keys() == 2
    assert other.clear_job() == prefix.clear_job() == 2


def test_two_threads_share_one_store(client: redis.Redis) -> None:
    store = OffloadStore(client, "threads")
    done = threading.Event()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for mb in range(20):
                while not client.exists(store.key(0, mb, 0, 0, "x")):
                    time.sleep(0.001)
                assert store.take(0, mb, 0, {0: ["x"]})[0]["x"].item() == mb
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    for mb in range(20):
        store.put(0, mb, 0, {0: {"x": torch.tensor(mb)}})
    thread.join(10)
    assert done.is_set() and not errors
    assert store.stats.live_keys == 0 and store.count_keys() == 0


# --- backpressure -------------------------------------------------------------------------


def test_put_that_never_fits_raises_store_full(small_client: redis.Redis) -> None:
    store = OffloadStore(small_client, "full", max_wait_seconds=0.5)
    start = time.monotonic()
    with pytest.raises(StoreFullError) as info:
        store.put(3, 1, 0, {0: {f"t{i}": _blob(2 * MB, i) for i in range(8)}})
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert "'full'" in message and "step 3" in message and "microbatch 1" in message
    assert info.value.maxmemory == 8 * MB and info.value.used_memory > 0
    assert info.value.nbytes == sum(len(pack(_blob(2 * MB, i))) for i in range(8))
    assert store.stats.retries > 0
    assert store.stats.keys_put == 0
    assert store.count_keys() == 0  # all or nothing
    assert small_client.info("stats")["evicted_keys"] == 0  # noeviction: nothing was lost


def test_blocked_put_resumes_after_concurrent_take(small_client: redis.Redis) -> None:
    store = OffloadStore(small_client, "backpressure", max_wait_seconds=10.0)
    old = {0: {f"a{i}": _blob(MB, i) for i in range(4)}}
    new = {1: {f"b{i}": _blob(MB, 10 + i) for i in range(4)}}
    store.put(0, 0, 0, old)
    taken: dict[int, dict[str, torch.Tensor]] = {}

    def take_old() -> None:
        time.sleep(0.3)
        taken.update(store.take(0, 0, 0, _names(old)))

    thread = threading.Thread(target=take_old)
    thread.start()
    store.put(0, 1, 0, new)  # blocks until take_old frees memory
    thread.join(10)
    assert store.stats.retries > 0
    for layer, named in old.items():
        for name, t in named.items():
            _assert_same(taken[layer][name], t)
    got = store.take(0, 1, 0, _names(new))
    for layer, named in new.items():
        for name, t in named.items():
            _assert_same(got[layer][name], t)
    assert store.count_keys() == 0 and store.stats.live_bytes == 0
    assert small_client.info("stats")["evicted_keys"] == 0


# --- server -------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_find_redis_server_is_executable() -> None:
    path = find_redis_server()
    assert os.access(path, os.X_OK)


def test_server_config_and_stop_leaves_no_process() -> None:
    with RedisServer(maxmemory=4 * MB) as srv:
        pid, address = srv.pid, srv.address
        conn = connect(address)
        assert conn.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert conn.config_get("maxmemory") == {"maxmemory": str(4 * MB)}
        assert conn.config_get("bind") == {"bind": "127.0.0.1"}
        assert conn.config_get("save") == {"save": ""}
        conn.close()
    assert _gone(pid)
    with pytest.raises(RuntimeError, match="not running"):
        srv.address  # noqa: B018


def _redis_children() -> set[int]:
    """Pids of live redis-server processes whose parent is this test process (Linux /proc)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"redis-server" in cmdline and " Z " not in stat:
            pids.add(int(entry))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_start_failure_leaves_no_process(server: RedisServer) -> None:
    before = _redis_children()
    assert server.pid in before
    taken_port = int(server.address.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match="already in use"), RedisServer(port=taken_port):
        pass
    assert _redis_children() == before


@pytest.mark.parametrize("maxmemory", ["", "0", "1tb", "lots", -1, 0])
def test_bad_maxmemory_rejected(maxmemory: str | int) -> None:
    with pytest.raises(ValueError, match="maxmemory"):
        RedisServer(maxmemory=maxmemory)


def test_main_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload_store", "--port", "0", "--maxmemory", "8mb"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, address = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert ready == "ready"
        conn = connect(address)
        redis_pid = int(conn.info("server")["process_id"])
        assert conn.config_get("maxmemory") == {"maxmemory": str(8 * MB)}
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert _gone(redis_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_take_restores_the_connection_retry_policy(client: redis.Redis) -> None:
    store = OffloadStore(client, "retry")
    store.put(0, 0, 0, {0: {"x": torch.ones(1)}})
    store.take(0, 0, 0, {0: ["x"]})
    conn = client.connection_pool.get_connection()
    try:
        assert conn.retry.get_retries() == client.get_retry().get_retries() > 0
    finally:
        client.connection_pool.release(conn)


@pytest.mark.parametrize("tensor", [
    torch.arange(3 * 1000, dtype=torch.float32).reshape(3, 1000),  # dense: data not copied
    torch.arange(24, dtype=torch.int64).reshape(4, 6).t(),  # strided: copied once
    torch.zeros(0, 5, dtype=torch.bfloat16),  # empty
    torch.tensor(True),  # 0-d bool
])
def test_frames_reach_redis_byte_for_byte_as_pack_writes_them(client: redis.Redis,
                                                              tensor: torch.Tensor) -> None:
    """[Note: zero-copy put]: the parts written one after the other are exactly `pack`."""
    store = OffloadStore(client, "frames")
    store.put(1, 0, 2, {0: {"x": tensor}})
    raw = client.get(store.key(1, 0, 0, 2, "x"))
    assert raw == pack(tensor)
    assert len(Frame.of(tensor)) == len(raw)
    got = store.take(1, 0, 2, {0: ["x"]})[0]["x"]
    assert torch.equal(got, tensor) and got.dtype == tensor.dtype
    client.set("plain", b"value")  # other commands still go through redis-py's own packing
    assert client.getdel("plain") == b"value"


def test_a_server_that_dies_of_a_signal_while_starting_is_retried_and_quoted(
        tmp_path: Path) -> None:
    """A redis-server that dies of a signal (SIGABRT) before opening its log is told apart
    from a bad configuration, so `start` tries another port, and the error quotes what it
    wrote to stderr."""
    from offload_store import server

    log = tmp_path / "redis.log"
    with (tmp_path / server.STDERR_FILE).open("wb") as stderr:
        proc = subprocess.Popen(["sh", "-c", "echo 'assertion failed' >&2; kill -ABRT $$"],
                                stderr=stderr)
    proc.wait()
    with pytest.raises(server._Crashed) as crashed:
        server._wait_ready(proc, 1, log)
    assert isinstance(crashed.value, server._Retryable)
    assert f"exited with {-signal.SIGABRT}" in str(crashed.value)
    assert "stderr: assertion failed" in str(crashed.value)
