"""The background stash writer ([Note: background stash] in offload_store/writer.py) against a
real redis-server on 127.0.0.1: writes leave the caller, the bytes in flight stay under the
cap, a stash still handed over comes back without a take, tickets order the writes, and a
failed write is raised on the caller's thread; on the session's cluster, a PipeFB forward
rank reports its stash in flight and the job trains as one process."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from dataplane.inbox import Inbox
from offload_store import OffloadStore, RedisServer, connect, job_pattern
from offload_store.api import StashFullError
from offload_store.writer import STASH_IN_FLIGHT_BYTES, StashWriter, stash_nbytes
from tests.conftest import store_client
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

MiB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="64mb") as srv:
        yield srv


@pytest.fixture
def store(server: RedisServer, request: pytest.FixtureRequest) -> Iterator[OffloadStore]:
    s = OffloadStore(connect(server.address), f"writer.{request.node.name[:40]}",
                     max_wait_seconds=0.2)
    yield s
    s.clear_job()
    s.close()


def stash(seed: int, n: int = MiB // 4) -> dict[int, dict[str, torch.Tensor]]:
    """One micro-batch's stash: 1 MiB of float32 in two layers."""
    g = torch.Generator().manual_seed(seed)
    return {0: {"x": torch.randn(n, generator=g)}, 3: {"w": torch.randn(n // 2, generator=g),
                                                      "i": torch.arange(n // 2)}}


NAMES = {0: ["x"], 3: ["w", "i"]}


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """Stops the redis-server process until the block ends: a write under way stalls."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def test_a_handed_over_stash_is_in_the_store_after_drain(store: OffloadStore) -> None:
    writer = StashWriter(store, 64 * MiB)
    sent = {m: stash(m) for m in range(3)}
    for m, tensors in sent.items():
        writer.put(5, m, 2, tensors)
    writer.drain()
    assert writer.in_flight_bytes == 0 and writer.ticket == 3
    assert store.stats.keys_put == 9
    for m, tensors in sent.items():
        got = store.take(5, m, 2, NAMES)
        for layer, named in tensors.items():
            for name, t in named.items():
                assert torch.equal(got[layer][name], t)
    writer.close()


def test_the_caller_waits_past_the_cap_and_the_bytes_in_flight_stay_under_it(
        server: RedisServer, store: OffloadStore) -> None:
    one = stash_nbytes(stash(0))  # 2 MiB: 1 + 0.5 float32 + 0.5 int64
    writer = StashWriter(store, 2 * one)
    store.put(0, 99, 0, stash(99))  # the connection is open before the store stops
    with paused(server):
        blocked = [writer.put(1, m, 0, stash(m)) for m in range(2)]  # fills the cap
        assert writer.in_flight_bytes == 2 * one and blocked == [pytest.approx(0, abs=0.05)] * 2
        third: list[float] = []
        caller = threading.Thread(target=lambda: third.append(writer.put(1, 2, 0, stash(2))))
        caller.start()
        time.sleep(0.5)
        assert caller.is_alive() and writer.in_flight_bytes == 2 * one  # it waits for room
    caller.join(10)
    assert third and third[0] >= 0.4  # how long it waited: what STASH reports
    writer.drain()
    assert writer.in_flight_bytes == 0 and store.stats.keys_put == 4 * 3
    writer.close()


def test_under_a_memory_cap_the_caller_waits_while_in_flight_plus_held_would_pass_it(
        server: RedisServer, store: OffloadStore) -> None:
    """The in-flight cap leaves room (64 MiB); the rank's memory limit does not: the rank
    holds 5 MiB besides its bytes in flight (the stash handed over among them) under a
    limit of 6 MiB, so a second 2 MiB stash waits until the first is written (5 MiB, 2 in
    flight, 2 handed over), and a first one never waits (nothing in flight: it cannot
    wait for room)."""
    one = stash_nbytes(stash(0))  # 2 MiB
    asked: list[int] = []

    def memory() -> tuple[int, int]:
        asked.append(1)
        return 5 * MiB, 6 * MiB

    writer = StashWriter(store, 64 * MiB, memory=memory)
    store.put(0, 99, 0, stash(99))  # the connection is open before the store stops
    with paused(server):
        assert writer.put(1, 0, 0, stash(0)) == pytest.approx(0, abs=0.05)
        second: list[float] = []
        caller = threading.Thread(target=lambda: second.append(writer.put(1, 1, 0, stash(1))))
        caller.start()
        time.sleep(0.5)
        assert caller.is_alive() and writer.in_flight_bytes == one  # 5 + 2 MiB > 6 MiB
    caller.join(10)
    assert second and second[0] >= 0.4  # how long it waited: what STASH reports
    writer.drain()
    assert writer.in_flight_bytes == 0 and writer.ticket == 2 and len(asked) == 2
    assert store.stats.keys_put == 3 * 3
    writer.close()


def test_under_a_memory_cap_with_room_the_stash_is_still_written_in_the_background(
        server: RedisServer, store: OffloadStore) -> None:
    writer = StashWriter(store, 64 * MiB, memory=lambda: (MiB, 64 * MiB))
    store.put(0, 99, 0, stash(99))
    with paused(server):  # the writes stall; the puts return at once all the same
        blocked = [writer.put(2, m, 0, stash(m)) for m in range(3)]
        assert blocked == [pytest.approx(0, abs=0.05)] * 3
        assert writer.in_flight_bytes == 3 * stash_nbytes(stash(0))
    writer.drain()
    assert writer.in_flight_bytes == 0 and store.stats.keys_put == 4 * 3
    writer.close()


def test_bytes_in_flight_count_a_shared_storage_once(server: RedisServer,
                                                    store: OffloadStore) -> None:
    """As the runtime's account counts `stashed`: the memory held, not the bytes written."""
    base = torch.randn(MiB // 4)  # 1 MiB
    shared = {0: {"x": base, "half": base[: MiB // 8]}, 1: {"y": base.view(64, -1)}}
    writer = StashWriter(store, 64 * MiB)
    store.put(0, 99, 0, stash(99))
    with paused(server):
        writer.put(6, 0, 0, shared)
        assert writer.in_flight_bytes == MiB < stash_nbytes(shared) == 2 * MiB + MiB // 2
    writer.drain()
    assert writer.in_flight_bytes == 0
    assert torch.equal(store.take(6, 0, 0, {0: ["half"]})[0]["half"], base[: MiB // 8])
    writer.close()


def test_a_stash_still_handed_over_comes_back_without_a_take(server: RedisServer,
                                                             store: OffloadStore) -> None:
    writer = StashWriter(store, 64 * MiB)
    store.put(0, 99, 0, stash(99))
    first, second, third = stash(1), stash(2), stash(3)
    with paused(server):
        writer.put(2, 0, 0, first)  # the I/O thread takes it and stalls on the store
        time.sleep(0.2)
        writer.put(2, 1, 0, second)  # still queued
        back = writer.take_pending(2, 1)  # leaves the queue: never written
        assert back is not None and back[0]["x"] is second[0]["x"]
        assert writer.in_flight_bytes == stash_nbytes(first)
        under_way = writer.take_pending(2, 0)  # being written: handed back all the same
        assert under_way is not None and under_way[3]["w"] is first[3]["w"]
        assert writer.take_pending(2, 0) is None  # taken once
    writer.put(2, 2, 0, third)
    writer.drain()
    assert writer.take_pending(2, 2) is None  # written: the store has it
    assert store.stats.keys_put == 3 * 3 and writer.in_flight_bytes == 0
    assert store.count_keys() == 2 * 3  # the one taken while written was deleted after it
    assert torch.equal(store.take(2, 2, 0, NAMES)[0]["x"], third[0]["x"])
    writer.close()


def test_a_ticket_waits_for_the_writes_before_it(server: RedisServer,
                                                 store: OffloadStore) -> None:
    writer = StashWriter(store, 64 * MiB)
    store.put(0, 99, 0, stash(99))
    with paused(server):
        writer.put(3, 0, 0, stash(0))
        ticket = writer.ticket
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (writer.wait_written(ticket), done.set()))
        waiter.start()
        assert not done.wait(0.3)  # the store is stopped: the write cannot end
    assert done.wait(10)
    assert store.take(3, 0, 0, NAMES)[3]["i"].equal(torch.arange(MiB // 8))
    writer.close()


def test_a_failed_write_is_raised_to_the_caller() -> None:
    with RedisServer(maxmemory="4mb") as small:
        store = OffloadStore(connect(small.address), "writer.full", max_wait_seconds=0.1)
        writer = StashWriter(store, 64 * MiB)
        writer.put(0, 0, 0, stash(0, n=2 * MiB))  # 16 MiB: the store refuses it
        with pytest.raises(StashFullError, match="microbatch 0"):
            writer.drain()
        with pytest.raises(StashFullError):
            writer.put(0, 1, 0, stash(1))
        assert store.count_keys() == 0  # all or nothing, as a put on the caller's thread
        writer.close()
        store.close()


def test_cap_zero_writes_on_the_callers_thread(store: OffloadStore) -> None:
    writer = StashWriter(store, 0)
    writer.put(4, 0, 1, stash(4))
    assert writer.ticket == 0 and store.stats.keys_put == 3  # written before put returned
    with pytest.raises(ValueError, match="-1"):
        StashWriter(store, -1)


def test_the_inbox_says_a_transfer_arrived_taken_or_not() -> None:
    inbox = Inbox()
    assert not inbox.arrived(("RECV_L", 0, 1, 0), 0.05)
    inbox.put(("RECV_L", 0, 1, 0), {"loss": torch.ones(())})
    assert inbox.arrived(("RECV_L", 0, 1, 0), 0.0)
    inbox.take(("RECV_L", 0, 1, 0))
    assert inbox.arrived(("RECV_L", 0, 1, 0), 0.0)  # a prefetch that looked late still goes


def test_a_pipefb_forward_rank_reports_its_stash_in_flight_and_trains_as_one_process(
        client: Any, cluster: Any) -> None:
    """The forward rank's STASH hands the stash over: right after it, the stash is in
    flight (the memory kind `stash_in_flight`, under the worker's default cap); the
    backward rank still finds every stash, and training equals one process."""
    job = make_job("gpt", "pipefb", 2, "adamw")
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    forward = [w for r in reports for w in r.workers if w.role == "forward"]
    in_flight = max(w.kind_peak_bytes["stash_in_flight"] for w in forward)
    assert 0 < in_flight <= STASH_IN_FLIGHT_BYTES
    assert all(w.memory_bytes["stash_in_flight"] <= w.peak_memory_bytes for w in forward)
    backward = [w for r in reports for w in r.workers if w.role == "backward"]
    assert max(w.kind_peak_bytes["stash_in_flight"] for w in backward) == 0  # it stashes nothing
    assert list(store_client(cluster).scan_iter(match=job_pattern(reports[0].job_id))) == []
