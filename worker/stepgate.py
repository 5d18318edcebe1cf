"""The step gate of a worker: steps run one at a time and in order, and the calls that must
wait for a step boundary (Checkpoint, Drain) wait there, each until its caller's deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipefb.errors import Aborted
from protos.server import FailedPrecondition


class StepGate:
    """Runs Step calls strictly in step order, one at a time; Drain aborts the waiters.

    The coordinator keeps a second Step call in flight per rank (see coordinator.stepping),
    so step v+1 may arrive while step v runs; it waits here for its turn.
    """

    def __init__(self, start: int = 0) -> None:
        self._cond = threading.Condition()
        self._next = start  # the first step this rank runs (a resumed job's checkpoint)
        self._running = -1  # the step running now, -1 between steps
        self._aborted: str | None = None

    def horizon(self) -> int:
        """The lowest step this rank may still run: the running one, or else the next."""
        with self._cond:
            return self._running if self._running >= 0 else self._next

    @contextmanager
    def turn(self, step: int, timeout: float | None = None,
             gone: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Waits until `step` is next, holds the turn while the body runs, then passes it.

        Raises:
            Aborted: the job was drained meanwhile, or `step` was not next within
                `timeout` seconds (the caller's deadline; None: no limit) or before
                `gone()` (its caller gave up; `wake` re-checks it).
        """
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._next >= step or self._aborted is not None or gone(), timeout)
            if self._aborted is not None:
                raise Aborted(self._aborted)
            if not ready or gone():  # a caller that left takes no turn
                raise Aborted(f"step {step} did not get its turn before the caller's "
                              f"deadline (next: {self._next}, running: {self._running})")
            if self._next != step:
                raise FailedPrecondition(f"step {step} already ran; the next is {self._next}")
            self._next, self._running = -1, step  # taken: later steps wait, this one runs
        try:
            yield
        except BaseException as error:
            with self._cond:  # a failed step leaves half-updated state: no later step runs
                self._aborted = self._aborted or f"step {step} failed: {error}"
                self._running = -1
                self._cond.notify_all()
            raise
        with self._cond:
            self._next, self._running = step + 1, -1
            self._cond.notify_all()

    @contextmanager
    def between(self, step: int, timeout: float) -> Iterator[None]:
        """Holds the gate between steps once `step` is the next to run: no step runs
        while the body does.

        Raises:
            FailedPrecondition: `step` is not the next step within `timeout` seconds.
            Aborted: the job was drained meanwhile.
        """
        with self._cond:
            ready = self._cond.wait_for(lambda: self._aborted is not None or (
                self._next == step and self._running < 0), timeout)
            if self._aborted is not None:
                raise Aborted(self._aborted)
            if not ready:
                raise FailedPrecondition(f"step {step} is not next within {timeout:.0f} s "
                                         f"(next: {self._next}, running: {self._running})")
            self._next = -1  # taken: Step calls wait
        try:
            yield
        finally:
            with self._cond:
                self._next = step
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no step runs; False if one still runs after `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running < 0, timeout)

    def wake(self) -> None:
        """Wakes the waiting Step calls to look at their callers again (`turn`'s `gone`)."""
        with self._cond:
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """Wakes every waiting Step with Aborted."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()
