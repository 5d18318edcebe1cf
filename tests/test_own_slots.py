"""A private store's own slots ([Note: own slots] in offload_store/ownslots.py), against a
real redis-server and a real tier directory: stashes copied into reused, mapped files,
taken as views, freed when the views go; the cap, the leases and the store's memory."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offload_store import RedisServer, connect, open_store, segments
from offload_store.mapped import PURGE_EVERY, SegmentMaps
from offload_store.segments import OWN_PREFIX, SUFFIX, SegmentError
from offload_store.shm import SharedTierStore

Stash = dict[int, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="64mb") as srv:
        yield srv


def private(server: RedisServer, base: Path, job: str, attempt: int = 0, cap: int = -1
            ) -> SharedTierStore:
    store = open_store(server.address, job, attempt, local_tier_dir=str(base),
                       local_tier_bytes=cap, local_tier_private=True)
    assert isinstance(store, SharedTierStore)
    return store


def slots(base: Path) -> list[Path]:
    return sorted(base.glob(f"*/{OWN_PREFIX}*{SUFFIX}"))


def stash(seed: int) -> Stash:
    """What users' layers save: float, half, bf16, bool and int tensors, a transposed
    (non-contiguous) one, an empty one, and one that requires grad."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 4, generator=g, requires_grad=True)
    return {0: {"x": torch.randn(5, 7, generator=g), "t": torch.randn(4, 6, generator=g).t(),
                "w": weight * 2},
            3: {"h": torch.randn(3, generator=g).half(),
                "b": torch.randn(9, generator=g).bfloat16(),
                "m": torch.rand(11, generator=g) > 0.5, "i": torch.arange(5),
                "e": torch.empty(0, 3)}}


def names(tensors: Stash) -> dict[int, list[str]]:
    return {layer: list(named) for layer, named in tensors.items()}


def assert_same(got: Stash, want: Stash) -> None:
    assert names(got) == names(want)
    for layer, named in want.items():
        for name, tensor in named.items():
            out = got[layer][name]
            assert out.dtype == tensor.dtype and out.shape == tensor.shape
            assert torch.equal(out, tensor.detach()) and not out.requires_grad


def test_stashes_are_copied_into_one_reused_slot_and_taken_as_its_views(
        server: RedisServer, tmp_path: Path) -> None:
    store = private(server, tmp_path / "tier", "slots")
    client = connect(server.address)
    want = stash(0)
    size = store.put(0, 0, 0, want)
    (slot,) = slots(tmp_path / "tier")
    assert slot.stat().st_size == size and store.node_bytes() == size
    got = store.take(0, 0, 0, names(want))
    assert_same(got, want)
    assert store.node_bytes() == 0  # the taker's tensors hold it now
    bases = {t.untyped_storage().data_ptr() for named in got.values() for t in named.values()
             if t.numel()}
    assert len(bases) == 1  # every tensor views the one mapping
    got[0]["x"].add_(1)  # writable
    with pytest.raises(KeyError):
        store.take(0, 0, 0, names(want))  # not here: asks Redis
    calls = client.info("commandstats")
    for step in range(1, 4):  # the slot is free again once the views are gone
        del got
        gc.collect()
        assert store.node_bytes() == size
        want = stash(step)
        store.put(step, 1, 0, want)
        got = store.take(step, 1, 0, names(want))
        assert_same(got, want)
        assert slots(tmp_path / "tier") == [slot]
    store.put(9, 0, 0, want)  # a second stash while the first's views live: a second slot
    assert len(slots(tmp_path / "tier")) == 2 and store.node_bytes() == size
    assert store.release(9, 0, 0, {0: [], 3: []}) == 8  # the tensors its slot held
    assert store.node_bytes() == size  # released untaken: free at once
    after = client.info("commandstats")
    for command in ("cmdstat_set", "cmdstat_getdel", "cmdstat_del"):  # no round trip
        assert after.get(command, {}).get("calls", 0) == calls.get(command, {}).get("calls", 0)
    assert store.stats.bytes_put == store.stats.bytes_taken == 5 * size  # 4 taken, 1 released
    store.close()
    assert slots(tmp_path / "tier") == []
    assert_same({3: {"m": got[3]["m"]}}, {3: {"m": want[3]["m"]}})  # views outlive the close


def test_a_stash_put_again_replaces_the_first_and_frees_its_slot(
        server: RedisServer, tmp_path: Path) -> None:
    store = private(server, tmp_path / "tier", "again")
    first, second = stash(3), stash(4)
    size = store.put(0, 0, 0, first)
    store.put(0, 0, 0, second)  # into the first's slot, freed for it
    assert len(slots(tmp_path / "tier")) == 1 and store.node_bytes() == size
    assert_same(store.take(0, 0, 0, names(second)), second)
    with pytest.raises(KeyError):
        store.take(0, 0, 0, names(second))
    store.close()


def test_a_take_must_name_exactly_the_tensors_the_stash_holds(
        server: RedisServer, tmp_path: Path) -> None:
    store = private(server, tmp_path / "tier", "names")
    want = stash(1)
    store.put(0, 0, 0, want)
    with pytest.raises(SegmentError, match="holds"):
        store.take(0, 0, 0, {0: ["x"]})
    store.close()


