"""Tests of the store interface (offload_store.api, .backends, .admin) on a real
redis-server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload_store import (
    OffloadStore,
    RedisServer,
    StoreStats,
    StoreUnavailable,
    open_admin,
    open_store,
)
from offload_store.backends import Backend, register, resolve, schemes


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="64mb") as srv:
        yield srv


def _stash() -> dict[int, dict[str, torch.Tensor]]:
    return {0: {"x": torch.arange(6.0).reshape(2, 3)}, 2: {"w": torch.ones(4, dtype=torch.int64)}}


NAMES = {0: ["x"], 2: ["w"]}


def test_open_store_round_trips_through_the_interface(server: RedisServer) -> None:
    store = open_store(server.address, "api.rt", 1)
    try:
        assert isinstance(store, OffloadStore)
        assert store.put(3, 1, 7, _stash()) > 0
        store.prefetch(3, 1, 7, NAMES)  # a hint only: the stash stays where it is
        out = store.take(3, 1, 7, NAMES)
        torch.testing.assert_close(out[0]["x"], _stash()[0]["x"])
        torch.testing.assert_close(out[2]["w"], _stash()[2]["w"])
        assert store.stats.live_keys == 0 and store.stats.keys_taken == 2
        assert store.release(3, 1, 7, NAMES) == 0  # the take consumed both
    finally:
        store.close()


def test_release_drops_a_stash_that_was_not_taken(server: RedisServer) -> None:
    store = open_store(f"redis://{server.address}", "api.release")
    admin = open_admin(server.address)
    try:
        store.put(0, 0, 0, _stash())
        assert admin.count_keys("api.release") == 2
        assert store.release(0, 0, 0, NAMES) == 2
        assert admin.count_keys("api.release") == 0
        assert store.stats == StoreStats(bytes_put=store.stats.bytes_put, keys_put=2)
    finally:
        store.close()
        admin.close()


def test_open_store_passes_store_options_to_the_backend(server: RedisServer) -> None:
    store = open_store(server.address, "api.options", ttl_seconds=90, max_wait_seconds=0.5)
    try:
        assert isinstance(store, OffloadStore)
        assert (store.ttl_seconds, store.max_wait_seconds) == (90, 0.5)
    finally:
        store.close()


def test_admin_reports_memory_identity_and_clears_one_job(server: RedisServer) -> None:
    mine, other = open_store(server.address, "api.mine"), open_store(server.address, "api.o")
    admin = open_admin(server.address, timeout_seconds=2.0, retries=0)
    try:
        mine.put(0, 0, 0, _stash())
        other.put(0, 0, 0, _stash())
        admin.ping()
        assert admin.instance() == admin.instance() != ""
        assert admin.used_memory() > 0
        assert admin.clear_job("api.mine") == 2
        assert (admin.count_keys("api.mine"), admin.count_keys("api.o")) == (0, 2)
        with pytest.raises(ValueError, match="job"):
            admin.count_keys("a:b")
    finally:
        other.clear_job()
        for handle in (mine, other, admin):
            handle.close()


def test_admin_of_a_stopped_store_raises_store_unavailable() -> None:
    with RedisServer(maxmemory="8mb") as srv:
        address = srv.address
    admin = open_admin(address, timeout_seconds=1.0, connect_timeout_seconds=1.0, retries=0)
    try:
        for call in (admin.ping, admin.instance, admin.used_memory,
                     lambda: admin.clear_job("gone")):
            with pytest.raises(StoreUnavailable, match=f"offload store at {address} does "
                               "not answer") as info:
                call()
            assert info.value.address == address and info.value.reason
            assert isinstance(info.value, ConnectionError)
    finally:
        admin.close()


def test_an_unknown_scheme_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no backend for scheme 'nope' \(known: redis\)"):
        open_store("nope://somewhere", "job")
    with pytest.raises(ValueError, match="not host:port"):
        open_admin("redis://no-port")


def test_resolve_strips_the_scheme_and_defaults_to_redis() -> None:
    assert resolve("127.0.0.1:6379")[1] == "127.0.0.1:6379"
    assert resolve("redis://127.0.0.1:6379")[1] == "127.0.0.1:6379"
    assert resolve("127.0.0.1:6379")[0] is resolve("redis://h:1")[0]
    assert schemes() == ["redis"]


def test_register_refuses_a_taken_or_malformed_scheme() -> None:
    backend, _ = resolve("h:1")
    with pytest.raises(ValueError, match="registered already"):
        register("redis", backend)
    with pytest.raises(ValueError, match="lower-case"):
        register("Mem", Backend(backend.open_store, backend.open_admin))
