"""Registered workers, their heartbeats, and which job each one serves.

A worker is alive while heartbeats keep coming, silence counted without the
coordinator's own stalls ([Note: own stalls] in coordinator/stalls.py). An idle worker
silent for `expire_seconds` is forgotten (a worker that comes back is told to register
again), and the table holds at most `max_workers`: a flood of registrations cannot grow
it, nor the ListWorkers reply, without bound.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from coordinator.stalls import silent_seconds
from pipefb.errors import Overloaded

MAX_WORKERS = 1024  # default cap of the worker table
EXPIRE_SECONDS = 60.0  # default silence after which an idle worker is forgotten


@dataclass
class WorkerRecord:
    """One registered worker process."""

    worker_id: int
    address: str  # host:port of its StageWorker service
    name: str
    last_seen: float  # time.monotonic() of the last heartbeat
    job_id: str = ""  # job it serves, "" when idle


class Registry:
    """Thread-safe worker table (see the module docstring)."""

    def __init__(self, heartbeat_seconds: float = 1.0, timeout_seconds: float = 5.0,
                 expire_seconds: float = EXPIRE_SECONDS, max_workers: int = MAX_WORKERS
                 ) -> None:
        self.heartbeat_seconds = heartbeat_seconds
        self.timeout_seconds = timeout_seconds
        self.expire_seconds = max(expire_seconds, timeout_seconds)  # dead before forgotten
        self.max_workers = max_workers
        self._workers: dict[int, WorkerRecord] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def register(self, address: str, name: str) -> int:
        """Adds a worker (or refreshes the one at the same address); returns its id.

        Raises:
            Overloaded: the table holds `max_workers` workers, none of them expired.
        """
        with self._lock:
            for rec in self._workers.values():
                if rec.address == address:
                    rec.last_seen, rec.name = time.monotonic(), name
                    return rec.worker_id
            self._expire()
            if len(self._workers) >= self.max_workers:
                raise Overloaded(f"the coordinator has {self.max_workers} workers registered, "
                                 "its limit", retry_after_seconds=self.expire_seconds)
            worker_id, self._next_id = self._next_id, self._next_id + 1
            self._workers[worker_id] = WorkerRecord(worker_id, address, name, time.monotonic())
            return worker_id

    def heartbeat(self, worker_id: int, address: str = "") -> bool:
        """Records a heartbeat; False if the id is unknown, or (with `address`) belongs to
        a worker at another address (a restarted coordinator reuses ids): the worker must
        register."""
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is None or (address and rec.address != address):
                return False
            rec.last_seen = time.monotonic()
            return True

    def alive(self, rec: WorkerRecord) -> bool:
        """Whether the worker's last heartbeat is within the timeout, the coordinator's
        own stalls not counted ([Note: own stalls])."""
        return silent_seconds(rec.last_seen) <= self.timeout_seconds

    def _expire(self) -> None:
        """Forgets idle workers silent for `expire_seconds` (the caller holds the lock)."""
        for worker_id, rec in list(self._workers.items()):
            if not rec.job_id and silent_seconds(rec.last_seen) > self.expire_seconds:
                del self._workers[worker_id]

    def workers(self) -> list[WorkerRecord]:
        """A snapshot of every registered worker, by id (expired ones forgotten first)."""
        with self._lock:
            self._expire()
            return [WorkerRecord(**vars(r)) for _, r in sorted(self._workers.items())]

    def acquire(self, count: int, job_id: str) -> list[WorkerRecord] | None:
        """Reserves `count` idle, alive workers for a job (lowest ids first), or None."""
        with self._lock:
            idle = [r for _, r in sorted(self._workers.items()) if not r.job_id and self.alive(r)]
            if len(idle) < count:
                return None
            for rec in idle[:count]:
                rec.job_id = job_id
            return [WorkerRecord(**vars(r)) for r in idle[:count]]

    def acquire_replacement(self, name: str, job_id: str) -> WorkerRecord | None:
        """Reserves an idle, alive worker for a job's dead rank: one registered under
        `name` (the relaunched process or restarted pod), else the lowest id; or None."""
        with self._lock:
            idle = [r for _, r in sorted(self._workers.items()) if not r.job_id and self.alive(r)]
            chosen = next((r for r in idle if r.name == name), idle[0] if idle else None)
            if chosen is None:
                return None
            chosen.job_id = job_id
            return WorkerRecord(**vars(chosen))

    def release(self, job_id: str) -> None:
        """Marks every worker of the job idle again."""
        with self._lock:
            for rec in self._workers.values():
                if rec.job_id == job_id:
                    rec.job_id = ""

    def forget(self, worker_id: int) -> None:
        """Removes a worker that is known to be dead."""
        with self._lock:
            self._workers.pop(worker_id, None)
