"""The offload store against plain redis-py, and its round trip beside memcpy and raw TCP.

One micro-batch's stash of a small GPT stage (56 float32 tensors, 21 MiB by default) goes
through the store the workers use (`OffloadStore.put`: zero-copy frames in one pipeline,
[Note: zero-copy put]; `OffloadStore.take`: one pipeline of GETDEL, every value received
into a buffer of its own, validated, and viewed by its tensor, [Note: values received in
place]) and, alternately in the same rounds, through a plain
redis-py client on the same server: SET of the same bytes (`pipefb.codec.pack`, hiredis
packing) and GETDEL of them, returned as bytes with nothing decoded. Ratios are the
store's MB/s over plain redis-py's, paired by round.

The `bandwidth` part puts and fetches one stash of 1, 16 and 64 MiB (one float32 tensor)
through six paths on this host, interleaved in each repeat: `memcpy` (a copy into a
buffer and one back, torch, one thread), `raw TCP` (a loopback socket to a peer process
that keeps the bytes and sends them back: length-prefixed, no framing beyond that),
`redis-py` (SET of a view of the tensor's bytes, GETDEL returned as bytes, nothing
decoded), `store` (`OffloadStore.put` and `take`: validated, the tensor viewing the buffer
the value was received into; a value over the chunk size, 4 MiB, as chunks over several
connections: [Note: chunked values] in offload_store/chunks.py), `store, one key` (the
same with chunks off, `chunk_bytes=0`: every value one SET and one GETDEL) and `local
tier` (the node-local tier's `put` and `take`: a segment in /dev/shm written with one
copy, into a spare file's kept mapping once there is one, and its index key in the same
Redis, then the take's one pipeline, the checks, and a tensor viewing the segment's
mapping, no copy: [Note: segment mappings] in offload_store/mapped.py). A round trip's
MiB/s is the stash's MiB over put + fetch seconds. Run:
`python bench/store.py [--quick] [--part measured|bandwidth] [--repeats N] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import torch

from bench.output import add_part_flags, run_parts
from bench.stats import error_bars, fmt, summary
from offload_store import OffloadStore, connect, open_store
from offload_store.server import RedisServer
from pipefb.codec import pack

PATHS = ("plain put", "store put", "plain get", "store take")
ROUND_TRIP = ("memcpy", "raw TCP", "redis-py", "store", "store, one key",  # bandwidth's
              "local tier")  # paths
SIZES_MIB = (1, 16, 64)
MiB = 1 << 20
HEADER = struct.Struct("<cQ")  # raw TCP: op (b"P" put, b"G" get) and byte count


def stash(count: int, scale: int) -> list[torch.Tensor]:
    """A stage's stash: `count` float32 tensors of 64 Ki and 128 Ki elements (over `scale`)."""
    return [torch.randn((65536 if j % 2 else 131072) // scale) for j in range(count)]


def plain_put(client: redis.Redis, values: list[bytes]) -> None:
    pipe = client.pipeline(transaction=False)
    for i, value in enumerate(values):
        pipe.set(f"pipefb:bench:{i}", value, ex=60)
    pipe.execute()


def plain_get(client: redis.Redis, count: int) -> list[bytes]:
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        pipe.getdel(f"pipefb:bench:{i}")
    return pipe.execute()


def one_round(plain: redis.Redis, store: OffloadStore, step: int,
              tensors: list[torch.Tensor]) -> dict[str, float]:
    """Seconds of each path on the same tensors, in order; checks what each got back."""
    layers = {0: {f"t{j}": t for j, t in enumerate(tensors)}}
    took: dict[str, float] = {}
    started = time.perf_counter()
    plain_put(plain, [pack(t) for t in tensors])
    took["plain put"] = time.perf_counter() - started
    started = time.perf_counter()
    store.put(step, 0, step, layers)
    took["store put"] = time.perf_counter() - started
    started = time.perf_counter()
    values = plain_get(plain, len(tensors))
    took["plain get"] = time.perf_counter() - started
    started = time.perf_counter()
    got = store.take(step, 0, step, {0: list(layers[0])})
    took["store take"] = time.perf_counter() - started
    assert values[3] == pack(tensors[3]) and got[0]["t3"].equal(tensors[3])
    return took


def run_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Every path `--rounds` times, interleaved in each round; MB/s and paired ratios."""
    torch.set_num_threads(1)
    tensors = stash(56, 8 if args.quick else 1)
    nbytes = sum(t.nbytes for t in tensors)
    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    with RedisServer(maxmemory="2gb") as server:
        host, port = server.address.rsplit(":", 1)
        plain = redis.Redis(host=host, port=int(port))
        store = OffloadStore(connect(server.address), "bench")
        for step in range(args.rounds):
            for path, took in one_round(plain, store, step, tensors).items():
                seconds[path].append(took)
        assert store.count_keys() == 0 and plain.dbsize() == 0  # every value was taken
    rates = {p: [nbytes / MiB / s for s in seconds[p]] for p in PATHS}
    return {"bytes": nbytes, "tensors": len(tensors), "rounds": args.rounds,
            "mb_per_second": {p: summary(r) for p, r in rates.items()},
            "ratios": {
                "store put / plain put": summary([s / p for s, p in zip(
                    rates["store put"], rates["plain put"], strict=True)]),
                "store take / plain get": summary([s / p for s, p in zip(
                    rates["store take"], rates["plain get"], strict=True)])}}


def _tcp_peer(listener: socket.socket) -> None:
    """The raw TCP path's far end (in its own process): keeps what a put sends, sends it
    back on a get."""
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait on the tail
    held = bytearray()
    with conn:
        while head := _recv_exactly(conn, HEADER.size):
            op, n = HEADER.unpack(head)
            if op == b"P":
                held = held if len(held) == n else bytearray(n)
                recv_into(conn, memoryview(held))
                conn.sendall(b"k")
            else:
                conn.sendall(held)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    """`n` bytes, or b"" when the peer closed first."""
    buf = bytearray(n)
    return bytes(buf) if recv_into(conn, memoryview(buf)) else b""


def recv_into(conn: socket.socket, view: memoryview) -> bool:
    """Fills `view` from the socket; False when the peer closed first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class RoundTrips:
    """The four paths of the bandwidth part, each a (put, fetch) of one tensor."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.plain = redis.Redis(host=host, port=int(port))
        self.store = OffloadStore(connect(address), "bench-bw")
        self.one_key = OffloadStore(connect(address), "bench-bw1", chunk_bytes=0)
        listener = socket.create_server(("127.0.0.1", 0))
        self.peer = multiprocessing.get_context("fork").Process(
            target=_tcp_peer, args=(listener,), daemon=True)
        self.peer.start()
        self.sock = socket.create_connection(listener.getsockname())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.close()
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        shm = Path("/dev/shm")
        self.tier_dir = Path(tempfile.mkdtemp(prefix="pipefb-bench-tier-",
                                              dir=shm if shm.is_dir() else None))
        self.tier = open_store(address, "bench-tier", 0, local_tier_dir=str(self.tier_dir))

    def _buffer(self, use: str, t: torch.Tensor) -> torch.Tensor:
        """A buffer like `t` for `use`, allocated once per size (as staging buffers are),
        so memcpy and TCP time the copy and the socket, not fresh pages."""
        key = (use, t.nelement())
        if key not in self._buffers:
            self._buffers[key] = torch.empty_like(t)
        return self._buffers[key]

    def memcpy(self, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        held, back = self._buffer("held", t), self._buffer("back", t)
        return self._timed(lambda: held.copy_(t), lambda: back.copy_(held))

    def tcp(self, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        back = self._buffer("back", t)

        def put() -> None:
            self.sock.sendall(HEADER.pack(b"P", t.nbytes))
            self.sock.sendall(_bytes_of(t))
            _recv_exactly(self.sock, 1)

        def fetch() -> torch.Tensor:
            self.sock.sendall(HEADER.pack(b"G", t.nbytes))
            recv_into(self.sock, _bytes_of(back))
            return back
        return self._timed(put, fetch)

    def redis_py(self, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        put = partial_call(self.plain.set, "pipefb:bench:bw", _bytes_of(t))
        got = self._timed(put, lambda: self.plain.getdel("pipefb:bench:bw"))
        return got[0], got[1], torch.frombuffer(bytearray(got[2]), dtype=t.dtype)

    def offload_store(self, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        return self._store_trip(self.store, t)

    def unchunked_store(self, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        return self._store_trip(self.one_key, t)

    def _store_trip(self, store: OffloadStore, t: torch.Tensor
                    ) -> tuple[float, float, torch.Tensor]:
        got = self._timed(lambda: store.put(0, 0, 0, {0: {"x": t}}),
                          lambda: store.take(0, 0, 0, {0: ["x"]}))
        return got[0], got[1], got[2][0]["x"]

    def local_tier(self, t: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        got = self._timed(lambda: self.tier.put(0, 0, 0, {0: {"x": t}}),
                          lambda: self.tier.take(0, 0, 0, {0: ["x"]}))
        return got[0], got[1], got[2][0]["x"]

    @staticmethod
    def _timed(put: Callable[[], object], fetch: Callable[[], Any]
               ) -> tuple[float, float, Any]:
        started = time.perf_counter()
        put()
        middle = time.perf_counter()
        out = fetch()
        return middle - started, time.perf_counter() - middle, out

    def close(self) -> None:
        self.sock.close()
        self.peer.join(5)
        self.store.close()
        self.one_key.close()
        self.tier.close()
        shutil.rmtree(self.tier_dir, ignore_errors=True)
        self.plain.close()


def in_turn(paths: list[str], repeat: int) -> list[str]:
    """The paths in the order a repeat runs them: `store` and `store, one key` trade places
    every other repeat, so neither always runs right after `redis-py`, which slows the
    path after it (bench/findings.md, "Chunked Redis values")."""
    a, b = paths.index("store"), paths.index("store, one key")
    if repeat % 2:
        paths[a], paths[b] = paths[b], paths[a]
    return paths


def partial_call(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    """`fn(*args)` as a call of no arguments."""
    return lambda: fn(*args)


def run_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """Each path on each size, `--repeats` times, interleaved in each repeat; MiB/s of the
    round trip (and of put and fetch alone), checked against what went in."""
    from pipefb.allocator import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # the workers' allocator settings (pipefb.allocator)
    sizes = SIZES_MIB[:1] if args.quick else SIZES_MIB
    tensors = {size: torch.randn(size * MiB // 4) for size in sizes}
    seconds: dict[str, dict[str, dict[str, list[float]]]] = {
        str(size): {p: {"put": [], "fetch": []} for p in ROUND_TRIP} for size in sizes}
    with RedisServer(maxmemory="2gb") as server:
        paths = RoundTrips(server.address)
        run = dict(zip(ROUND_TRIP, (paths.memcpy, paths.tcp, paths.redis_py,
                                    paths.offload_store, paths.unchunked_store,
                                    paths.local_tier), strict=True))
        try:
            for t in tensors.values():  # one untimed trip each: connections, pages
                for trip in run.values():
                    trip(t)
            for repeat in range(args.repeats):
                for size, t in tensors.items():
                    for path in in_turn(list(run), repeat):
                        put, fetch, back = run[path](t)
                        assert torch.equal(back, t), path
                        seconds[str(size)][path]["put"].append(put)
                        seconds[str(size)][path]["fetch"].append(fetch)
        finally:
            paths.close()
    out: dict[str, Any] = {"repeats": args.repeats, "sizes_mib": list(sizes), "sizes": {}}
    for size in sizes:
        by_path = seconds[str(size)]
        trips = {p: [size / (a + b) for a, b in zip(s["put"], s["fetch"], strict=True)]
                 for p, s in by_path.items()}
        out["sizes"][str(size)] = {
            "round_trip_mib_per_second": {p: summary(v) for p, v in trips.items()},
            "put_mib_per_second": {p: summary([size / x for x in s["put"]])
                                   for p, s in by_path.items()},
            "fetch_mib_per_second": {p: summary([size / x for x in s["fetch"]])
                                     for p, s in by_path.items()},
            "vs_memcpy": {p: summary([x / m for x, m in zip(v, trips["memcpy"], strict=True)])
                          for p, v in trips.items() if p != "memcpy"},
            # the chunked store over the same store with chunks off ([Note: chunked values])
            "store / store, one key": summary([x / y for x, y in zip(
                trips["store"], trips["store, one key"], strict=True)])}
    return out


def chart(results: dict[str, Any], path: Path) -> None:
    """MB/s of each path: median bars with min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("measured", "bandwidth") if p in results]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 3.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        if part == "measured":
            rates = results["measured"]["mb_per_second"]
            medians, errors = error_bars(rates, PATHS)
            ax.bar(PATHS, medians, yerr=errors, capsize=4,
                   color=["tab:gray", "tab:blue", "tab:gray", "tab:blue"])
            ax.set_ylabel("MB/s (median, min-max)")
            ax.set_title(f"one stash of {results['measured']['bytes'] / MiB:.0f} MiB, "
                         "loopback Redis")
            continue
        bw = results["bandwidth"]
        measured = round_trip_paths(bw)
        width = 0.8 / len(measured)
        for j, p in enumerate(measured):
            stats = {s: bw["sizes"][s]["round_trip_mib_per_second"][p] for s in bw["sizes"]}
            medians, errors = error_bars(stats, list(stats))
            ax.bar([k + j * width for k in range(len(stats))], medians, width, yerr=errors,
                   capsize=3, label=p)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(bw["sizes"]))],
                      [f"{s} MiB" for s in bw["sizes"]])
        ax.set_yscale("log")
        ax.set_ylabel("round trip MiB/s (median, min-max)")
        ax.set_title("put + fetch of one stash, this host")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def round_trip_paths(bw: dict[str, Any]) -> list[str]:
    """The paths of `ROUND_TRIP` that a bandwidth result measured (results saved by an
    earlier version of this bench lack the paths added since)."""
    first = next(iter(bw["sizes"].values()))["round_trip_mib_per_second"]
    return [p for p in ROUND_TRIP if p in first]


