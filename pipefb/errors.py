"""Domain errors of pipefb: each subclasses a built-in and carries the offending value."""

from __future__ import annotations


class ConfigError(ValueError):
    """A job, model, dataset, loss, optimizer or CLI value that pipefb cannot use."""


class CodecError(ValueError):
    """A tensor or frame that fails validation before allocation."""


class ScheduleError(ValueError):
    """A schedule that is malformed or deadlocks; `grid` shows the worker x step table."""

    def __init__(self, message: str, grid: str = "") -> None:
        super().__init__(f"{message}\n{grid}" if grid else message)
        self.grid = grid


class StoreFullError(RuntimeError):
    """The offload store refused a write for longer than the backoff allows."""


class WorkerFailed(RuntimeError):
    """A worker died or failed a step; the message names it."""


class Aborted(RuntimeError):
    """The step was aborted (the job stopped or failed elsewhere) while waiting."""


class FileWriteError(OSError):
    """A checkpoint or journal file that could not be written; the message names the file
    and the cause, `errno` carries the code."""


class DiskFullError(FileWriteError):
    """The disk (or the quota) that a checkpoint or journal file goes to is full."""


class NonFiniteLoss(ArithmeticError):
    """A step's loss is NaN or infinite; the message names the step and the rank."""
class Overloaded(RuntimeError):
    """A service limit refused a request for now; `retry_after_seconds` says when to
    try again (RESOURCE_EXHAUSTED with the gRPC retry pushback over the wire)."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(f"{message}; retry in {retry_after_seconds:g} s")
        self.retry_after_seconds = retry_after_seconds
