"""Measures this machine once (loopback gRPC between workers, the Redis offload store, the
runtime's overheads) and caches it as the cluster description of `pipefb local`.

Every figure comes from the parts a local run uses:

- **network**: this process and a peer process (`--echo-to`) each serve a StageWorker
  `Activations` stream that decodes with `protos.wire.decode_transfers` into a
  `dataplane.inbox.Inbox`, and send with `dataplane.transport.GrpcTransport.send` (one
  `PeerStream`, `wire.encode_stream`). A tensor goes to the peer, whose receive loop takes
  it from its inbox, stamps when it did and sends it back: a delivery is send call to the
  peer's `recv` return, one way. Small tensors give the latency, large ones the bandwidth.
- **idle links** ([Note: idle links]): each probe leaves after the link sat idle
  `Settings.idle_gap` (5 ms), as a pipeline's links do between micro-batches.
- **means**: a link's time at each size is the mean of its probes, not their median, as
  the profile's times are means: a step's time is the sum of its actions' ([Note: timed
  as a pipeline runs] in pipefb.profile.profiler), and a store probe's times have a slow tail
  (16 MiB: median 6.7 ms, mean 8.6, slowest tenth over 16 ms in one calibration here).
  Where one slow probe puts the small size's mean above the large size's (in one CI run:
  1 KiB 4.8 ms, 4 MiB 4.3 ms, the test's few probes), the line goes through their
  medians instead (`fit_probes`).
- **store**: a Redis started as `LocalCluster` starts it (`python -m offload_store`) and
  `OffloadStore.put` / `take`, the worker's stash and fetch, of stashes shaped as a
  stage's: `STASH_TENSORS` fresh tensors over `STASH_LAYERS` layers, `STASH_DEPTH`
  stashes put before the first is taken (micro-batches in flight), each put and take
  after the idle gap; a link's time is the mean of one put and one take.
- **CPU of a transfer** (`Link.cpu`): during the large probes, the CPU seconds of every
  thread of both processes (this one and the peer, or this one and redis-server; Linux
  `/proc/PID/task/*/schedstat`) over the wall seconds. Both ends work at once: 1.5 for the
  gRPC hop and the store here (1.2 at 1 KB), where the simulator had counted one core.
- **CPU of a step call** (`overheads.step_cpu`): the real `StepPump` drives
  `Settings.step_calls` Step calls on the peer, which answers with a reply shaped as a
  worker's (`probe_reply`); the CPU of both processes over the calls, per call (0.5 ms
  here). On a loopback host the simulator runs it beside each rank's step ([Note: step
  calls] in pipefb.sim.simulate).
- **oversubscribed cores** (`hosts[].oversubscribed`): `cores` processes, then twice as
  many, each running one `gpt` block's forward and backward (one torch thread) for
  `Settings.crowd_seconds`; the runs of the second over the first (0.87-0.94 here:
  [Note: oversubscribed cores] in pipefb.sim.simulate).
- **busy senders** (`overheads.busy_send`): 64 KiB probes whose sender then computes for
  `Settings.busy_seconds` (a 512-wide Linear's forward and backward, one torch thread)
  against probes whose sender waits; the echo peer stamps when each arrived, and the mean
  one-way difference is how much later a send followed by compute starts (0.3-0.9 ms
  here: [Note: busy senders] in pipefb.sim.simulate).
- **overheads**: `action` is the median gap between consecutive actions of a real
  `StageRuntime` step (clocks, span label, memory accounting); `step` is a unary RPC round
  trip to the peer's server plus what `run_step` spends outside its actions (flush, report).

[Note: idle links]
A transfer is slower when its link has been idle: the threads that carry it (the sender's
gRPC thread, the receiver's handler and compute threads, redis-server) were asleep, and
every part of the hop takes longer (measured here with per-part timestamps: enqueue,
encode, delivery and hand-off each 1.5-2.5x a back-to-back probe's). A 64 KiB one-way to
a waiting peer took 0.62-0.64 ms right after the last, 0.75 after 1 ms idle, 0.81-0.86
after 3 ms, 1.05-1.2 after 10 ms and 1.4-1.6 after 30 ms, with or without other processes
spinning on the cores; a 1 MiB stash put and taken 1.2 ms back to back, 2.0 after 2 ms
idle. Where the knee lies drifts with the machine's state: three rounds an hour later gave
1 KiB one way 0.38-0.46 ms back to back, 0.49-0.61 after 2 ms, 0.74-0.96 after 5 ms and
0.87-1.22 after 10 ms. A pipeline's links sit idle between its micro-batches (a stage's
forward or backward of one, 1-10 ms in the bench's runs; a whole step in a one-micro-batch
chain), and inside a 4-worker `mlp` run here hops to a waiting receiver took 0.85-0.9 ms,
where half a back-to-back round trip (the earlier probes: 0.33-0.47 ms) had put the
simulated steps of the bench's one-micro-batch runs 14-34% under the measured ones. So
every link probe leaves after `Settings.idle_gap` (5 ms, past the knee: 2 ms gave 0.38 and
0.70 ms of latency in two calibrations, 5 ms 0.55 and 0.88) and a gRPC probe is timed one
way, from the send to the peer's stamp.

The cache is YAML in the `Cluster.to_dict` form under a comment header, one file per host
in `$PIPEFB_CACHE_DIR` (default `~/.cache/pipefb/`); the links are reused for any worker
count. A cache whose header lacks this code's `probe version` was measured by older probes
and is measured again. Run
`python -m calibration.calibrate [--workers N] [--refresh] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import os
import platform
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import grpc
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.stepping import StepPump
from dataplane.inbox import Inbox
from dataplane.transport import SWITCH_INTERVAL_SECONDS, GrpcTransport, inbox_key, nbytes
from offload_store import OffloadStore, connect
from pipefb.errors import Aborted, ConfigError
from pipefb.memory import KINDS
from pipefb.processes import Process, project_env
from pipefb.schedule import Kind
from pipefb.sim.cluster import MAX_TRANSFER_CPU, MIN_OVERSUBSCRIBED, Cluster, Link, WorkerSpec
from protos import server, tensor_pb2, wire, worker_pb2, worker_pb2_grpc

JOB = "calibrate"  # job id of every probe transfer and stash key
HOST = "local"  # the one host of the local cluster
STORE_MAXMEMORY = "256mb"  # the probe Redis holds `STASH_DEPTH` stashes at a time
STASH_TENSORS = 16  # tensors of a probe stash: a stage's saved tensors, several per layer
STASH_LAYERS = 4  # layers a probe stash spreads them over
STASH_DEPTH = 2  # probe stashes in the store before the first is taken
PROBE_SPANS = 16  # actions of the probe's Step reply
PROBE_VERSION = 9  # bumped when a probe measures differently: older caches are re-measured
PROBE_TIMEOUT_S = 60.0  # a probe that does not come back within this has failed
MiB = 1 << 20
BUSY_WIDTH = 512  # features of the Linear a busy sender runs
BUSY_BATCH = 32  # its batch
STAMP = "stamp"  # a probe tensor the echo peer replaces with when the probe arrived


class CalibrationError(RuntimeError):
    """A probe that failed, or numbers no link can have (named in the message)."""


@dataclass(frozen=True)
class Settings:
    """Probe sizes and repeat counts (tests pass small ones)."""

    small_bytes: int = 1024  # tensor size of the latency probes
    large_bytes: int = 16 * MiB  # tensor size of the bandwidth probes
    small_repeats: int = 300  # latency probes per link (their mean counts)
    large_repeats: int = 20  # bandwidth probes per link
    warmup: int = 5  # probes of each size run first and not counted
    rpc_repeats: int = 100  # unary round trips for the step overhead
    step_calls: int = 300  # Step calls whose CPU (both ends) gives the step's CPU
    crowd_seconds: float = 3.0  # each run of the oversubscription probe
    busy_bytes: int = 64 * 1024  # tensor size of the busy-sender probes
    busy_repeats: int = 200  # busy-sender probes, and as many with an idle sender
    busy_seconds: float = 2e-3  # how long a busy sender computes after each send
    idle_gap: float = 5e-3  # how long a link sits idle before each probe ([Note: idle links])
    steps: int = 20  # runtime steps for the action and step overheads


@dataclass(frozen=True)
class Measured:
    """What one calibration found; a cluster of any size is built from it."""

    network: Link  # worker to worker, one way
    store: Link  # one stash or fetch of one worker
    action_overhead: float  # seconds per action outside its handler
    step_overhead: float  # seconds per step and worker outside its actions
    step_cpu: float = 0.0  # CPU seconds of one Step call, the coordinator's and worker's end
    oversubscribed: float = 1.0  # the cores' speed with twice as many busy threads
    busy_send: float = 0.0  # how much later a send followed by compute starts


# -- the gRPC probe -------------------------------------------------------------------------


class Receiver(worker_pb2_grpc.StageWorkerServicer):
    """A StageWorker whose `Activations` is the worker's delivery path without the job
    checks: each transfer goes into the inbox as soon as its last byte is decoded."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def Activations(self, request_iterator: Iterator[tensor_pb2.TensorChunk],
                    context: grpc.ServicerContext) -> tensor_pb2.Ack:
        total, count = 0, 0
        try:
            for transfer, tensors in wire.decode_transfers(request_iterator):
                self.inbox.put(inbox_key(transfer.kind, transfer.step, transfer.stage,
                                         transfer.microbatch), tensors)
                total, count = total + nbytes(tensors), count + len(tensors)
        except grpc.RpcError:
            if context.is_active():
                raise
            # the sender closed its channel without ending the stream: it is shutting down
        return tensor_pb2.Ack(bytes=total, tensors=count)

    def Step(self, request: worker_pb2.StepRequest, context: grpc.ServicerContext
             ) -> worker_pb2.StepReply:
        """A reply shaped as a worker's for a step of `PROBE_SPANS` actions."""
        return probe_reply(request.step)


