"""The worker-to-worker link probe: an echo peer over the workers' own gRPC data plane,
one-way probe times, and how much later a send followed by compute arrives.

- **network**: this process and a peer process (`python -m calibration --echo-to
  ADDRESS`, `echo`) each receive as a worker does, on a StageWorker `Activations` stream
  that decodes with `protos.wire.decode_transfers` and on a hop socket
  (`dataplane.localhop`), both into a `dataplane.inbox.Inbox`, and send with
  `dataplane.grpc_transport.GrpcTransport.send`: over the hop socket, as workers on one
  host do ([Note: local hops] in dataplane/localhop.py). A
  tensor goes to the peer, whose receive loop takes it from its inbox, stamps when it did
  and sends it back: a delivery is send call to the peer's `recv` return, one way. Small
  tensors give the latency, large ones the bandwidth (`calibration.fit`); the CPU of both
  processes during the large probes gives the link's `cpu` (`calibration.cpu`).
- **busy senders** (`overheads.busy_send`): probes whose sender then computes for
  `Settings.busy_seconds` (a Linear's forward and backward, one torch thread) against
  probes whose sender waits; the echo peer stamps when each arrived, and the mean one-way
  difference is how much later a send followed by compute starts ([Note: busy senders]
  in pipefb.sim.engine).

[Note: idle links]
A transfer is slower when its link has been idle: the threads that carry it (the sender's
gRPC thread, the receiver's handler and compute threads, redis-server) were asleep, and
every part of the hop (enqueue, encode, delivery, hand-off) takes longer than it does back
to back. The slowdown grows with the idle time up to a knee and then levels off; where the
knee lies drifts with the machine's state. A pipeline's links sit idle between its
micro-batches (a stage's forward or backward of one; a whole step in a one-micro-batch
chain), so back-to-back probes, or half a round trip, would give a latency a pipeline's
hops do not see and put the simulated steps under the measured ones. So every link probe,
gRPC or store, leaves after the link sat idle `Settings.idle_gap` (past the knee), and a
gRPC probe is timed one way, from the send to the peer's stamp.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import FrameType

import grpc
import torch

from calibration.cpu import CpuMeter
from calibration.fit import fit_probes
from calibration.settings import JOB, PROBE_TIMEOUT_S, CalibrationError, Settings
from dataplane.grpc_transport import SWITCH_INTERVAL_SECONDS, GrpcTransport, inbox_key, nbytes
from dataplane.inbox import Inbox
from dataplane.localhop import HopListener
from pipefb import codec
from pipefb.errors import Aborted
from pipefb.memory import KINDS
from pipefb.processes import Process
from pipefb.schedule import Kind
from pipefb.sim.cluster import Link
from protos import server, tensor_pb2, wire, worker_pb2, worker_pb2_grpc

PROBE_SPANS = 16  # actions of the probe's Step reply
BUSY_WIDTH = 512  # features of the Linear a busy sender runs
BUSY_BATCH = 32  # its batch
STAMP = "stamp"  # a probe tensor the echo peer replaces with when the probe arrived


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


def serve(inbox: Inbox, address: str = "127.0.0.1:0") -> tuple[grpc.Server, str]:
    """Starts a Receiver, SERVING; returns it and the address it bound."""
    srv, port, health = server.create_server(
        lambda s: worker_pb2_grpc.add_StageWorkerServicer_to_server(Receiver(inbox), s),
        address)
    server.ready(health)
    return srv, f"{address.rsplit(':', 1)[0]}:{port}"


def serve_hops(inbox: Inbox, address: str) -> HopListener:
    """A hop socket beside the Receiver serving `address`, delivering into `inbox`."""
    return HopListener.serve(
        int(address.rsplit(":", 1)[1]),
        lambda t, tensors: inbox.put(inbox_key(t.kind, t.step, t.stage, t.microbatch), tensors),
        lambda: codec.DEFAULT_MAX_BYTES)


def free_port() -> int:
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
        # on another thread: the handler runs on the main thread, which may hold the
        # inbox's lock inside `recv` at that moment (see pipefb.processes.StopSignal)
        threading.Thread(target=inbox.abort, args=("stopped",), daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    srv, address = serve(inbox)
    hops = serve_hops(inbox, address)
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
        hops.close()
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
    ([Note: busy senders] in pipefb.sim.engine), at least 0."""
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


def network(peer: Process, inbox: Inbox, settings: Settings) -> tuple[Link, float]:
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
    link = fit_probes("loopback hop socket", settings.small_bytes, small, settings.large_bytes,
                      large)
    return replace(link, cpu=meter.cores()), busy
