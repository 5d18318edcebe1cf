"""The offload-store link probe: stashes shaped as a stage's put into and taken from a
real Redis through `OffloadStore`, the worker's own stash and fetch; and the node-local
tier's, through the store a CPU rank that takes back its own stashes opens (`tier_link`),
and through the stores of two ranks that hand stashes over on one host, as their copy lanes
use them (`shared_tier_link`).

The Redis is started as `LocalServices` starts it (`python -m offload_store`). A probe
round puts `STASH_DEPTH` fresh stashes of `STASH_TENSORS` tensors over `STASH_LAYERS`
layers before the first is taken (micro-batches in flight), each put and take after the
idle gap ([Note: idle links] in calibration.links); a link's time is the mean of one put
and one take, and its `cpu` counts this process and redis-server (`calibration.cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from calibration.cpu import CpuMeter
from calibration.fit import fit_link, fit_probes
from calibration.settings import JOB, PROBE_TIMEOUT_S, Settings
from offload_store import OffloadStore, StashStore, connect
from offload_store.api import LayerTensors
from offload_store.shm import BYTES_ENV, DIR_ENV, check_tier, default_cap, with_local_tier
from offload_store.writer import STASH_IN_FLIGHT_BYTES, StashWriter
from pipefb.errors import ConfigError
from pipefb.sim.cluster import Link

STORE_MAXMEMORY = "256mb"  # the probe Redis holds `STASH_DEPTH` stashes at a time
STASH_TENSORS = 16  # tensors of a probe stash: a stage's saved tensors, several per layer
STASH_LAYERS = 4  # layers a probe stash spreads them over
STASH_DEPTH = 2  # probe stashes in the store before the first is taken
SHM_ROOT = Path("/dev/shm")  # where the tier probe's directory goes (= pipefb.app.local's)


def tier_root() -> Path:
    """Where `pipefb local` makes its workers' tier directory, and the probes theirs:
    `SHM_ROOT`, else the system's temporary directory."""
    return SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())


def tier_cap(env: Mapping[str, str] | None = None) -> int:
    """The cap of the node-local tier that a local cluster's workers use (`env`, default
    this process's environment, is theirs): `PIPEFB_LOCAL_TIER_BYTES`, their
    --local-tier-bytes, where it gives one (>= 0), else their default (-1), half the file
    system that holds their tier directory (`PIPEFB_LOCAL_TIER_DIR`, else the one `pipefb
    local` makes in `tier_root`; `offload_store.shm.default_cap`).

    Raises:
        ConfigError: `PIPEFB_LOCAL_TIER_BYTES` is not an integer >= -1; names it.
    """
    env = os.environ if env is None else env
    value = env.get(BYTES_ENV, "-1")
    try:
        cap = int(value)
    except ValueError:
        raise ConfigError(f"{BYTES_ENV}={value!r} is not an integer") from None
    check_tier("", cap)
    if cap >= 0:
        return cap
    folder = Path(env.get(DIR_ENV) or tier_root()).absolute()
    while not folder.is_dir():  # the worker makes it: the file system it will be on
        folder = folder.parent
    return default_cap(folder)


