"""Registered workers, their heartbeats, and which job each one serves."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class WorkerRecord:
    """One registered worker process."""

    worker_id: int
    address: str  # host:port of its StageWorker service
    name: str
    last_seen: float  # time.monotonic() of the last heartbeat
    job_id: str = ""  # job it serves, "" when idle


class Registry:
    """Thread-safe worker table; a worker is alive while heartbeats keep coming."""

    def __init__(self, heartbeat_seconds: float = 1.0, timeout_seconds: float = 5.0) -> None:
        self.heartbeat_seconds = heartbeat_seconds
        self.timeout_seconds = timeout_seconds
        self._workers: dict[int, WorkerRecord] = {}
        self._next_id = 0
        self._lock = threading.Lock()

    def register(self, address: str, name: str) -> int:
        """Adds a worker (or refreshes the one at the same address); returns its id."""
        with self._lock:
            for rec in self._workers.values():
                if rec.address == address:
                    rec.last_seen, rec.name = time.monotonic(), name
                    return rec.worker_id
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
        """Whether the worker's last heartbeat is within the timeout."""
        return time.monotonic() - rec.last_seen <= self.timeout_seconds

    def workers(self) -> list[WorkerRecord]:
        """A snapshot of every registered worker, by id."""
        with self._lock:
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