def probe_reply(step: int) -> worker_pb2.StepReply:
    """A StepReply with every field a worker fills, for a step of `PROBE_SPANS` actions
    (four micro-batches' F, B and their transfers)."""
    now = time.time()
    kinds = {kind: 1 << 20 for kind in KINDS}
    return worker_pb2.StepReply(
        step=step, losses=[1.0] * 4, compute_seconds=0.01, idle_seconds=0.01,
        memory_bytes=kinds, peak_memory_bytes=1 << 22, bytes_sent=1 << 20,
        weight_version=step, action_seconds={str(k): 1e-3 for k in Kind},
        spans=[worker_pb2.ActionSpan(action=f"1F{i}", start=now, end=now + 1e-3)
               for i in range(PROBE_SPANS)],
        kept_versions=[step], kind_peak_bytes=kinds, activation_peak_bytes=1 << 20,
        layer_seconds={i: 1e-3 for i in range(4)})


def _serve(inbox: Inbox, address: str = "127.0.0.1:0") -> tuple[grpc.Server, str]:
    """Starts a Receiver, SERVING; returns it and the address it bound."""
    srv, port, health = server.create_server(
        lambda s: worker_pb2_grpc.add_StageWorkerServicer_to_server(Receiver(inbox), s),
        address)
    server.ready(health)
    return srv, f"{address.rsplit(':', 1)[0]}:{port}"


