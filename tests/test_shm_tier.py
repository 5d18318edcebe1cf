"""The node-local shared-memory tier (offload_store/shm.py, offload_store/segments.py)
against a real redis-server: segments in, views out, spill past the cap, leases, refusal
of tampered segments."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from offload_store import OffloadStore, RedisServer, connect, open_admin, open_store
from offload_store.keys import segment_key, tier_ranks_key
from offload_store.segments import (
    LENT_PREFIX,
    OWN_PREFIX,
    SPARE_PREFIX,
    SUFFIX,
    SegmentError,
    segment_size,
)
from offload_store.shm import DIR_ENV, SharedTierStore
from offload_store.store import SOCKET_ENV

MB = 1 << 20


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="256mb") as srv:
        yield srv


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def tier(server: RedisServer, base: Path, job: str = "j", attempt: int = 0,
         ranks: int = 1, cap: int = -1, private: bool = False, **options: Any
         ) -> SharedTierStore:
    """A store of the tier at `base`; `options`: more of `open_store`'s."""
    store = open_store(server.address, job, attempt, local_tier_dir=str(base),
                       local_tier_bytes=cap, local_tier_ranks=ranks,
                       local_tier_private=private, **options)
    assert isinstance(store, SharedTierStore)
    return store


def stash() -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {0: {"x": torch.randn(3, 5, generator=g), "i": torch.arange(7)},
            2: {"m": torch.rand(4, generator=g) > 0.5, "h": torch.randn(2, 2).half()}}


def names(tensors: dict[int, dict[str, torch.Tensor]]) -> dict[int, list[str]]:
    return {i: list(named) for i, named in tensors.items()}


def segment_files(base: Path) -> list[Path]:
    return sorted(base.glob(f"*/[0-9]*{SUFFIX}"))  # not the spares


def own_files(base: Path) -> list[Path]:
    """A private store's slot files ([Note: own slots])."""
    return sorted(base.glob(f"*/{OWN_PREFIX}*{SUFFIX}"))


def redis_client(server: RedisServer) -> redis.Redis:
    return connect(server.address)


def assert_same(got: dict[int, dict[str, torch.Tensor]],
                want: dict[int, dict[str, torch.Tensor]]) -> None:
    assert names(got) == names(want) or {i: sorted(n) for i, n in names(got).items()} == {
        i: sorted(n) for i, n in names(want).items()}
    for i, named in want.items():
        for n, t in named.items():
            assert got[i][n].dtype == t.dtype and torch.equal(got[i][n], t)


def test_a_stash_goes_through_one_segment_and_comes_back_bit_for_bit(
        server: RedisServer, base: Path) -> None:
    store, want = tier(server, base), stash()
    sets = redis_client(server).info("commandstats").get("cmdstat_set", {}).get("calls", 0)
    size = store.put(3, 1, 2, want)
    files = segment_files(base)  # one segment per layer
    assert len(files) == 2 and sum(f.stat().st_size for f in files) == size
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {"0o600"}
    assert oct(base.stat().st_mode & 0o777) == "0o700"
    assert not redis_client(server).exists(store.inner.key(3, 1, 0, 2, "x"))  # no value key
    after = redis_client(server).info("commandstats")["cmdstat_set"]["calls"]
    assert after == sets + 2  # the layers' index entries, in one pipeline
    got = store.take(3, 1, 2, names(want))
    assert_same(got, want)
    assert segment_files(base) == []  # delete on consume (the files become spares)
    assert not redis_client(server).exists(segment_key("j", 0, 3, 1, 0, 2))
    assert not redis_client(server).exists(segment_key("j", 0, 3, 1, 2, 2))
    got[0]["x"].add_(1)  # the views are writable (a private mapping)
    assert torch.equal(got[0]["x"], want[0]["x"] + 1)
    assert store.stats.bytes_put == store.stats.bytes_taken == size
    with pytest.raises(KeyError):
        store.take(3, 1, 2, names(want))
    store.close()


