"""A PipeFB backward rank's take of a stash that its forward rank, on another host, put in
Redis: looked up in the node-local tier's index first (a consumer opened without
``local_tier_producers``: a GETDEL of the index keys, then one of the values) against
straight from Redis (with them: one GETDEL pipeline; [Note: tier ranks] in
offload_store/tierranks.py). One redis-server, two tier directories standing for two
hosts, the two ways interleaved in each round; per way the take's milliseconds, and the
straight take's time over the index-first one's paired by round, median [min-max].
Run: `PYTHONPATH=. python bench/cross_tier_take.py [--rounds N] [--kib K]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.stats import fmt, summary
from offload_store import open_store
from offload_store.api import StashStore
from offload_store.server import RedisServer

LAYERS, TENSORS = 4, 8  # a stage's stash: 4 layers of 8 tensors each
WAYS = ("index first", "straight")


def stash(kib: int) -> dict[int, dict[str, torch.Tensor]]:
    """`LAYERS` layers of `TENSORS` float32 tensors of `kib` KiB each."""
    g = torch.Generator().manual_seed(0)
    return {layer: {f"t{i}": torch.randn(kib * 256, generator=g) for i in range(TENSORS)}
            for layer in range(LAYERS)}


def open_pair(address: str, root: Path, job: str, producers: bool
              ) -> tuple[StashStore, StashStore]:
    """A forward rank 0 on tier "b" and its backward rank 1 on tier "a", of job `job`; the
    backward rank knows its producers when `producers`."""
    layers = range(LAYERS)
    producer = open_store(address, job, 0, local_tier_dir=str(root / "b"), local_tier_ranks=2,
                          local_tier_rank=0, local_tier_consumers=dict.fromkeys(layers, 1))
    consumer = open_store(address, job, 0, local_tier_dir=str(root / "a"), local_tier_ranks=2,
                          local_tier_rank=1,
                          local_tier_producers=dict.fromkeys(layers, 0) if producers else None)
    return producer, consumer


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Prints each way's take milliseconds and the paired ratio; returns the seconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="takes of each way")
    parser.add_argument("--kib", type=int, default=16, help="KiB of each of the 32 tensors")
    args = parser.parse_args(argv)
    want = stash(args.kib)
    names = {layer: list(named) for layer, named in want.items()}
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    with RedisServer(maxmemory="1gb") as server, tempfile.TemporaryDirectory() as tmp:
        pairs = {way: open_pair(server.address, Path(tmp), way.replace(" ", "-"),
                                way == "straight") for way in WAYS}
        for r in range(args.rounds):
            for way, (producer, consumer) in pairs.items():
                producer.put(0, r, 0, want)
                start = time.perf_counter()
                consumer.take(0, r, 0, names)
                seconds[way].append(time.perf_counter() - start)
        for producer, consumer in pairs.values():
            producer.close()
            consumer.close()
    for way in WAYS:
        print(f"{way}: take ms {fmt(summary(seconds[way]), 1e3, 3)}")
    ratios = [s / i for s, i in zip(seconds["straight"], seconds["index first"], strict=True)]
    print(f"straight / index first, paired by round: {fmt(summary(ratios), 1, 3)}")
    return seconds


if __name__ == "__main__":
    main()
