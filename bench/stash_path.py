"""Where a PipeFB stash's time goes, part by part, on this machine's device.

One micro-batch's stash (by default 6 layers of 8 float32 tensors, 24 MiB in all: a
micro-batch of the GPU page's gpt 6x384) goes through the parts that a forward rank's
writer and a backward rank's prefetch thread run, on one host's node-local tier:

- `to host` (CUDA): `HostStaging.to_host` and the wait for its copy's event;
- `tier put`: the tier's put of the host tensors (the producer's handle);
- `tier take`: the tier's take of them (the consumer's handle: views of the segment);
- `pin` and `h2d` (CUDA): the taken tensors copied one by one into pinned memory, then
  one by one to the device (the way `to device` went before [Note: coalesced copies]);
- `to device` (CUDA): `HostStaging.to_device` (a pinned buffer per layer and dtype, each
  copied whole) and the wait for its copy's event;
- `h2d pageable` and `h2d segment` (CUDA): two ways `to device` could go instead: each
  taken tensor copied straight from the mapping (CUDA stages pageable memory itself,
  on this thread, with the interpreter's lock released), and the whole mapping the
  taken tensors view as one copy (its header too: GB/s counts the stash's bytes);
- `one copy`: the stash as one flat buffer copied to host memory and back (CUDA: a
  pinned buffer and the device; CPU: memcpy), the bound the parts could approach.

Every part runs on the measuring thread, while a second thread is `idle` or `busy`
launching small tensor operations in a loop as a forward or a backward does: the busy
rows show what waiting for the interpreter's lock adds. On CUDA every part's copies run
on the staging's copy stream and wait for it alone, not for the busy thread's kernels.
Medians [min-max] over rounds, ms and GB/s.
Run: `python bench/stash_path.py [--device cuda] [--rounds N] [--mib M]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.output import write_results
from bench.stats import fmt, summary
from offload_store import open_store
from offload_store.api import LayerTensors
from offload_store.server import RedisServer
from offload_store.staging import HostStaging

LAYERS, TENSORS = 6, 8
MiB = 1 << 20
LOADS = ("idle", "busy")


def make_stash(mib: int, device: torch.device) -> LayerTensors:
    """`LAYERS` layers of `TENSORS` float32 tensors, `mib` MiB in all, on `device`."""
    n = mib * MiB // 4 // (LAYERS * TENSORS)
    g = torch.Generator().manual_seed(0)
    return {layer: {f"t{i}": torch.randn(n, generator=g).to(device) for i in range(TENSORS)}
            for layer in range(LAYERS)}


@contextmanager
def load(kind: str, device: torch.device) -> Iterator[None]:
    """A second thread, idle or busy with small operations on `device`, while inside."""
    stop = threading.Event()

    def spin() -> None:
        x = torch.zeros(256, device=device)
        while not stop.is_set():
            for _ in range(64):
                x.add_(1.0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # as a step's end does; bounds the queue

    thread = threading.Thread(target=spin, daemon=True) if kind == "busy" else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def one_round(r: int, stash: LayerTensors, names: dict[int, list[str]], stores: Any,
              staging: HostStaging | None, flat: torch.Tensor, host: torch.Tensor,
              back: torch.Tensor) -> dict[str, float]:
    """Seconds of each part for one stash (step `r`)."""
    producer, consumer = stores
    seconds: dict[str, float] = {}
    if staging is not None:
        def to_host() -> tuple[LayerTensors, Callable[[], None]]:
            out, wait, give_back = staging.to_host(stash)
            wait()
            return out, give_back
        seconds["to host"], (on_host, give_back) = timed(to_host)
    else:
        on_host, give_back = stash, (lambda: None)
    seconds["tier put"], _ = timed(lambda: producer.put(r, 0, 0, on_host))
    give_back()
    seconds["tier take"], got = timed(lambda: consumer.take(r, 0, 0, names))
    if staging is not None:
        probe = staging.stream  # the parts' copies run on the copy stream, as the workers'
        seconds["pin"], pinned = timed(lambda: {i: {n: t.pin_memory() for n, t in named.items()}
                                                for i, named in got.items()})

        def on_stream(copies: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                with torch.cuda.stream(probe):
                    copies()
                probe.synchronize()
            return run

        def h2d() -> None:
            for named in pinned.values():
                for t in named.values():
                    t.to(staging.device, non_blocking=True)
        seconds["h2d"], _ = timed(on_stream(h2d))

        def to_device() -> None:
            _, arrival = staging.to_device(got)
            arrival.event.synchronize()
        seconds["to device"], _ = timed(to_device)

        def h2d_pageable() -> None:
            for named in got.values():
                for t in named.values():
                    t.to(staging.device)
        seconds["h2d pageable"], _ = timed(on_stream(h2d_pageable))

        def h2d_segment() -> None:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage()
                        for named in got.values() for t in named.values()}
            for storage in storages.values():
                torch.empty(0, dtype=torch.uint8).set_(storage).to(staging.device)
        seconds["h2d segment"], _ = timed(on_stream(h2d_segment))

        def there_and_back() -> None:
            host.copy_(flat, non_blocking=True)
            probe.synchronize()
            back.copy_(host, non_blocking=True)
        one_copy = on_stream(there_and_back)
    else:
        def one_copy() -> None:
            host.copy_(flat)
            back.copy_(host)
    seconds["one copy"], _ = timed(one_copy)
    return seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part under each load, `rounds` times (the first two rounds warm up)."""
    device = torch.device(args.device)
    stash = make_stash(args.mib, device)
    names = {i: list(named) for i, named in stash.items()}
    nbytes = sum(t.nbytes for named in stash.values() for t in named.values())
    flat = torch.cat([t for named in stash.values() for t in named.values()])
    host = torch.empty_like(flat, device="cpu", pin_memory=device.type == "cuda")
    back = torch.empty_like(flat)
    staging = HostStaging(device) if device.type == "cuda" else None
    parts: dict[str, dict[str, list[float]]] = {kind: {} for kind in LOADS}
    layers = range(LAYERS)
    shm = Path("/dev/shm")
    with RedisServer(maxmemory="1gb") as server, \
            tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tier:
        producer = open_store(server.address, "stash-path", 0, local_tier_dir=tier,
                              local_tier_ranks=2, local_tier_rank=0,
                              local_tier_consumers=dict.fromkeys(layers, 1))
        consumer = open_store(server.address, "stash-path", 0, local_tier_dir=tier,
                              local_tier_ranks=2, local_tier_rank=1,
                              local_tier_producers=dict.fromkeys(layers, 0))
        step = 0
        for kind in LOADS:
            with load(kind, device):
                for r in range(args.rounds + 2):
                    got = one_round(step, stash, names, (producer, consumer), staging, flat,
                                    host, back)
                    step += 1
                    if r >= 2:
                        for part, s in got.items():
                            parts[kind].setdefault(part, []).append(s)
        producer.close()
        consumer.close()
    return {"bench": "stash_path", "device": str(device), "bytes": nbytes,
            "tensors": LAYERS * TENSORS, "rounds": args.rounds,
            "seconds": {k: {p: summary(v) for p, v in d.items()} for k, d in parts.items()}}


def show(res: dict[str, Any]) -> None:
    """One line per part: ms and GB/s, idle and busy."""
    gb = res["bytes"] / 1e9
    print(f"stash of {res['tensors']} tensors, {res['bytes'] / MiB:.1f} MiB on "
          f"{res['device']}, {res['rounds']} rounds; ms and GB/s, median [min-max]")
    for part in res["seconds"]["idle"]:
        cells = []
        for kind in LOADS:
            s = res["seconds"][kind][part]
            cells.append(f"{kind} {fmt(s, 1e3, 2)} ms, {gb / s['median']:.2f} GB/s")
        print(f"  {part:10s} " + " | ".join(cells))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--mib", type=int, default=24, help="MiB of the stash")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = p.parse_args(argv)
    res = run(args)
    show(res)
    write_results(args.out, res)
    return res


if __name__ == "__main__":
    main()