def test_a_slot_past_the_cap_spills_and_free_slots_of_other_sizes_make_room(
        server: RedisServer, tmp_path: Path) -> None:
    base = tmp_path / "tier"
    small, large = {0: {"a": torch.randn(1000)}}, {0: {"a": torch.randn(1500)}}
    store = private(server, base, "cap", cap=8192)
    store.put(0, 0, 0, small)  # 4000 bytes: one slot
    store.release(0, 0, 0, names(small))
    store.put(0, 1, 0, large)  # 6000: fits only once the free 4000-byte slot went
    assert [p.stat().st_size for p in slots(base)] == [6016]
    store.put(0, 2, 0, large)  # a second 6000 would pass the cap: Redis holds it
    assert connect(server.address).exists(store.inner.key(0, 2, 0, 0, "a"))
    assert len(slots(base)) == 1
    assert torch.equal(store.take(0, 2, 0, {0: ["a"]})[0]["a"], large[0]["a"])
    assert torch.equal(store.take(0, 1, 0, {0: ["a"]})[0]["a"], large[0]["a"])
    store.close()


def test_a_crashed_rank_s_slots_go_when_the_next_attempt_opens(
        server: RedisServer, tmp_path: Path) -> None:
    base = tmp_path / "tier"
    crashed = private(server, base, "lease", attempt=0)
    crashed.put(0, 0, 0, stash(2))  # never closed: its slot stays behind
    assert len(slots(base)) == 1
    successor = private(server, base, "lease", attempt=1)
    assert slots(base) == []
    successor.put(0, 0, 0, stash(2))
    assert successor.clear_job() >= 1 and slots(base) == []
    successor.close()


def test_a_stash_put_again_is_the_one_taken_wherever_either_went(
        server: RedisServer, tmp_path: Path) -> None:
    base, redis = tmp_path / "tier", connect(server.address)
    small, large = {0: {"a": torch.zeros(1000)}}, {0: {"a": torch.ones(1500)}}
    store = private(server, base, "twice", cap=5000)
    store.put(0, 0, 0, small)
    store.put(0, 0, 0, large)  # past the cap, its slot freed or not: to Redis
    assert redis.exists(store.inner.key(0, 0, 0, 0, "a"))
    assert torch.equal(store.take(0, 0, 0, {0: ["a"]})[0]["a"], large[0]["a"])
    store.put(0, 1, 0, large)  # to Redis, then put again small enough for a slot:
    store.put(0, 1, 0, small)  # the first one's values go
    assert not redis.exists(store.inner.key(0, 1, 0, 0, "a"))
    assert torch.equal(store.take(0, 1, 0, {0: ["a"]})[0]["a"], small[0]["a"])
    store.close()


def test_a_store_keeps_two_free_slots_of_a_size_and_removes_the_rest(
        server: RedisServer, tmp_path: Path) -> None:
    base = tmp_path / "tier"
    store, want = private(server, base, "few"), stash(5)
    size = store.put(0, 0, 0, want)
    for m in (1, 2, 3):
        store.put(0, m, 0, want)
    assert len(slots(base)) == 4
    for m in range(4):
        store.release(0, m, 0, names(want))
    assert len(slots(base)) == 2 and store.node_bytes() == 2 * size
    store.close()


def test_a_slot_of_a_cleared_job_is_not_written_again(
        server: RedisServer, tmp_path: Path) -> None:
    base = tmp_path / "tier"
    store, want = private(server, base, "cleared"), stash(6)
    size = store.put(0, 0, 0, want)
    store.release(0, 0, 0, names(want))
    assert segments.clear_job(base, "cleared") == 1 and slots(base) == []
    store.put(0, 1, 0, want)  # a new slot in a new directory, counted by the tier
    assert len(slots(base)) == 1 and segments.used_bytes(base) == size
    assert_same(store.take(0, 1, 0, names(want)), want)
    store.close()


def test_the_mapping_of_a_removed_file_goes_within_a_few_lookups(tmp_path: Path) -> None:
    maps = SegmentMaps()
    paths = [tmp_path / f"f{i}" for i in range(2)]
    fds = []
    for path in paths:
        path.write_bytes(bytes(4096))
        fds.append(os.open(path, os.O_RDWR))
    maps.copy_into(fds[0], 4096, [(0, memoryview(bytearray(b"x")))])
    inode = os.fstat(fds[0]).st_ino
    paths[0].unlink()
    for _ in range(PURGE_EVERY):
        maps.copy_into(fds[1], 4096, [(0, memoryview(bytearray(b"y")))])
    assert inode not in maps._maps and len(maps._maps) == 1
    assert paths[1].read_bytes()[:1] == b"y"
    maps.close()
    for fd in fds:
        os.close(fd)


def test_a_close_that_lands_during_a_put_spills_the_stash(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close (the job's clear, on another thread) between a put's claim of a slot and its
    copy: the put neither fails nor records a removed slot; the stash goes to Redis."""
    from offload_store.ownslots import OwnSlots

    store, want = private(server, tmp_path / "tier", "raced"), stash(8)
    claim = OwnSlots._claim

    def claim_then_close(self: OwnSlots, size: int) -> object:
        slot = claim(self, size)
        self.close()
        return slot

    monkeypatch.setattr(OwnSlots, "_claim", claim_then_close)
    store.put(0, 0, 0, want)
    monkeypatch.undo()
    assert slots(tmp_path / "tier") == []
    assert connect(server.address).keys("pipefb:raced:0:0:*")  # spilled
    assert_same(store.take(0, 0, 0, names(want)), want)
    store.close()