def _free_port() -> int:
    """A port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def echo(parent: str) -> None:
    """The peer process: sends every probe it receives back to `parent`, in step order,
    until SIGTERM."""
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)  # as a worker runs
    inbox = Inbox(timeout_seconds=PROBE_TIMEOUT_S * 10)

    def stop(signum: int, frame: FrameType | None) -> None:
        inbox.abort("stopped")

    signal.signal(signal.SIGTERM, stop)
    srv, address = _serve(inbox)
    transport = GrpcTransport(JOB, [parent], None, inbox)
    print(f"ready {address}", flush=True)
    step = 0
    try:
        while True:
            tensors = transport.recv(Kind.RECV_F, step, 0, 0)
            if STAMP in tensors:  # when it arrived, for one-way times (same clock)
                tensors[STAMP] = torch.tensor([time.time()], dtype=torch.float64)
            transport.send(Kind.RECV_F, 0, step, 0, 0, 0, tensors)
            step += 1
    except Aborted:
        pass
    finally:
        transport.close()
        srv.stop(0)


class _Pinger:
    """Round trips of one tensor to the echo peer through a real GrpcTransport."""

    def __init__(self, transport: GrpcTransport, peer: Process) -> None:
        self.transport, self.peer, self.step = transport, peer, 0

    def _echo(self) -> dict[str, torch.Tensor]:
        try:
            tensors = self.transport.recv(Kind.RECV_F, self.step, 0, 0)
        except Aborted as error:
            raise CalibrationError(f"no echo of probe {self.step}: {error}; peer log: "
                                   f"{self.peer.log_tail()}") from None
        self.step += 1
        return tensors

    def stamped(self, tensor: torch.Tensor, then: Callable[[], object]) -> float:
        """Seconds from `send` to the peer's receipt of `tensor` when this thread runs
        `then` right after the send."""
        sent = time.time()
        self.transport.send(Kind.RECV_F, 0, self.step, 0, 0, 0,
                            {"x": tensor, STAMP: torch.zeros(1, dtype=torch.float64)})
        then()
        return float(self._echo()[STAMP][0]) - sent

    def one_way(self, size: int, repeats: int, warmup: int, gap: float,
                meter: CpuMeter | None = None) -> list[float]:
        """One-way seconds of `repeats` probes of a `size`-byte tensor to the waiting
        peer (after `warmup` untimed), each sent after the stream sat idle `gap` seconds
        ([Note: idle links]); `meter` times the probes' round trips (not the gaps)."""
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32)
        times = []
        for _ in range(warmup + repeats):
            time.sleep(gap)
            with meter.span() if meter is not None else contextlib.nullcontext():
                times.append(self.stamped(tensor, _nothing))
        return times[warmup:]