def bandwidth_lines(bw: dict[str, Any]) -> list[str]:
    """Markdown of the bandwidth part: round-trip MiB/s per size and path, and each path
    over memcpy."""
    paths = round_trip_paths(bw)
    lines = ["### Put + fetch of one stash beside memcpy, raw TCP and redis-py", "",
             "One float32 tensor per stash, every path once per size in each of "
             f"{bw['repeats']} repeats, interleaved. `memcpy`: a torch copy into a buffer "
             "and one back (one thread); `raw TCP`: a loopback socket to a peer process "
             "that keeps the bytes and sends them back; `redis-py`: SET of the tensor's "
             "bytes and GETDEL, returned as bytes; `store`: `OffloadStore.put` and `take` "
             "(validated, the tensor viewing the buffer the value was received into; a "
             "value over the chunk size as chunks, put in one pipeline and taken over "
             "several connections, [Note: chunked values]); `store, one key`: the same with "
             "chunks off, one SET and one GETDEL; `local tier`: the node-local tier's `put` "
             "and `take` (a /dev/shm segment written with one copy into a spare's kept "
             "mapping, its index key in the same Redis; checked, and viewed in its mapping, "
             "no copy). MiB/s of "
             "the round trip (stash MiB over put + fetch seconds), median [min-max]; "
             "`/ memcpy` paired by repeat.", "",
             "| stash | " + " | ".join(paths) + " | "
             + " | ".join(f"{p} / memcpy" for p in paths[1:]) + " |",
             "| --- " * (2 * len(paths)) + "|"]
    for size, r in bw["sizes"].items():
        trips = r["round_trip_mib_per_second"]
        lines.append(f"| {size} MiB | " + " | ".join(fmt(trips[p], digits=0) for p in paths)
                     + " | " + " | ".join(fmt(r["vs_memcpy"][p], digits=3)
                                          for p in paths[1:]) + " |")
    chunked = {size: r["store / store, one key"] for size, r in bw["sizes"].items()
               if "store / store, one key" in r}
    if chunked:
        lines += ["", "`store` over `store, one key` (chunks against none), paired by repeat: "
                  + ", ".join(f"{size} MiB {fmt(x, digits=2)}" for size, x in chunked.items())
                  + "."]
    return [*lines, ""]


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of this bench for docs/benchmarks.md."""
    meas = res["measured"]
    lines = ["## Offload store against plain redis-py", "", f"`{cmd}`", "",
             f"One stash of {meas['tensors']} float32 tensors ({meas['bytes'] / MiB:.1f} MiB) "
             f"per round, {meas['rounds']} rounds, every path once per round on one loopback "
             "Redis. `store put` and `store take` are what the workers run (zero-copy frames "
             "in one pipeline; GETDEL in one pipeline, each value received into a buffer of "
             "its own, validated, and viewed by its tensor); `plain` is redis-py SET and "
             "GETDEL of the same bytes, returned as bytes. Median [min-max] over rounds; "
             "ratios paired by round.", "",
             "| path | MB/s |", "| --- | --- |"]
    lines += [f"| {p} | {fmt(meas['mb_per_second'][p], digits=0)} |" for p in PATHS]
    lines += ["", "| ratio | median [min-max] |", "| --- | --- |"]
    lines += [f"| {name} | {fmt(r, digits=2)} |" for name, r in meas["ratios"].items()]
    lines.append("")
    if "bandwidth" in res:
        lines += bandwidth_lines(res["bandwidth"])
    return [*lines, f"![store]({png})", ""]


def print_results(results: dict[str, Any]) -> None:
    for size, r in results.get("bandwidth", {}).get("sizes", {}).items():
        print(f"{size} MiB round trip, MiB/s: " + ", ".join(
            f"{p} {fmt(r['round_trip_mib_per_second'][p], digits=0)}"
            for p in r["round_trip_mib_per_second"]))
        if "store / store, one key" in r:
            print(f"  store / store, one key: {fmt(r['store / store, one key'], digits=2)}")
    meas = results.get("measured")
    if not meas:
        return
    print(f"{meas['bytes'] / MiB:.1f} MiB in {meas['tensors']} tensors, {meas['rounds']} rounds")
    for p in PATHS:
        print(f"  {p:<10} {fmt(meas['mb_per_second'][p], digits=0)} MB/s")
    for name, r in meas["ratios"].items():
        print(f"  {name}: {fmt(r, digits=2)}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_part_flags(p, "a tiny run for CI", ("measured", "bandwidth"))
    p.add_argument("--rounds", type=int, default=15, help="paired rounds of every path")
    p.add_argument("--repeats", type=int, default=8,  # even: `in_turn` evens out the order
                   help="bandwidth: interleaved repeats of every path and size")
    p.add_argument("--out", type=Path, default=None, help="write results.json and a PNG here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats = 3, 2
    return run_parts("store", args, {"measured": lambda: run_measured(args),
                                     "bandwidth": lambda: run_bandwidth(args)},
                     print_results, chart, "store.png")


if __name__ == "__main__":
    main()