class PutTake(Protocol):
    """What a probe round puts into and takes from: a store, or a copy lane over stores."""

    def put(self, step: int, microbatch: int, version: int, tensors: LayerTensors) -> int:
        """Puts one micro-batch's stash."""
        ...

    def take(self, step: int, microbatch: int, version: int,
             names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes one micro-batch's stash."""
        ...


class LaneCopies:
    """A producer's and a consumer's store used as the workers' copy lanes use them
    ([Note: copy lane] in pipefb.sim.copylane): a put is handed to a `StashWriter`, whose
    I/O thread writes it, and lasts until it is written (what a fenced send waits for); a
    take runs on a prefetch thread of its own and lasts until its result is back. Both so
    pay the hand-overs between threads, and the waits for the interpreter's lock, that a
    worker's copies pay beside the put and take themselves."""

    def __init__(self, producer: StashStore, consumer: StashStore) -> None:
        self.consumer = consumer
        self.writer = StashWriter(producer, STASH_IN_FLIGHT_BYTES)
        self.prefetch = ThreadPoolExecutor(1, thread_name_prefix="prefetch")

    def put(self, step: int, microbatch: int, version: int, tensors: LayerTensors) -> int:
        """Hands the stash to the writer and returns once it is written."""
        self.writer.put(step, microbatch, version, tensors)
        self.writer.drain()  # raises a failed write's error
        return sum(t.nbytes for named in tensors.values() for t in named.values())

    def take(self, step: int, microbatch: int, version: int,
             names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes the stash on the prefetch thread and returns its result."""
        return self.prefetch.submit(self.consumer.take, step, microbatch, version,
                                    names).result()

    def close(self) -> None:
        """Stops the writer and the prefetch thread (the stores stay open)."""
        self.writer.close()
        self.prefetch.shutdown(wait=True)


def _probe_stash(size: int) -> dict[int, dict[str, torch.Tensor]]:
    """A fresh stash of about `size` bytes: `STASH_TENSORS` float32 tensors over
    `STASH_LAYERS` layers."""
    numel = max(1, size // (4 * STASH_TENSORS))
    per_layer = STASH_TENSORS // STASH_LAYERS
    return {layer: {f"t{k}": torch.ones(numel) for k in range(per_layer)}
            for layer in range(STASH_LAYERS)}


def _store_round(store: PutTake, first_step: int, size: int, gap: float,
                 meter: CpuMeter | None = None) -> float:
    """Mean seconds of one put or take of `STASH_DEPTH` fresh stashes, all put before the
    first is taken, each after the store sat idle `gap` seconds ([Note: idle links]);
    `meter` times the puts and takes alone (not the stashes' making, nor the gaps)."""
    stashes = [_probe_stash(size) for _ in range(STASH_DEPTH)]
    names = {layer: list(tensors) for layer, tensors in stashes[0].items()}
    ops: list[Callable[[], object]] = [
        functools.partial(store.put, first_step + k, 0, 0, stash)
        for k, stash in enumerate(stashes)]
    ops += [functools.partial(store.take, first_step + k, 0, 0, names)
            for k in range(STASH_DEPTH)]
    seconds = 0.0
    for op in ops:
        time.sleep(gap)
        with meter.span() if meter is not None else contextlib.nullcontext():
            started = time.perf_counter()
            op()
            seconds += time.perf_counter() - started
    return seconds / len(ops)


def _store_seconds(store: PutTake, size: int, repeats: int, warmup: int,
                   first_step: int, gap: float, meter: CpuMeter | None = None
                   ) -> list[float]:
    """Seconds of one stash or fetch of `size` bytes, in each of `repeats` rounds after
    `warmup` untimed (see `_store_round`)."""
    times = [_store_round(store, first_step + i * STASH_DEPTH, size, gap, meter)
             for i in range(warmup + repeats)]
    return times[warmup:]


def store_link(address: str, settings: Settings, pids: Sequence[int] = ()) -> Link:
    """The offload-store link, from puts and takes on the Redis at `address`; `pids` are
    the processes whose CPU a transfer uses besides this one (the redis-server)."""
    meter = CpuMeter([os.getpid(), *pids])
    # the probe's own Redis has no users, whatever $PIPEFB_STORE_USER and _PASSWORD say
    store = OffloadStore(connect(address, username=None, password=None), JOB,
                         max_wait_seconds=PROBE_TIMEOUT_S)
    try:
        small = _store_seconds(store, settings.small_bytes, settings.small_repeats,
                               settings.warmup, 0, settings.idle_gap)
        large = _store_seconds(store, settings.large_bytes, settings.large_repeats,
                               settings.warmup,
                               (settings.warmup + settings.small_repeats) * STASH_DEPTH,
                               settings.idle_gap, meter)
        store.clear_job()
    finally:
        store.close()
    link = fit_probes("Redis store", settings.small_bytes, small, settings.large_bytes, large)
    return replace(link, cpu=meter.cores())


def tier_link(address: str, settings: Settings) -> Link:
    """The node-local tier as a CPU rank that takes back its own stashes uses it: the
    store's probe stashes put into and taken from a private tier store ([Note: private
    index] in offload_store/shm.py: one segment per stash, a take a view of it) in a
    directory of its own, in front of the Redis at `address` (which it never reaches).
    Back to back, no idle gap: a memcpy has no link to wake ([Note: tier copies] in
    pipefb.sim.costmodel). The line goes through the medians, not the means: these copies
    are the rank's own CPU work, and their slow tail is other processes taking the cores
    (bench/findings.md), which the simulator charges as processor sharing already."""
    with tempfile.TemporaryDirectory(prefix="pipefb-calibrate-tier-", dir=tier_root()) as folder:
        inner = OffloadStore(connect(address, username=None, password=None), JOB,
                             max_wait_seconds=PROBE_TIMEOUT_S)
        store = with_local_tier(inner, folder, local_tier_private=True)
        try:
            small = _store_seconds(store, settings.small_bytes, settings.small_repeats,
                                   settings.warmup, 0, 0.0)
            large = _store_seconds(store, settings.large_bytes, settings.large_repeats,
                                   settings.warmup,
                                   (settings.warmup + settings.small_repeats) * STASH_DEPTH, 0.0)
            store.clear_job()
        finally:
            store.close()
    return fit_link("node-local tier", settings.small_bytes, statistics.median(small),
                    settings.large_bytes, statistics.median(large))


def shared_tier_link(address: str, settings: Settings, pids: Sequence[int] = ()) -> Link:
    """The node-local tier as two ranks of one host that hand stashes over use it (a
    PipeFB forward rank and the backward rank that takes its layers: [Note: tier ranks]
    in offload_store/tierranks.py): the store's probe stashes put by a producer's tier
    store and taken by a consumer's, both on one tier directory in front of the Redis at
    `address` that holds their index keys, each after the idle gap, as `store_link` times
    Redis's ([Note: shared tier] in pipefb.sim.costmodel), and each through the copy lane's
    own threads (`LaneCopies`): the producer's writer and the consumer's prefetch thread.
    Half `settings.large_repeats` rounds of each size keep the calibration short; `pids`
    are as `store_link`'s.

    The line goes through the rounds' medians, not their means: a job's stashes of one
    size go into the spare files its earlier takes left ([Note: spare segments] in
    offload_store/segments.py), while the slow tail of these probes is a write into fresh
    pages (the first rounds, or rounds after another process churned the host's memory),
    many times slower than one into a spare (bench/findings.md)."""
    meter = CpuMeter([os.getpid(), *pids])
    layers = range(STASH_LAYERS)
    with tempfile.TemporaryDirectory(prefix="pipefb-calibrate-shared-",
                                     dir=tier_root()) as folder:
        def tier_store(rank: int) -> StashStore:  # rank 0 stashes, rank 1 takes
            inner = OffloadStore(connect(address, username=None, password=None), JOB,
                                 max_wait_seconds=PROBE_TIMEOUT_S)
            return with_local_tier(inner, folder, local_tier_ranks=2, local_tier_rank=rank,
                                   local_tier_consumers=dict.fromkeys(layers, 1) if rank == 0
                                   else {},
                                   local_tier_producers=dict.fromkeys(layers, 0) if rank == 1
                                   else {})

        producer = tier_store(0)
        consumer = tier_store(1)
        lane = LaneCopies(producer, consumer)
        repeats, warmup = max(1, settings.large_repeats // 2), settings.warmup
        try:
            small = _store_seconds(lane, settings.small_bytes, repeats, warmup, 0,
                                   settings.idle_gap)
            large = _store_seconds(lane, settings.large_bytes, repeats, warmup,
                                   (warmup + repeats) * STASH_DEPTH, settings.idle_gap,
                                   meter)
            producer.clear_job()
        finally:
            lane.close()
            consumer.close()
            producer.close()
    link = fit_link("shared node-local tier", settings.small_bytes, statistics.median(small),
                    settings.large_bytes, statistics.median(large))
    return replace(link, cpu=meter.cores())