def test_a_stash_past_the_cap_spills_to_redis_and_comes_back(
        server: RedisServer, base: Path) -> None:
    store, want = tier(server, base, job="cap", cap=4096), stash()
    big = {1: {"a": torch.randn(2000)}}  # 8000 bytes: past the 4 KiB cap
    store.put(0, 0, 0, big)
    assert segment_files(base) == []
    assert redis_client(server).exists(store.inner.key(0, 0, 1, 0, "a"))
    store.put(0, 1, 0, want)  # the small one fits
    assert len(segment_files(base)) == 2
    assert torch.equal(store.take(0, 0, 0, {1: ["a"]})[1]["a"], big[1]["a"])
    assert_same(store.take(0, 1, 0, names(want)), want)
    mixed = {**want, 1: big[1]}  # two layers fit, one spills; one take gets all three
    store.put(0, 2, 0, mixed)
    assert len(segment_files(base)) == 2
    assert redis_client(server).exists(store.inner.key(0, 2, 1, 0, "a"))
    assert_same(store.take(0, 2, 0, names(mixed)), mixed)
    assert segment_files(base) == []
    store.close()


def redis_writes(server: RedisServer) -> int:
    """Calls of every command that writes a key, so far."""
    stats = redis_client(server).info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("set", "getdel", "del"))


def test_a_private_store_keeps_a_whole_stash_in_one_segment_and_redis_out_of_it(
        server: RedisServer, base: Path) -> None:
    store, want = tier(server, base, job="own", ranks=2, private=True), stash()
    writes = redis_writes(server)
    size = store.put(3, 1, 2, want)  # its other rank never opened: a private store needs none
    files = own_files(base)
    assert len(files) == 1 and files[0].stat().st_size == size  # both layers, one file
    only = [tier_ranks_key("own", 0).encode()]  # no index entry, no value
    assert redis_client(server).keys("pipefb:own:*") == only
    got = store.take(3, 1, 2, names(want))
    assert_same(got, want)
    assert own_files(base) == files and redis_writes(server) == writes  # no round trip
    assert store.stats.bytes_put == store.stats.bytes_taken == size
    with pytest.raises(KeyError):
        store.take(3, 1, 2, names(want))
    del got  # its slot is free again once no tensor views it
    store.put(4, 0, 2, want)
    assert store.release(4, 0, 2, names(want)) == 4  # its four tensors
    assert segment_files(base) == [] and own_files(base) == files  # one slot, reused
    store.close()
    assert own_files(base) == []


def test_a_private_store_spills_a_stash_past_the_cap_to_redis(
        server: RedisServer, base: Path) -> None:
    store = tier(server, base, job="ownfull", cap=4096, private=True)
    big = {0: {"x": torch.randn(3, 5)}, 1: {"a": torch.randn(2000)}}  # 8 KB: past the cap
    store.put(0, 0, 0, big)
    assert segment_files(base) == []
    assert redis_client(server).exists(store.inner.key(0, 0, 1, 0, "a"))
    assert_same(store.take(0, 0, 0, names(big)), big)
    assert redis_client(server).keys("pipefb:ownfull:*") == [
        tier_ranks_key("ownfull", 0).encode()]
    store.close()


def test_the_layers_of_one_stash_go_to_different_consumers(
        server: RedisServer, base: Path) -> None:
    producer, want = tier(server, base, job="split", ranks=3), stash()
    first, second = (tier(server, base, job="split", ranks=3) for _ in range(2))
    producer.put(1, 0, 0, want)
    assert_same(second.take(1, 0, 0, {2: ["m", "h"]}), {2: want[2]})
    assert len(segment_files(base)) == 1
    assert_same(first.take(1, 0, 0, {0: ["x", "i"]}), {0: want[0]})
    assert segment_files(base) == []
    for store in (producer, first, second):
        store.close()


