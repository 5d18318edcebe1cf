"""The runtime's Transport over gRPC streams to peer workers and the offload store."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from dataplane.inbox import Inbox
from dataplane.localhop import HopSender
from offload_store import StashStore
from offload_store.local import LocalTier
from offload_store.staging import Arrival, HostStaging
from offload_store.writer import StashWriter, stash_nbytes
from pipefb.errors import Aborted, WorkerFailed
from pipefb.runtime.transport import LayerTensors, Tensors
from pipefb.schedule import Kind
from protos import server, tensor_pb2, wire, worker_pb2_grpc

SEND_TIMEOUT_SECONDS = 300.0  # a peer that takes no data for this long has failed
POLL_SECONDS = 0.1  # how often a prefetch waiting for a transfer looks whether it should stop


def inbox_key(kind: str, step: int, stage: int, microbatch: int) -> tuple[str, int, int, int]:
    """Key under which a received transfer waits for its receive action."""
    return (kind, step, stage, microbatch)


def weight_key(version: int, name: str) -> tuple[str, int, str]:
    """Key under which one pushed weight tensor waits for RECV_W."""
    return ("RECV_W", version, name)


# The interpreter's thread switch interval in a process that streams tensors: short, so
# that gRPC's I/O threads get the GIL soon after a compute op releases it.
SWITCH_INTERVAL_SECONDS = 0.0005


class PeerStream:
    """One long-lived client stream to a peer's RPC that carries every transfer of a job.

    A call per transfer would pay gRPC's call set-up every time; the open stream pays it
    once per job (bench numbers in docs/benchmarks.md). Transfers keep their order.

    [Note: send buffers] gRPC's sending thread encodes each transfer's tensors when it
    takes them, so the caller must not modify a sent tensor until `drain` returns; the
    runtime guarantees it by flushing at the end of every step.
    """

    def __init__(self, call: grpc.StreamUnaryMultiCallable, peer: str) -> None:
        self.peer = peer
        self._queue: queue.SimpleQueue[Iterator[tensor_pb2.TensorChunk] | None] = (
            queue.SimpleQueue())
        self._cond = threading.Condition()
        self._queued = self._taken = 0
        self.future = call.future(self._messages())
        self.future.add_done_callback(lambda _: self._notify())

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _messages(self) -> Iterator[tensor_pb2.TensorChunk]:
        while (item := self._queue.get()) is not None:
            yield from item
            with self._cond:
                self._taken += 1
                self._cond.notify_all()

    def put(self, messages: Iterator[tensor_pb2.TensorChunk]) -> None:
        """Queues one transfer's messages."""
        with self._cond:
            self._queued += 1
        self._queue.put(messages)

    def drain(self, timeout: float) -> None:
        """Waits until gRPC took every queued transfer.

        Raises:
            WorkerFailed: the stream ended (the peer failed or refused a transfer) or the
                peer did not take the data within `timeout`.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: self._taken == self._queued or self.future.done(),
                                     timeout)
        if self.future.done():
            error = self.future.exception()
            detail = (f"{error.code().name} {error.details()}" if isinstance(error, grpc.RpcError)
                      else "stream closed")
            raise WorkerFailed(f"{self.peer} failed to receive: {detail}")
        if not ok:
            raise WorkerFailed(f"{self.peer} took no data for {timeout:.0f} s")

    def close(self) -> None:
        """Ends the stream after the queued transfers."""
        self._queue.put(None)


class GrpcTransport:
    """Sends to a peer on this host over its hop socket ([Note: local hops] in
    dataplane/localhop.py), to any other over one PeerStream per (peer, RPC); receives
    through the worker's inbox."""

    def __init__(self, job_id: str, peers: Sequence[str], store: StashStore | None,
                 inbox: Inbox, attempt: int = 0) -> None:
        self.job_id, self.peers, self.store, self.inbox = job_id, list(peers), store, inbox
        self.attempt = attempt  # stamped on every transfer; peers on another attempt refuse it
        self._stubs: dict[int, worker_pb2_grpc.StageWorkerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._streams: dict[tuple[int, str], PeerStream] = {}
        self._hops: dict[int, HopSender | None] = {}  # None: the peer is reached over gRPC
        self.local_hops = True  # whether peers on this host are sent to over hop sockets
        self._sent = 0
        self._lock = threading.Lock()
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefetched: dict[tuple[int, int], Future[tuple[LayerTensors,
                                                             Arrival | None]]] = {}
        self._closing = threading.Event()
        # stashes this rank takes back itself stay in its memory ([Note: local tier])
        self.local: LocalTier | None = None
        # stashes go to the store on an I/O thread ([Note: background stash]); None: on
        # the compute thread
        self.writer: StashWriter | None = None
        # a forward rank's transfers leave after its earlier stashes are in the store, so
        # the backward rank that receives them finds those stashes there
        self.fence_sends = False
        # FETCH's stash is taken ahead on a thread (`prefetch`); False: on the compute
        # thread ([Note: copies on the compute thread] in offload_store/writer.py)
        self.prefetches = True
        self.staging: HostStaging | None = None  # CUDA: host <-> device copies of stashes

    def _stub(self, rank: int) -> worker_pb2_grpc.StageWorkerStub:
        if rank not in self._stubs:
            ch = server.channel(self.peers[rank])
            self._channels.append(ch)
            self._stubs[rank] = worker_pb2_grpc.StageWorkerStub(ch)
        return self._stubs[rank]

    def _check_open(self) -> None:
        """After Drain the step must stop at its next send, stash or fetch."""
        if self.inbox.aborted is not None:
            raise Aborted(self.inbox.aborted)

    def _start(self, rank: int, method: str, transfer: tensor_pb2.Transfer,
               tensors: Tensors) -> None:
        self._check_open()
        hop, fence = self._hop(rank), self._fence()
        if hop is not None:
            hop.send(transfer, tensors, after=fence)
            with self._lock:
                self._sent += nbytes(tensors)
            return
        with self._lock:
            stream = self._streams.get((rank, method))
            if stream is None:
                stream = PeerStream(getattr(self._stub(rank), method),
                                    f"rank {rank} at {self.peers[rank]}")
                self._streams[(rank, method)] = stream
            self._sent += nbytes(tensors)
        messages = wire.encode_stream(transfer, tensors)
        if fence is not None:
            messages = _after(fence, messages)
        stream.put(messages)

    def _fence(self) -> Callable[[], None] | None:
        """What a fenced rank's transfer waits for, on the thread that sends it: the
        writes of the stashes handed over before it (None: nothing left to wait for)."""
        writer = self.writer
        if not self.fence_sends or writer is None or writer.is_written(writer.ticket):
            return None
        return functools.partial(writer.wait_written, writer.ticket)

    def _hop(self, rank: int) -> HopSender | None:
        """The hop connection to `rank`, opened on the first send; None where the peer is
        not on this host or has no hop socket."""
        if not self.local_hops:
            return None
        with self._lock:
            if rank not in self._hops:
                self._hops[rank] = HopSender.connect(self.peers[rank],
                                                     f"rank {rank} at {self.peers[rank]}",
                                                     SEND_TIMEOUT_SECONDS)
            return self._hops[rank]

    def send(self, kind: Kind, rank: int, step: int, stage: int, microbatch: int, version: int,
             tensors: Tensors) -> None:
        """Streams tensors to peer `rank` (Activations for RECV_F/RECV_L, else Gradients)."""
        transfer = tensor_pb2.Transfer(job_id=self.job_id, step=step, microbatch=microbatch,
                                       stage=stage, version=version, kind=str(kind),
                                       attempt=self.attempt)
        method = "Gradients" if kind == Kind.RECV_B else "Activations"
        self._start(rank, method, transfer, tensors)

    def recv(self, kind: Kind, step: int, stage: int, microbatch: int) -> Tensors:
        """Waits in the inbox for the matching transfer."""
        return self.inbox.take(inbox_key(str(kind), step, stage, microbatch))

    def stash(self, step: int, microbatch: int, version: int, tensors: LayerTensors) -> int:
        """Keeps saved tensors in the local tier when this rank takes them back itself and
        they fit, else puts them into the offload store (pipelined, with backpressure)."""
        self._check_open()
        if self.local is not None:
            kept = self.local.put(step, microbatch, tensors)
            if kept is not None:
                return kept
        if self.writer is not None:
            self.writer.put(step, microbatch, version, tensors)  # waits for room only
            return stash_nbytes(tensors)
        return self._store().put(step, microbatch, version, tensors)

    def fetch(self, step: int, microbatch: int, version: int,
              names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes saved tensors from the offload store (delete on consume), or the result of
        the `prefetch` of the same micro-batch, or this rank's own stash still waiting for
        its write ([Note: background stash])."""
        self._check_open()
        if self.local is not None:
            kept = self.local.take(step, microbatch, names)
            if kept is not None:
                return kept
        if self.writer is not None:
            queued = self.writer.take_pending(step, microbatch)
            if queued is not None:
                return {i: {n: queued[i][n] for n in names[i]} for i in names}
        pending = self._prefetched.pop((step, microbatch), None)
        if pending is not None:
            got, arrival = pending.result()
            return arrival.wait(got) if arrival is not None else got
        return self._store().take(step, microbatch, version, names)

    def prefetch(self, step: int, microbatch: int, version: int,
                 names: Mapping[int, Sequence[str]],
                 after: tuple[Kind, int, int, int] | None = None) -> None:
        """Tells the store, then starts taking saved tensors on a background thread, once
        the transfer `after` names arrived (see `fetch`); on CUDA the thread also starts
        their copy to the device ([Note: staging])."""
        self._check_open()
        if not self.prefetches or (step, microbatch) in self._prefetched or (
                self.local is not None and self.local.holds(step, microbatch)):
            return
        if self.store is not None:  # without one, the fetch raises WorkerFailed
            self.store.prefetch(step, microbatch, version, names)
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        wait = None if after is None else inbox_key(str(after[0]), *after[1:])
        self._prefetched[(step, microbatch)] = self._prefetcher.submit(
            self._take_when, wait, step, microbatch, version, names)

    def _take_when(self, wait: tuple[str, int, int, int] | None, step: int, microbatch: int,
                   version: int, names: Mapping[int, Sequence[str]]
                   ) -> tuple[LayerTensors, Arrival | None]:
        """A prefetch on its thread: waits for the transfer `wait` names, then takes the
        stash (this rank's own one still queued for its write: from the queue)."""
        while wait is not None and not self.inbox.arrived(wait, POLL_SECONDS):
            if self._closing.is_set():
                raise Aborted("the transport closed")
        got = self.writer.take_pending(step, microbatch) if self.writer is not None else None
        if got is None:
            got = self._store().take(step, microbatch, version, names)
        if self.staging is None:
            return got, None
        return self.staging.to_device(got)

    def push_weights(self, rank: int, version: int, tensors: Tensors) -> None:
        """Streams a weight version of some layers to forward peer `rank`."""
        transfer = tensor_pb2.Transfer(job_id=self.job_id, step=version, microbatch=-1,
                                       stage=0, version=version, kind=str(Kind.RECV_W),
                                       attempt=self.attempt)
        self._start(rank, "Weights", transfer, tensors)

    def wait_weights(self, version: int, names: Sequence[str]) -> Tensors:
        """Waits until every named tensor of weight version `version` arrived."""
        return {name: self.inbox.take(weight_key(version, name))[name] for name in names}

    def held_bytes(self) -> int:
        """Bytes of stashes this rank holds in its own memory (the local tier)."""
        return self.local.held_bytes if self.local is not None else 0

    def in_flight_bytes(self) -> int:
        """Bytes of stashes handed to the writer and not yet in the store."""
        return self.writer.in_flight_bytes if self.writer is not None else 0

    def flush(self) -> int:
        """Waits until every stash of this step is written (raising the first failed
        write's error) and every transfer left; a failed peer raises WorkerFailed."""
        if self.writer is not None:
            self.writer.drain()
        with self._lock:
            streams = list(self._streams.values())
            sent, self._sent = self._sent, 0
        for stream in streams:
            stream.drain(SEND_TIMEOUT_SECONDS)
        with self._lock:
            hops = [hop for hop in self._hops.values() if hop is not None]
        for hop in hops:
            hop.check()
        return sent

    def _store(self) -> StashStore:
        if self.store is None:
            raise WorkerFailed("this rank has no offload store address")
        return self.store

    def close(self) -> None:
        """Ends every peer stream and closes the channels."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            hops = [hop for hop in self._hops.values() if hop is not None]
        for stream in streams:
            stream.close()
        for hop in hops:
            hop.close()
        for ch in self._channels:
            ch.close()
        self._closing.set()
        if self.writer is not None:
            self.writer.close()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if self.local is not None:
            self.local.clear()
        if self.store is not None:
            self.store.close()


def _after(wait: Callable[[], None], messages: Iterator[tensor_pb2.TensorChunk]
           ) -> Iterator[tensor_pb2.TensorChunk]:
    """A transfer's messages, held back on gRPC's sending thread until `wait` returns."""
    wait()
    yield from messages


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Data bytes of a set of tensors."""
    return sum(t.nelement() * t.element_size() for t in tensors.values())
