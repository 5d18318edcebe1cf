"""A job's ranks over gRPC: their stubs, calls to all at once, and which of them died."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.jobs import Job
from coordinator.registry import Registry, WorkerRecord
from pipefb.errors import WorkerFailed
from protos import server, worker_pb2, worker_pb2_grpc

DRAIN_TIMEOUT_SECONDS = 30.0  # a worker's Drain waits up to 10 s for its running step


@dataclass
class Ranks:
    """Stubs of a job's ranks, by rank."""

    workers: list[WorkerRecord]
    stubs: list[worker_pb2_grpc.StageWorkerStub]
    channels: list[grpc.Channel]
    closed: bool = False  # a restart or a move closed them: nothing to drain through them

    @classmethod
    def connect(cls, workers: list[WorkerRecord]) -> Ranks:
        """Opens a channel to every rank."""
        channels = [server.channel(w.address) for w in workers]
        return cls(workers, [worker_pb2_grpc.StageWorkerStub(c) for c in channels], channels)

    def describe(self, rank: int) -> str:
        """Names a rank's worker for error messages."""
        w = self.workers[rank]
        return f"worker {w.worker_id} ({w.name}, {w.address}, rank {rank})"

    def close(self) -> None:
        """Closes every channel (once; later calls do nothing)."""
        for c in self.channels:
            c.close()
        self.channels = []
        self.closed = True


def wait_all(calls: list[grpc.Future], ranks: Ranks) -> list[Any]:
    """Waits for one call per rank; any failure becomes the job's error."""
    done = threading.Event()
    remaining = [len(calls)]
    lock = threading.Lock()

    def finished(_: grpc.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0 or _.exception() is not None:
                done.set()

    for call in calls:
        call.add_done_callback(finished)
    done.wait()
    failures = [(r, c.exception()) for r, c in enumerate(calls)
                if c.done() and c.exception() is not None]
    if failures:
        raise first_failure(failures, ranks)
    return [c.result() for c in calls]


def first_failure(failures: list[tuple[int, Any]], ranks: Ranks) -> WorkerFailed:
    """The root cause among failed calls: a rank that aborted was only waiting on another."""
    rank, error = sorted(failures, key=lambda f: f[1].code() == grpc.StatusCode.ABORTED)[0]
    return WorkerFailed(f"{ranks.describe(rank)} failed: {error.code().name}: {error.details()}")


def drain(job: Job, ranks: Ranks, skip: Iterable[int] = (), reason: str = "") -> None:
    """Drains every rank at once but those in `skip` (dead: nothing to drain)."""
    request = worker_pb2.DrainRequest(job_id=job.job_id, reason=reason or job.state,
                                      attempt=job.attempt)
    calls = [stub.Drain.future(request, timeout=DRAIN_TIMEOUT_SECONDS)
             for r, stub in enumerate(ranks.stubs) if r not in set(skip)]
    for call in calls:
        with contextlib.suppress(grpc.RpcError):
            call.result()


def dead_ranks(ranks: Ranks) -> list[int]:
    """The ranks whose worker does not answer a health check within a second."""
    return [r for r in range(len(ranks.workers)) if not _answers(ranks.workers[r].address)]


def diagnose(error: Exception, ranks: Ranks | None, dead: list[int] | None = None) -> str:
    """The job's error message: `error` in one line (a failed call as its status code and
    details, never the call object's repr), naming the ranks that died if any did."""
    text = (f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
            if isinstance(error, grpc.RpcError) and hasattr(error, "code") else str(error))
    if ranks is None:
        return text
    dead = dead_ranks(ranks) if dead is None else dead
    if dead:
        for r in dead:  # "worker 0 (...) died: worker 0 (...) failed: X" says it twice
            text = text.removeprefix(f"{ranks.describe(r)} failed: ")
        return f"{', '.join(ranks.describe(r) for r in dead)} died: {text}"
    return text


def check_heartbeats(registry: Registry, ranks: Ranks, pending: Iterable[int]) -> None:
    """Raises WorkerFailed if a rank in `pending` stopped sending heartbeats."""
    known = {w.worker_id: w for w in registry.workers()}
    for r in pending:
        rec = known.get(ranks.workers[r].worker_id)
        if rec is None or not registry.alive(rec):
            raise WorkerFailed(f"{ranks.describe(r)} stopped sending heartbeats")


def _answers(address: str) -> bool:
    """Whether the worker at `address` answers a health check within a second."""
    with server.channel(address) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return True
        except grpc.RpcError:
            return False