def test_a_job_whose_ranks_are_not_all_on_this_tier_stashes_in_redis(
        server: RedisServer, base: Path) -> None:
    store, want = tier(server, base, job="spread", ranks=2), stash()  # the other rank: absent
    store.put(0, 0, 0, want)
    assert segment_files(base) == []
    assert_same(store.take(0, 0, 0, names(want)), want)
    other = tier(server, base, job="spread", ranks=2)  # the second rank opens: now shared
    store.put(0, 1, 0, want)
    assert len(segment_files(base)) == 2
    assert_same(other.take(0, 1, 0, names(want)), want)
    store.close()
    other.close()


def test_a_consumer_in_another_process_maps_the_segment(
        server: RedisServer, base: Path) -> None:
    store, want = tier(server, base, job="xproc"), stash()
    store.put(5, 0, 1, want)
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path.cwd())!r})
from offload_store import open_store
s = open_store({server.address!r}, "xproc", 0, local_tier_dir={str(base)!r})
got = s.take(5, 0, 1, {names(want)!r})
torch.save({{i: {{n: t.clone() for n, t in d.items()}} for i, d in got.items()}}, sys.argv[1])
"""
    out = base.parent / "got.pt"
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, timeout=60)
    assert_same(torch.load(out, weights_only=True), want)
    assert segment_files(base) == []
    store.close()


def test_release_frees_the_segment(server: RedisServer, base: Path) -> None:
    store, want = tier(server, base, job="rel"), stash()
    store.put(0, 0, 0, want)
    assert store.release(0, 0, 0, names(want)) == 4
    assert segment_files(base) == []
    assert store.release(0, 0, 0, names(want)) == 0
    store.close()


def test_clearing_a_job_frees_its_segments(server: RedisServer, base: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    store, other = tier(server, base, job="gone"), tier(server, base, job="kept")
    for mb in range(3):
        store.put(0, mb, 0, stash())
    other.put(0, 0, 0, stash())
    assert store.clear_job() >= 3
    assert {p.parent.name.partition("+")[0] for p in segment_files(base)} == {"kept"}
    store.put(1, 0, 0, stash())  # the job goes on in a new directory
    monkeypatch.setenv(DIR_ENV, str(base))
    admin = open_admin(server.address)
    assert admin.used_memory() >= segment_files(base)[0].stat().st_size
    assert admin.clear_job("gone") >= 1 and admin.clear_job("kept") >= 1
    assert list(base.glob("*/*")) == [] and list(base.glob("*+*")) == []  # the directory is empty
    admin.close()
    store.close()
    other.close()


def test_a_new_attempt_frees_the_segments_of_earlier_ones(
        server: RedisServer, base: Path) -> None:
    crashed = tier(server, base, job="again", attempt=0)
    crashed.put(0, 0, 0, stash())
    crashed.put(0, 1, 0, stash())
    assert len(segment_files(base)) == 4
    tier(server, base, job="again", attempt=1).close()  # the replay's rank opens
    assert segment_files(base) == []


def tampered(server: RedisServer, base: Path, job: str) -> tuple[SharedTierStore, Path]:
    store = tier(server, base, job=job)
    store.put(0, 0, 0, {0: stash()[0]})
    (segment,) = segment_files(base)
    return store, segment


@pytest.mark.parametrize("how", ["longer", "shorter", "magic", "header", "offset", "shape"])
def test_a_tampered_segment_is_refused(server: RedisServer, base: Path, how: str) -> None:
    store, segment = tampered(server, base, f"tamper-{how}")
    data = bytearray(segment.read_bytes())
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    if how == "longer":
        data += b"\0" * 64
    elif how == "shorter":
        data = data[:-8]
    elif how == "magic":
        data[:8] = b"NOTASEG!"
    elif how == "header":
        data[16:16 + length] = b"{" * length
    else:
        header[0]["offset" if how == "offset" else "shape"] = (
            1 << 40 if how == "offset" else [1 << 20, 1 << 20])
        text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
        assert len(text) == length
        data[16:16 + length] = text
    segment.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match=re.escape(str(segment))):
        store.take(0, 0, 0, {0: ["x", "i"]})
    assert not segment.exists()  # refused and freed
    store.close()


def test_an_index_entry_naming_another_file_is_refused(
        server: RedisServer, base: Path, tmp_path: Path) -> None:
    store = tier(server, base, job="evil")
    store.put(0, 0, 0, stash())  # makes the job's directory
    outside = tmp_path / "secret.seg"
    outside.write_bytes(b"x" * 100)
    for path in (str(outside), str(segment_files(base)[0].parent / ".." / "node-id"),
                 f"{base}/other+{'0' * 32}/0-0-0-0-0-ab.seg"):
        entry = json.dumps({"node": store.node, "path": path, "size": 100})
        redis_client(server).set(segment_key("evil", 0, 1, 0, 0, 0), entry)
        with pytest.raises(SegmentError, match="not a segment of job 'evil'"):
            store.take(1, 0, 0, {0: ["x"]})
    assert outside.read_bytes() == b"x" * 100
    store.close()


def test_a_tier_directory_open_to_others_is_refused(server: RedisServer, base: Path) -> None:
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        tier(server, base)


def test_the_worker_flags_name_the_tier() -> None:
    from worker.__main__ import parse_args

    args = parse_args(["--local-tier-dir", "/dev/shm/x", "--local-tier-bytes", "4096"])
    assert (args.local_tier_dir, args.local_tier_bytes) == ("/dev/shm/x", 4096)
    assert parse_args([]).local_tier_bytes == -1


def test_clients_on_this_host_reach_redis_over_its_unix_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    socket = tmp_path / "redis.sock"
    with RedisServer(maxmemory="64mb", unix_socket=socket) as srv:
        assert oct(socket.stat().st_mode & 0o777) == "0o700"
        monkeypatch.setenv(SOCKET_ENV, str(socket))
        store = open_store(srv.address, "unix", 0)
        store.put(0, 0, 0, {0: {"x": torch.arange(5.0)}})
        assert store.take(0, 0, 0, {0: ["x"]})[0]["x"].tolist() == [0, 1, 2, 3, 4]
        monkeypatch.delenv(SOCKET_ENV)
        tcp = connect(srv.address)  # TCP keeps working beside it
        kinds = {c["addr"].startswith("/") for c in tcp.client_list()}
        assert kinds == {True, False}, tcp.client_list()
        tcp.close()
        store.close()


def test_a_worker_with_a_bad_tier_setting_ends_with_one_line(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    for flags, named in ((["--local-tier-dir", str(open_dir)], str(open_dir)),
                         (["--local-tier-bytes", "-5"], "-5")):
        run = subprocess.run([sys.executable, "-m", "worker", *flags], capture_output=True,
                             text=True, timeout=60, cwd=Path.cwd())
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("\n") == 1 and named in run.stderr, run.stderr


def test_a_local_cluster_sweeps_the_tier_directories_of_dead_ones(tmp_path: Path) -> None:
    from pipefb.app.local import OWNER_FILE, TIER_PREFIX, _sweep_dead_tiers

    dead, alive, new = (tmp_path / f"{TIER_PREFIX}{n}" for n in ("dead", "alive", "new"))
    for folder in (dead, alive, new):
        folder.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # its pid: exited
    child.wait()
    (dead / OWNER_FILE).write_text(str(child.pid))
    (alive / OWNER_FILE).write_text(str(os.getpid()))
    _sweep_dead_tiers(tmp_path)  # "new": no owner yet, being made
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, new.name]


def lent_files(base: Path) -> list[Path]:
    return sorted(base.glob(f"*/{LENT_PREFIX}*{SUFFIX}"))


def spare_files(base: Path) -> list[Path]:
    return sorted(base.glob(f"*/{SPARE_PREFIX}*{SUFFIX}"))


def test_a_take_views_the_segment_which_is_lent_until_its_tensors_go(
        server: RedisServer, base: Path) -> None:
    store = tier(server, base, job="lend")
    want = {0: {"x": torch.randn(64, 1024)}}  # 256 KiB
    size = store.put(0, 0, 0, want)
    (segment,) = segment_files(base)
    inode = segment.stat().st_ino
    got = store.take(0, 0, 0, {0: ["x"]})
    x = got[0]["x"]
    assert torch.equal(x, want[0]["x"])
    (lent,) = lent_files(base)  # the file is the tensor's memory now: no copy was made
    assert lent.stat().st_ino == inode and lent.stat().st_size == size
    x.mul_(2)  # writable; the write lands in the lent file, which no one else reads
    assert torch.equal(x, want[0]["x"] * 2)
    assert spare_files(base) == []
    del got, x
    gc.collect()
    assert lent_files(base) == [] and [s.stat().st_ino for s in spare_files(base)] == [inode]
    again = {0: {"x": torch.randn(64, 1024)}}
    store.put(0, 1, 0, again)  # into the spare's pages, through the producer's mapping
    (segment,) = segment_files(base)
    assert segment.stat().st_ino == inode and spare_files(base) == []
    assert_same(store.take(0, 1, 0, {0: ["x"]}), again)
    store.close()


def test_a_held_take_keeps_its_bytes_while_the_producer_writes_on(
        server: RedisServer, base: Path) -> None:
    producer, consumer = (tier(server, base, job="hold", ranks=2) for _ in range(2))
    stashes = [{0: {"x": torch.full((1000,), float(mb))}} for mb in range(4)]
    held = []
    for mb, want in enumerate(stashes):
        producer.put(0, mb, 0, want)
        held.append(consumer.take(0, mb, 0, {0: ["x"]}))
        if mb % 2:  # every other take is dropped: its file goes round again
            held.pop()
            gc.collect()
    assert [h[0]["x"][0].item() for h in held] == [0.0, 2.0]
    for h, mb in zip(held, (0, 2), strict=True):
        assert_same(h, stashes[mb])
    assert len(lent_files(base)) == 2
    producer.close()
    consumer.close()


def test_lent_files_count_toward_the_cap(server: RedisServer, base: Path) -> None:
    want = {0: {"x": torch.randn(4096)}}  # a 16 KiB tensor, one segment
    store = tier(server, base, job="lentcap", cap=20 << 10)
    store.put(0, 0, 0, want)
    got = store.take(0, 0, 0, {0: ["x"]})
    store.put(0, 1, 0, want)  # the lent one still holds its bytes: this one spills
    assert segment_files(base) == []
    assert redis_client(server).exists(store.inner.key(0, 1, 0, 0, "x"))
    del got
    gc.collect()
    store.put(0, 2, 0, want)  # the lent file is a spare again: into the tier
    assert len(segment_files(base)) == 1
    assert_same(store.take(0, 1, 0, {0: ["x"]}), want)
    assert_same(store.take(0, 2, 0, {0: ["x"]}), want)
    store.close()


def test_a_new_attempt_frees_the_lent_files_of_a_dead_consumer(
        server: RedisServer, base: Path) -> None:
    crashed = tier(server, base, job="lentcrash", attempt=0)
    want = stash()
    crashed.put(0, 0, 0, want)
    got = crashed.take(0, 0, 0, names(want))  # held, as by a consumer that died
    assert len(lent_files(base)) == 2
    tier(server, base, job="lentcrash", attempt=1).close()
    assert lent_files(base) == []
    assert_same(got, want)  # the mapping keeps the bytes of a file already gone
    del got
    gc.collect()
    assert spare_files(base) == []
    crashed.close()


def test_a_copying_tier_reads_into_new_tensors(server: RedisServer, base: Path) -> None:
    inner = OffloadStore(connect(server.address), "copying")
    store, want = SharedTierStore(inner, base, zero_copy=False), stash()
    store.put(0, 0, 0, want)
    got = store.take(0, 0, 0, names(want))
    assert_same(got, want)
    assert lent_files(base) == [] and len(spare_files(base)) == 2  # spares at once
    store.close()


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("how", ["magic", "offset", "bool"])
def test_either_way_of_taking_refuses_a_tampered_segment(
        server: RedisServer, base: Path, how: str, zero_copy: bool) -> None:
    inner = OffloadStore(connect(server.address), f"copy-{how}-{zero_copy}")
    store = SharedTierStore(inner, base, zero_copy=zero_copy)
    store.put(0, 0, 0, {0: {"m": torch.tensor([True, False, True])}})
    (segment,) = segment_files(base)
    data = bytearray(segment.read_bytes())
    length = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:16 + length])
    if how == "magic":
        data[:8] = b"NOTASEG!"
    elif how == "offset":
        header[0]["offset"] = len(data)
        data[16:16 + length] = json.dumps(header).encode().ljust(length)
    else:
        data[header[0]["offset"]] = 7
    segment.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match=re.escape(str(segment))):
        store.take(0, 0, 0, {0: ["m"]})
    assert not segment.exists() and lent_files(base) == []
    store.close()


def test_a_producer_writes_into_a_spare_through_its_own_mapping(
        server: RedisServer, base: Path) -> None:
    producer, consumer = (tier(server, base, job="pmap", ranks=2) for _ in range(2))
    first, second = ({0: {"x": torch.randn(5000)}} for _ in range(2))
    producer.put(0, 0, 0, first)
    assert_same(consumer.take(0, 0, 0, {0: ["x"]}), first)  # taken, dropped: a spare
    gc.collect()
    producer.put(0, 1, 0, second)
    (segment,) = segment_files(base)
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith(str(segment))]
    assert len(maps) == 2, maps  # the consumer's, from its take; the producer's, this write
    assert_same(consumer.take(0, 1, 0, {0: ["x"]}), second)
    producer.close()
    consumer.close()


def test_node_bytes_are_a_stores_own_segments_and_spares(
        server: RedisServer, base: Path) -> None:
    producer, consumer = (tier(server, base, job="nodebytes", ranks=2) for _ in range(2))
    want = {0: {"x": torch.randn(3000)}, 1: {"y": torch.randn(500)}}
    assert producer.node_bytes() == 0
    size = producer.put(0, 0, 0, want)
    assert size == sum(segment_size({i: named}) for i, named in want.items())
    assert producer.node_bytes() == size and consumer.node_bytes() == 0
    got = consumer.take(0, 0, 0, {0: ["x"]})  # lent: the consumer's memory now
    assert producer.node_bytes() == segment_size({1: want[1]})
    del got
    gc.collect()  # a spare, kept for the producer's next write
    assert producer.node_bytes() == size
    assert consumer.release(0, 0, 0, {1: ["y"]}) == 1
    assert producer.node_bytes() == segment_size({0: want[0]})
    assert consumer.node_bytes() == 0
    producer.close()
    consumer.close()


def test_a_write_claims_a_spare_of_its_own_size_only(server: RedisServer, base: Path) -> None:
    store = tier(server, base, job="sizes")
    small, large = {0: {"x": torch.randn(1000)}}, {0: {"x": torch.randn(3000)}}
    store.put(0, 0, 0, small)
    (first,) = segment_files(base)
    inode = first.stat().st_ino
    assert_same(store.take(0, 0, 0, {0: ["x"]}), small)
    gc.collect()
    store.put(0, 1, 0, large)  # a new file: resizing the spare would cost its mappings
    (segment,) = segment_files(base)
    assert segment.stat().st_ino != inode
    assert [s.stat().st_ino for s in spare_files(base)] == [inode]
    store.put(0, 2, 0, small)  # the spare of its size
    assert inode in {s.stat().st_ino for s in segment_files(base)} and spare_files(base) == []
    assert_same(store.take(0, 1, 0, {0: ["x"]}), large)
    assert_same(store.take(0, 2, 0, {0: ["x"]}), small)
    store.close()
