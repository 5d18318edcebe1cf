"""Drives steps on every rank without a global barrier between steps.

[Note: no step barrier] Each rank gets `Step(v+1)` as soon as it returns from `Step(v)`.
This is safe because every tensor a step exchanges is keyed by its step and every
dependency between steps is an action in the schedule (a combined rank's `OPT` ends its
step; a forward rank's `RECV_W` waits for the new weight version), so a rank that starts
early simply blocks on its first receive. It removes a coordinator round trip and the
flush bubble between steps; with two calls in flight per rank the worker starts the next
step the moment it ends one (it runs them strictly in order). A stop takes effect at a
step every rank runs: the highest step already issued to any rank.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pipefb.runtime.checkpoint import due
from protos import worker_pb2

IN_FLIGHT = 2  # Step calls pending per rank: the next one waits on the worker, no round trip
OnStep = Callable[[int, list[worker_pb2.StepReply], float], None]


@dataclass
class _Progress:
    """Shared state of the rank loops; guarded by `cond`."""

    stop_at: int
    issued: list[int]
    replies: dict[int, dict[int, worker_pb2.StepReply]] = field(default_factory=dict)
    errors: list[tuple[int, grpc.RpcError]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class _Outcome:
    """What waiting for a step gave: the end (with failures, if any), a step, or nothing."""

    finished: bool = False
    failures: list[tuple[int, grpc.RpcError]] = field(default_factory=list)
    replies: list[worker_pb2.StepReply] = field(default_factory=list)


class StepPump:
    """Runs steps `0 .. steps-1` on every rank, reporting each step once all ranks did it."""

    def __init__(self, job_id: str, stubs: list, steps: int, on_step: OnStep,
                 in_flight: int = IN_FLIGHT, start: int = 0, checkpoint_every: int = 0,
                 attempt: int = 0) -> None:
        self.job_id, self.stubs, self.on_step = job_id, stubs, on_step
        self.attempt = attempt  # stamped on every Step call (fencing)
        self.in_flight, self.start, self.steps = in_flight, start, steps
        self.checkpoint_every = checkpoint_every  # owners save after these steps (`due`)
        self.progress = _Progress(stop_at=steps, issued=[-1] * len(stubs))
        self.requested: set[int] = set()  # steps after which owners save (`checkpoint_after`)

    def checkpointed_after(self, step: int) -> bool:
        """Whether owners save a checkpoint after step `step`: by cadence or by request."""
        return due(step, self.checkpoint_every, self.steps) or step in self.requested

    def checkpoint_after(self) -> int | None:
        """Asks every owner to save after the lowest step no rank was issued yet, so no
        step waits and the pipeline does not flush; returns that step (None: every step
        was issued, no boundary is left before the end)."""
        with self.progress.cond:
            step = max(*self.progress.issued, self.start - 1) + 1
            if step >= self.progress.stop_at:
                return None
            self.requested.add(step)
            return step

    def _issue(self, rank: int, step: int, inflight: deque[tuple[int, grpc.Future]]) -> int:
        """Starts Step calls on `rank` until `in_flight` are pending; returns the next step."""
        p = self.progress
        with p.cond:
            while len(inflight) < self.in_flight and step < p.stop_at and not p.errors:
                p.issued[rank] = step
                request = worker_pb2.StepRequest(
                    job_id=self.job_id, step=step, attempt=self.attempt,
                    checkpoint=self.checkpointed_after(step))
                inflight.append((step, self.stubs[rank].Step.future(request)))
                step += 1
        return step

    def _rank_loop(self, rank: int) -> None:
        p, step = self.progress, self.start
        inflight: deque[tuple[int, grpc.Future]] = deque()
        while True:
            step = self._issue(rank, step, inflight)
            if not inflight:
                return
            done, future = inflight.popleft()
            try:
                reply = future.result()
            except grpc.RpcError as error:
                for _, later in inflight:
                    later.cancel()
                with p.cond:
                    p.errors.append((rank, error))
                    p.cond.notify_all()
                return
            with p.cond:
                p.replies.setdefault(done, {})[rank] = reply
                p.cond.notify_all()

    def stop(self) -> int:
        """Stops after the highest step already issued; returns the steps that will run."""
        with self.progress.cond:
            self.progress.stop_at = min(self.progress.stop_at, max(self.progress.issued) + 1)
            self.progress.cond.notify_all()
            return self.progress.stop_at

    def run(self, poll: Callable[[], None]) -> list[tuple[int, grpc.RpcError]]:
        """Runs until every step is reported or a rank fails; `poll` runs every half second
        (it may call `stop`, or raise to abandon the run).

        Returns:
            The failures by rank, in the order they happened (empty on success).
        """
        threads = [threading.Thread(target=self._rank_loop, args=(r,), daemon=True,
                                    name=f"{self.job_id}-rank{r}") for r in range(len(self.stubs))]
        for t in threads:
            t.start()
        reported, last = self.start, time.perf_counter()
        while True:
            outcome = self._wait(reported)
            if outcome.finished:
                return outcome.failures
            try:
                if outcome.replies:
                    now = time.perf_counter()
                    self.on_step(reported, outcome.replies, now - last)
                    reported, last = reported + 1, now
                poll()
            except BaseException:
                self.abandon()
                raise

    def abandon(self) -> None:
        """Issues no more steps (the run was given up; the driver drains the ranks)."""
        with self.progress.cond:
            self.progress.stop_at = -1
            self.progress.cond.notify_all()

    def _wait(self, step: int) -> _Outcome:
        """Waits up to half a second for `step` to complete on every rank."""
        p, n = self.progress, len(self.stubs)
        with p.cond:
            p.cond.wait_for(lambda: bool(p.errors) or step >= p.stop_at
                            or len(p.replies.get(step, {})) == n, 0.5)
            if p.errors or step >= p.stop_at:
                return _Outcome(finished=True, failures=list(p.errors))
            if len(p.replies.get(step, {})) < n:
                return _Outcome()
            replies = p.replies.pop(step)
        return _Outcome(replies=[replies[r] for r in range(n)])