def _nothing() -> None:
    """What an idle sender does after a send."""


class _Busy:
    """What a worker does between sends: a Linear's forward and backward, one thread."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.layer = torch.nn.Linear(BUSY_WIDTH, BUSY_WIDTH)
        self.x = torch.randn(BUSY_BATCH, BUSY_WIDTH)

    def __call__(self) -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                torch.relu(self.layer(self.x)).sum().backward()
        finally:
            torch.set_num_threads(saved)


def _busy_send(pinger: _Pinger, settings: Settings) -> float:
    """How much later a send followed by compute arrives: the mean one-way time of probes
    whose sender computes after each send less that of probes whose sender waits
    ([Note: busy senders] in pipefb.sim.simulate), at least 0."""
    tensor = torch.ones(max(1, settings.busy_bytes // 4), dtype=torch.float32)
    busy, idle = _Busy(settings.busy_seconds), _nothing
    for then in (idle, busy):  # warm both paths
        for _ in range(settings.warmup):
            pinger.stamped(tensor, then)
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2 * settings.busy_repeats):  # interleaved: drift hits both alike
        computes = k % 2 == 1
        times[computes].append(pinger.stamped(tensor, busy if computes else idle))
    return max(0.0, statistics.mean(times[True]) - statistics.mean(times[False]))


def _network(peer: Process, inbox: Inbox, settings: Settings) -> tuple[Link, float]:
    """The worker-to-worker link, from probes to the echo peer, and how much later a
    send followed by compute arrives."""
    transport = GrpcTransport(JOB, [peer.address], None, inbox)
    meter = CpuMeter([os.getpid(), peer.pid])
    try:
        pinger = _Pinger(transport, peer)
        small = pinger.one_way(settings.small_bytes, settings.small_repeats, settings.warmup,
                               settings.idle_gap)
        large = pinger.one_way(settings.large_bytes, settings.large_repeats, settings.warmup,
                               settings.idle_gap, meter)
        busy = _busy_send(pinger, settings)
        transport.flush()
    finally:
        transport.close()
    link = fit_probes("loopback gRPC", settings.small_bytes, small, settings.large_bytes,
                      large)
    return replace(link, cpu=meter.cores()), busy


def _step_cpu(address: str, calls: int, pids: Sequence[int]) -> float:
    """CPU seconds of one Step call as the coordinator makes it (`StepPump`, one rank) to
    the peer's `Step`, both processes together; 0 where /proc cannot tell."""
    meter = CpuMeter(pids)
    with server.channel(address) as channel:
        stub = worker_pb2_grpc.StageWorkerStub(channel)
        stub.Step(worker_pb2.StepRequest(job_id=JOB), timeout=PROBE_TIMEOUT_S)  # connects
        pump = StepPump(JOB, [stub], calls, lambda step, replies, seconds: None)
        with meter.span():
            failures = pump.run(lambda: None)
    if failures:
        raise CalibrationError(f"Step probe failed: {failures[0][1]}")
    return meter.cpu / calls if meter.readable else 0.0


