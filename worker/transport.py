"""The runtime's Transport over gRPC streams to peer workers and the Redis offload store."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import grpc
import torch

from offload_store import OffloadStore
from pipefb.errors import WorkerFailed
from pipefb.schedule import Kind
from pipefb.transport import LayerTensors, Tensors
from protos import server, tensor_pb2, wire, worker_pb2_grpc
from worker.inbox import Inbox

SEND_TIMEOUT_SECONDS = 300.0  # a peer that takes longer to accept a stream has failed


def inbox_key(kind: str, step: int, stage: int, microbatch: int) -> tuple[str, int, int, int]:
    """Key under which a received transfer waits for its receive action."""
    return (kind, step, stage, microbatch)


def weight_key(version: int, name: str) -> tuple[str, int, str]:
    """Key under which one pushed weight tensor waits for RECV_W."""
    return ("RECV_W", version, name)


class GrpcTransport:
    """Sends with non-blocking gRPC stream futures; receives through the worker's inbox."""

    def __init__(self, job_id: str, peers: Sequence[str], store: OffloadStore | None,
                 inbox: Inbox) -> None:
        self.job_id, self.peers, self.store, self.inbox = job_id, list(peers), store, inbox
        self._stubs: dict[int, worker_pb2_grpc.StageWorkerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._pending: list[tuple[int, grpc.Future]] = []
        self._sent = 0
        self._lock = threading.Lock()

    def _stub(self, rank: int) -> worker_pb2_grpc.StageWorkerStub:
        if rank not in self._stubs:
            ch = server.channel(self.peers[rank])
            self._channels.append(ch)
            self._stubs[rank] = worker_pb2_grpc.StageWorkerStub(ch)
        return self._stubs[rank]

    def _start(self, rank: int, method: str, transfer: tensor_pb2.Transfer,
               tensors: Tensors) -> None:
        call = getattr(self._stub(rank), method)
        future = call.future(wire.encode_stream(transfer, tensors), timeout=SEND_TIMEOUT_SECONDS)
        with self._lock:
            self._pending.append((rank, future))
            self._sent += nbytes(tensors)

    def send(self, kind: Kind, rank: int, step: int, stage: int, microbatch: int, version: int,
             tensors: Tensors) -> None:
        """Streams tensors to peer `rank` (Activations for RECV_F/RECV_L, else Gradients)."""
        transfer = tensor_pb2.Transfer(job_id=self.job_id, step=step, microbatch=microbatch,
                                       stage=stage, version=version, kind=str(kind))
        method = "Gradients" if kind == Kind.RECV_B else "Activations"
        self._start(rank, method, transfer, tensors)

    def recv(self, kind: Kind, step: int, stage: int, microbatch: int) -> Tensors:
        """Waits in the inbox for the matching transfer."""
        return self.inbox.take(inbox_key(str(kind), step, stage, microbatch))

    def stash(self, step: int, microbatch: int, version: int, tensors: LayerTensors) -> int:
        """Puts saved tensors into the offload store (pipelined, with backpressure)."""
        return self._store().put(step, microbatch, version, tensors)

    def fetch(self, step: int, microbatch: int, version: int,
              names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes saved tensors from the offload store (delete on consume)."""
        return self._store().take(step, microbatch, version, names)

    def push_weights(self, rank: int, version: int, tensors: Tensors) -> None:
        """Streams a weight version of some layers to forward peer `rank`."""
        transfer = tensor_pb2.Transfer(job_id=self.job_id, step=version, microbatch=-1,
                                       stage=0, version=version, kind=str(Kind.RECV_W))
        self._start(rank, "Weights", transfer, tensors)

    def wait_weights(self, version: int, names: Sequence[str]) -> Tensors:
        """Waits until every named tensor of weight version `version` arrived."""
        return {name: self.inbox.take(weight_key(version, name))[name] for name in names}

    def flush(self) -> int:
        """Waits for every stream started this step; a failed peer raises WorkerFailed."""
        with self._lock:
            pending, self._pending = self._pending, []
            sent, self._sent = self._sent, 0
        for rank, future in pending:
            try:
                future.result()
            except grpc.RpcError as error:
                raise WorkerFailed(
                    f"rank {rank} at {self.peers[rank]} failed to receive: "
                    f"{error.code().name} {error.details()}"
                ) from None
        return sent

    def _store(self) -> OffloadStore:
        if self.store is None:
            raise WorkerFailed("this rank has no offload store address")
        return self.store

    def close(self) -> None:
        """Cancels outstanding sends and closes peer channels."""
        for _, future in self._pending:
            future.cancel()
        for ch in self._channels:
            ch.close()


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Data bytes of a set of tensors."""
    return sum(t.nelement() * t.element_size() for t in tensors.values())
