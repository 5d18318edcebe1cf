"""The offload store against plain redis-py: MB/s of putting and taking one stash.

One micro-batch's stash of a small GPT stage (56 float32 tensors, 21 MiB by default) goes
through the store the workers use (`OffloadStore.put`: zero-copy frames in one pipeline,
[Note: zero-copy put]; `OffloadStore.take`: one pipeline of GETDEL, then every value
validated and decoded into a tensor) and, alternately in the same rounds, through a plain
redis-py client on the same server: SET of the same bytes (`pipefb.codec.pack`, hiredis
packing) and GETDEL of them, returned as bytes with nothing decoded. Ratios are the
store's MB/s over plain redis-py's, paired by round. Run:
`python bench/store.py [--quick] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import torch

from bench.output import add_part_flags, run_parts
from bench.stats import error_bars, fmt, summary
from offload_store import OffloadStore, connect
from offload_store.server import RedisServer
from pipefb.codec import pack

PATHS = ("plain put", "store put", "plain get", "store take")
MiB = 1 << 20


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


def chart(results: dict[str, Any], path: Path) -> None:
    """MB/s of each path: median bars with min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = results["measured"]["mb_per_second"]
    medians, errors = error_bars(rates, PATHS)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(PATHS, medians, yerr=errors, capsize=4,
           color=["tab:gray", "tab:blue", "tab:gray", "tab:blue"])
    ax.set_ylabel("MB/s (median, min-max)")
    ax.set_title(f"one stash of {results['measured']['bytes'] / MiB:.0f} MiB, loopback Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of this bench for docs/benchmarks.md."""
    meas = res["measured"]
    lines = ["## Offload store against plain redis-py", "", f"`{cmd}`", "",
             f"One stash of {meas['tensors']} float32 tensors ({meas['bytes'] / MiB:.1f} MiB) "
             f"per round, {meas['rounds']} rounds, every path once per round on one loopback "
             "Redis. `store put` and `store take` are what the workers run (zero-copy frames "
             "in one pipeline; GETDEL in one pipeline, then each value validated and decoded "
             "into a tensor); `plain` is redis-py SET and GETDEL of the same bytes, returned "
             "as bytes. Median [min-max] over rounds; ratios paired by round.", "",
             "| path | MB/s |", "| --- | --- |"]
    lines += [f"| {p} | {fmt(meas['mb_per_second'][p], digits=0)} |" for p in PATHS]
    lines += ["", "| ratio | median [min-max] |", "| --- | --- |"]
    lines += [f"| {name} | {fmt(r, digits=2)} |" for name, r in meas["ratios"].items()]
    return [*lines, "", f"![store]({png})", ""]


def print_results(results: dict[str, Any]) -> None:
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
    add_part_flags(p, "a tiny run for CI", ("measured",))
    p.add_argument("--rounds", type=int, default=15, help="paired rounds of every path")
    p.add_argument("--out", type=Path, default=None, help="write results.json and a PNG here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 3
    return run_parts("store", args, {"measured": lambda: run_measured(args)}, print_results,
                     chart, "store.png")


if __name__ == "__main__":
    main()
