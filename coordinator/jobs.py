"""A job as the coordinator tracks it: its record, its states, and what ends a run early.

A job moves through PENDING -> PLANNING -> RUNNING and ends DONE, FAILED or STOPPED; on
the way it may be RECOVERING (a restart, [Note: restarts] in coordinator/recovery.py) or
MIGRATING (a move, [Note: migration] in coordinator/reshape.py), and goes back to
PLANNING from either. A coordinator that stops leaves its jobs PENDING, journaled.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.journal import Entry
from coordinator.registry import WorkerRecord
from coordinator.stepping import StepPump
from pipefb.job.config import JobConfig
from pipefb.plan.plan import Plan
from pipefb.planner.replan import Replanner
from pipefb.sim.cluster import Cluster
from pipefb.sim.costs import Profile
from protos import coordinator_pb2, security

TERMINAL = ("DONE", "FAILED", "STOPPED")


class Stopped(RuntimeError):
    """StopJob took effect: before the job had its workers, or at a step boundary."""


class Drained(RuntimeError):
    """The coordinator is stopping: the job paused at a step boundary, journaled."""


class Repartitioned(RuntimeError):
    """The job paused at a step boundary and checkpointed, to go on with a new plan."""


class JobCondition(threading.Condition):
    """A job's condition: `notify_all` also wakes the followers awaiting it on the asyncio
    server's loop (`changed`), so a follower holds no thread ([Note: asyncio server] in
    protos/aioserver.py). Every change a follower waits for is notified under it."""

    def __init__(self) -> None:
        super().__init__()
        self._awaiting: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def notify_all(self) -> None:
        super().notify_all()
        for loop, event in self._awaiting:
            loop.call_soon_threadsafe(event.set)

    async def changed(self, done: Callable[[], bool], timeout: float) -> None:
        """Returns once `done()` holds (checked under the lock), after a notify, or after
        `timeout` seconds, without blocking the event loop."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self:
            if done():
                return
            self._awaiting.add(waiter)  # before the lock is let go: no notify is missed
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self:
                self._awaiting.discard(waiter)


@dataclass
class Job:
    """A job's state as the coordinator tracks it; `cond` guards and signals changes."""

    config: JobConfig
    layer_costs: list[float] = field(default_factory=list)  # from check_job at submit
    warnings: list[str] = field(default_factory=list)  # from check_submit: lines for the user
    planner: dict[str, Any] = field(default_factory=dict)  # plan "auto": the search summary
    costs: tuple[Profile, Cluster] | None = None  # plan "auto": what it was planned with
    state: str = "PENDING"
    step: int = 0
    error: str = ""
    plan: Plan | None = None
    workers: list[WorkerRecord] = field(default_factory=list)
    reports: list[coordinator_pb2.StepReport] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    stop_requested: bool = False
    start_step: int = 0  # > 0 when the attempt starts from the checkpoint of that step
    first_step: int = 0  # the step the first attempt started from (reports[0] is its)
    attempt: int = 0  # restarts so far ([Note: restarts])
    checkpointed: int = 0  # the newest step this job checkpointed (0: none)
    restarts: list[str] = field(default_factory=list)  # why each earlier attempt failed
    pending_plan: Plan | None = None  # a Repartition's plan, taken at the next step boundary
    fail_ranks: tuple[int, ...] = ()  # fault injection: ranks that fail the pending move
    migrating_from: tuple[Plan, int] | None = None  # during a move: the paused plan, attempt
    migrations: list[dict[str, Any]] = field(default_factory=list)  # moves so far
    replanner: Replanner | None = None  # with `replan`: decides moves from step reports
    checkpoints: Path | None = None  # the job's checkpoint directory, when it uses one
    pump: StepPump | None = None  # while steps run: takes checkpoint requests
    refused: list[str] = field(default_factory=list)  # checkpoints passed over, newest first
    cond: JobCondition = field(default_factory=JobCondition)
    owner: str = security.ADMIN  # the identity that submitted it; it and the admin see it

    @property
    def job_id(self) -> str:
        """The job's id."""
        return self.config.job_id

    def set_state(self, state: str, error: str = "") -> None:
        """Moves the state machine and wakes followers."""
        with self.cond:
            self.state, self.error = state, error or self.error
            self.cond.notify_all()

    def entry(self) -> Entry:
        """What a restarted coordinator needs to resume the job (its journal entry)."""
        return Entry(self.config, self.plan, self.attempt, self.checkpointed,
                     list(self.restarts), self.owner)


def check_interrupted(job: Job, draining: threading.Event, where: str) -> None:
    """Raises Stopped after StopJob, Drained while the coordinator stops."""
    if job.stop_requested:
        raise Stopped(f"stopped {where}")
    if draining.is_set():
        raise Drained(f"the coordinator stopped {where}")
