"""Stash put throughput: zero-copy frames against packed bytes, paired, on one Redis.

One micro-batch's stash of a small GPT stage (56 float32 tensors, 21 MB) is put with the
store's client (`Frame` parts, [Note: zero-copy put]) and, alternately, as `pack()` bytes
through a plain redis-py client (hiredis packing). Run: `python bench/store_put.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import torch

from bench.stats import fmt, summary
from offload_store import connect
from offload_store.frames import Frame
from offload_store.server import RedisServer
from pipefb.codec import pack


def put_all(client: redis.Redis, values: list[object]) -> float:
    """Seconds to SET every value in one pipeline."""
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, value in enumerate(values):
        pipe.set(f"bench:{i}", value, ex=60)  # type: ignore[arg-type]
    pipe.execute()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    """Prints ms per put of both paths and their ratio, median [min-max] over rounds."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tensors = [torch.randn(65536 if j % 2 else 131072) for j in range(56)]
    mb = sum(t.nbytes for t in tensors) / 2**20
    with RedisServer(maxmemory="2gb") as server:
        host, port = server.address.rsplit(":", 1)
        plain, store = redis.Redis(host=host, port=int(port)), connect(server.address)
        old, new = [], []
        for _ in range(args.rounds):
            old.append(put_all(plain, [pack(t) for t in tensors]))
            new.append(put_all(store, [Frame.of(t) for t in tensors]))
        assert store.get("bench:3") == pack(tensors[3])
    ratios = [o / n for o, n in zip(old, new, strict=True)]
    print(f"{mb:.1f} MB in {len(tensors)} tensors, {args.rounds} paired rounds")
    print(f"  packed bytes (hiredis) {fmt(summary(old), 1e3)} ms per put")
    print(f"  zero-copy frames       {fmt(summary(new), 1e3)} ms per put")
    print(f"  speed-up {fmt(summary(ratios), digits=2)}; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