def _rpc_round_trip(address: str, repeats: int) -> float:
    """Median seconds of a unary RPC (health Check) to a StageWorker-style server."""
    with server.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        times = []
        for _ in range(repeats + 1):  # the first call also connects
            started = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


# -- CPU of a transfer ----------------------------------------------------------------------


def _cpu_seconds(pids: Sequence[int]) -> float | None:
    """Seconds every thread of `pids` has run on a core (Linux `/proc/PID/task/*/schedstat`,
    nanoseconds); None where /proc cannot tell. A thread that ends meanwhile is skipped."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            return None
        for task in tasks:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def child_pids(pid: int) -> list[int]:
    """The children of process `pid` (the store's redis-server under `python -m
    offload_store`); none where /proc cannot tell."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


class CpuMeter:
    """CPU seconds of some processes (all their threads) against the wall seconds of the
    spans it times: how many cores a transfer keeps busy, both ends together."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids, self.cpu, self.wall, self.readable = list(pids), 0.0, 0.0, True

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Times the body."""
        cpu, wall = _cpu_seconds(self.pids), time.perf_counter()
        yield
        end_wall, end_cpu = time.perf_counter(), _cpu_seconds(self.pids)
        if cpu is None or end_cpu is None:
            self.readable = False
        else:
            self.cpu, self.wall = self.cpu + end_cpu - cpu, self.wall + end_wall - wall

    def cores(self) -> float:
        """Cores busy on average over the spans, within 1..MAX_TRANSFER_CPU (1 where the
        CPU could not be read)."""
        if not self.readable or self.wall <= 0:
            return 1.0
        return min(MAX_TRANSFER_CPU, max(1.0, self.cpu / self.wall))


# -- the store probe ------------------------------------------------------------------------


def _probe_stash(size: int) -> dict[int, dict[str, torch.Tensor]]:
    """A fresh stash of about `size` bytes: `STASH_TENSORS` float32 tensors over
    `STASH_LAYERS` layers."""
    numel = max(1, size // (4 * STASH_TENSORS))
    per_layer = STASH_TENSORS // STASH_LAYERS
    return {layer: {f"t{k}": torch.ones(numel) for k in range(per_layer)}
            for layer in range(STASH_LAYERS)}


def _store_round(store: OffloadStore, first_step: int, size: int, gap: float,
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


def _store_seconds(store: OffloadStore, size: int, repeats: int, warmup: int,
                   first_step: int, gap: float, meter: CpuMeter | None = None
                   ) -> list[float]:
    """Seconds of one stash or fetch of `size` bytes, in each of `repeats` rounds after
    `warmup` untimed (see `_store_round`)."""
    times = [_store_round(store, first_step + i * STASH_DEPTH, size, gap, meter)
             for i in range(warmup + repeats)]
    return times[warmup:]


def _store(address: str, settings: Settings, pids: Sequence[int] = ()) -> Link:
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


def fit_probes(what: str, small_bytes: int, small: Sequence[float], large_bytes: int,
               large: Sequence[float]) -> Link:
    """The link through the means of two sizes' probes (see the module docstring), or
    through their medians where a slow small probe put its mean above the large's.

    Raises:
        CalibrationError: the large probes were not slower, by medians either.
    """
    mean_small, mean_large = statistics.fmean(small), statistics.fmean(large)
    if mean_large > mean_small:
        return fit_link(what, small_bytes, mean_small, large_bytes, mean_large)
    return fit_link(what, small_bytes, statistics.median(small), large_bytes,
                    statistics.median(large))


def fit_link(what: str, small_bytes: int, small_s: float, large_bytes: int,
             large_s: float) -> Link:
    """The link through two (bytes, seconds) points: bandwidth from the slope, latency
    from the small point.

    Raises:
        CalibrationError: the large probe was not slower than the small one.
    """
    if not large_bytes > small_bytes or not large_s > small_s:
        raise CalibrationError(f"{what}: {large_bytes} bytes took {large_s:.6f} s, not more "
                               f"than {small_bytes} bytes ({small_s:.6f} s)")
    bandwidth = (large_bytes - small_bytes) / (large_s - small_s)
    return Link(bandwidth, max(0.0, small_s - small_bytes / bandwidth))


# -- the runtime's overheads ----------------------------------------------------------------


class _NoPeers:
    """The transport of a one-rank job that keeps every tensor: nothing to send."""

    def flush(self) -> int:
        """No sends, no bytes."""
        return 0


def _runtime_overheads(steps: int) -> tuple[float, float]:
    """(per action, per step) seconds a real StageRuntime spends outside its actions,
    running a one-rank gpipe step of a tiny mlp."""
    from pipefb.job.checks import check_job
    from pipefb.job.config import JobConfig
    from pipefb.plan.partition import balanced_plan
    from pipefb.runtime.stage import StageRuntime

    job = JobConfig(model="mlp", dataset="synthetic", loss="mse", schedule="gpipe", workers=1,
                    batch_size=4, microbatches=4, steps=steps, optimizer="sgd",
                    model_config={"in_features": 8, "hidden": 8, "depth": 2},
                    dataset_config={"in_features": 8})
    plan = balanced_plan("gpipe", 1, check_job(job), job.batch_size, job.microbatches)
    with torch.random.fork_rng(devices=[]):  # the runtime seeds torch's global generator
        runtime = StageRuntime(job, plan, 0, _NoPeers())  # type: ignore[arg-type]
        gaps, rest = [], []
        for step in range(steps):
            started = time.time()  # the clock of the runtime's spans
            spans = runtime.run_step(step).spans
            ended = time.time()
            gaps += [b[1] - a[2] for a, b in itertools.pairwise(spans)]
            rest.append(ended - started - (spans[-1][2] - spans[0][1]))
    action = max(0.0, statistics.median(gaps))
    return action, max(0.0, statistics.median(rest) - action)  # the last action's gap


# -- oversubscribed cores ---------------------------------------------------------------------


def _crowd_runs(processes: int, seconds: float) -> int:
    """Runs `processes` busy processes (`calibration.crowd`) at once for `seconds`;
    their runs, summed."""
    command = [sys.executable, "-m", "calibration.crowd", str(seconds)]
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=project_env()) for _ in range(processes)]
    try:
        for child in children:
            _expect_line(child, "ready".__eq__)
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        return sum(int(_expect_line(child, str.isdigit)) for child in children)
    finally:
        for child in children:
            child.kill()
            child.wait()


def _expect_line(child: subprocess.Popen[str], valid: Callable[[str], bool]) -> str:
    """The child's next stdout line, if `valid` and within `PROBE_TIMEOUT_S`;
    CalibrationError otherwise."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], PROBE_TIMEOUT_S)
    if not ready:
        raise CalibrationError(f"oversubscription probe process said nothing in "
                               f"{PROBE_TIMEOUT_S:.0f} s")
    line = child.stdout.readline().strip()
    if not valid(line):
        raise CalibrationError(f"oversubscription probe process said {line!r}")
    return line


def _oversubscribed(cores: int, seconds: float) -> float:
    """The cores' speed with twice as many busy processes as cores, relative to one per
    core ([Note: oversubscribed cores] in pipefb.sim.simulate), within MIN_OVERSUBSCRIBED..1."""
    one_each = _crowd_runs(cores, seconds)
    twice = _crowd_runs(2 * cores, seconds)
    if not one_each:
        raise CalibrationError("the oversubscription probe ran nothing")
    return min(1.0, max(MIN_OVERSUBSCRIBED, twice / one_each))


# -- putting it together --------------------------------------------------------------------


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    """Runs the body with the workers' GIL switch interval, then restores it."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


@contextlib.contextmanager
def _helpers(inbox: Inbox) -> Iterator[tuple[Process, Process]]:
    """Starts the probe Redis and the echo peer (in parallel) and this side's Receiver;
    stops all three on exit.

    The children are forked before this process serves gRPC (gRPC warns about a fork
    while its threads run), so the Receiver's port is picked first and bound after.
    """
    env = project_env()
    address = f"127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="pipefb-calibrate-") as logs, \
            contextlib.ExitStack() as stack:
        children = [Process("redis", ["-m", "offload_store", "--port", "0", "--maxmemory",
                                      STORE_MAXMEMORY], Path(logs), env),
                    Process("peer", ["-m", "calibration.cluster", "--echo-to", address],
                            Path(logs), env)]
        stack.callback(_stop_all, children)
        srv = _serve(inbox, address)[0]
        stack.callback(srv.stop, 0)
        for child in children:
            child.wait_ready()
        yield children[0], children[1]


def _stop_all(children: list[Process]) -> None:
    """Signals every child first, then waits for each (they exit in parallel)."""
    for child in children:
        if child.popen.poll() is None:
            child.popen.terminate()
    for child in children:
        child.stop()


def measure(settings: Settings = Settings()) -> Measured:
    """Measures the links and overheads of this machine (a few seconds).

    Raises:
        CalibrationError: a probe failed or gave impossible numbers.
        RuntimeError: the Redis or the peer process did not start.
    """
    inbox = Inbox(timeout_seconds=PROBE_TIMEOUT_S)
    with _switch_interval(SWITCH_INTERVAL_SECONDS), _helpers(inbox) as (redis_proc, peer):
        network, busy_send = _network(peer, inbox, settings)
        rpc = _rpc_round_trip(peer.address, settings.rpc_repeats)
        step_cpu = _step_cpu(peer.address, settings.step_calls, [os.getpid(), peer.pid])
        store = _store(redis_proc.address, settings, child_pids(redis_proc.pid))
        action, step = _runtime_overheads(settings.steps)
    oversubscribed = _oversubscribed(os.cpu_count() or 1, settings.crowd_seconds)
    return Measured(network, store, action, rpc + step, step_cpu, oversubscribed, busy_send)


def measure_links(settings: Settings = Settings()) -> tuple[Link, Link]:
    """The worker-to-worker link and the offload-store link of this machine.

    Args:
        settings: probe sizes and repeat counts.

    Returns:
        (network, store), measured with the real gRPC stream path and a real Redis.

    Raises:
        CalibrationError: a probe failed or gave impossible numbers.
    """
    measured = measure(settings)
    return measured.network, measured.store


def build_cluster(workers: int, measured: Measured) -> Cluster:
    """`workers` workers w0..w{n-1} on one loopback host with this machine's cores and
    links: transfers and store traffic are CPU work there, as on this machine."""
    if workers < 1:
        raise ConfigError(f"a cluster needs at least one worker, got {workers}")
    return Cluster(tuple(WorkerSpec(f"w{i}", host=HOST) for i in range(workers)),
                   network=measured.network, store=measured.store,
                   host_cores={HOST: os.cpu_count() or 1}, loopback_hosts=frozenset({HOST}),
                   action_overhead=measured.action_overhead,
                   step_overhead=measured.step_overhead, step_cpu=measured.step_cpu,
                   host_oversubscribed={HOST: measured.oversubscribed},
                   busy_send=measured.busy_send)


# -- the cache ------------------------------------------------------------------------------


def cache_path(cache_dir: Path | None = None) -> Path:
    """The cache file of this host: `cluster-HOSTNAME.yaml` in `cache_dir`, else in
    `$PIPEFB_CACHE_DIR`, else in `~/.cache/pipefb/`."""
    folder = cache_dir or Path(os.environ.get("PIPEFB_CACHE_DIR")
                               or Path.home() / ".cache" / "pipefb")
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return folder / f"cluster-{host}.yaml"


def header() -> str:
    """Comment lines saying when, where and with what a calibration was made."""
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return (f"# pipefb local cluster, measured {when} on {socket.gethostname()}\n"
            f"# python {platform.python_version()}, torch {torch.__version__}, "
            f"grpc {grpc.__version__}, probe version {PROBE_VERSION}\n"
            f"# re-measure: python -m calibration.calibrate --refresh\n")


def render(cluster: Cluster, head: str) -> str:
    """The YAML text of a cluster under its comment header."""
    return head + str(yaml.safe_dump(cluster.to_dict(), sort_keys=False))


def read_cache(path: Path) -> tuple[Measured, str]:
    """The measurements and header of a cache file.

    Raises:
        ConfigError: unreadable, not YAML, or not a complete cluster description.
    """
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        first = (str(error).splitlines() or [""])[0]
        raise ConfigError(f"{type(error).__name__}: {first}") from None
    missing = {"network", "store", "overheads"} - set(data if isinstance(data, dict) else ())
    if missing:
        raise ConfigError(f"missing {sorted(missing)}")
    try:
        cluster = Cluster.from_dict(data, str(path))
    except TypeError as error:  # e.g. keys of mixed types that cannot be sorted
        raise ConfigError(f"TypeError: {error}") from None
    head = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    return Measured(cluster.network, cluster.store, cluster.action_overhead,
                    cluster.step_overhead, cluster.step_cpu,
                    cluster.oversubscribed_of(HOST), cluster.busy_send), head


def write_cache(path: Path, text: str) -> None:
    """Writes the cache file atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def calibrated(workers: int, *, cache_dir: Path | None = None, refresh: bool = False,
               settings: Settings = Settings()) -> tuple[Cluster, str]:
    """`local_cluster` with the header of its measurement (for printing)."""
    if workers < 1:
        raise ConfigError(f"a cluster needs at least one worker, got {workers}")
    path = cache_path(cache_dir)
    if not refresh and path.exists():
        try:
            measured, head = read_cache(path)
            if f"probe version {PROBE_VERSION}\n" in head:
                return build_cluster(workers, measured), head
            print(f"cached cluster {path} was measured by older probes; measuring again",
                  file=sys.stderr)
        except ConfigError as error:
            print(f"warning: cached cluster {path} is unusable ({error}); measuring again",
                  file=sys.stderr)
    print(f"measuring loopback gRPC and Redis once; cached in {path}", file=sys.stderr)
    cluster, head = build_cluster(workers, measure(settings)), header()
    write_cache(path, render(cluster, head))
    return cluster, head


def local_cluster(workers: int, *, cache_dir: Path | None = None, refresh: bool = False,
                  settings: Settings = Settings()) -> Cluster:
    """The cluster `pipefb local` runs on: measured once per host, then read from the cache.

    Args:
        workers: worker count; workers w0..w{n-1} share host "local" (`os.cpu_count()`
            cores), speed 1.0, no memory cap.
        cache_dir: where the cache file lives (default `$PIPEFB_CACHE_DIR`, else
            `~/.cache/pipefb/`).
        refresh: measure again even if the cache is good.
        settings: probe sizes and repeat counts of a measurement.

    Returns:
        The cluster with the measured network, store and overheads.

    Raises:
        CalibrationError: a measurement failed (a corrupt cache is re-measured instead).
        ConfigError: `workers` < 1.
    """
    return calibrated(workers, cache_dir=cache_dir, refresh=refresh, settings=settings)[0]


def main(argv: list[str] | None = None) -> int:
    """`python -m calibration.calibrate`: prints (or writes) the local cluster's YAML."""
    p = argparse.ArgumentParser(prog="python -m calibration.calibrate",
                                description="Measure this machine once; print its cluster YAML.")
    p.add_argument("--workers", type=int, default=1, help="workers of the cluster (default 1)")
    p.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    p.add_argument("--out", type=Path, help="write the YAML here instead of stdout")
    p.add_argument("--echo-to", help="internal: be the gRPC probe's peer of this address")
    args = p.parse_args(argv)
    if args.echo_to:
        echo(args.echo_to)
        return 0
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be >= 1")
    cluster, head = calibrated(args.workers, refresh=args.refresh)
    text = render(cluster, head)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
