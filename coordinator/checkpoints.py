"""A job's checkpoints: where they go, asking for one, and committing one at a step."""

from __future__ import annotations

from pathlib import Path

from coordinator.jobs import Job
from coordinator.journal import Journal
from coordinator.ranks import Ranks, wait_all
from pipefb.errors import Aborted
from pipefb.job.config import JobConfig
from pipefb.runtime.checkpoint import resolve_under, write_state
from protos import worker_pb2
from protos.server import FailedPrecondition


def checkpoint_dir(cfg: JobConfig, root: str) -> Path | None:
    """The job's checkpoint directory under `root`, or None when it uses none."""
    if cfg.checkpoint_every or cfg.resume or (cfg.checkpoint_dir and root):
        return resolve_under(root, cfg.checkpoint_dir)
    return None


def commit(job: Job, step: int, journal: Journal) -> None:
    """Writes the job's state of `step` beside the owners' rank files, which commits that
    checkpoint, and journals it."""
    assert job.checkpoints is not None and job.plan is not None
    write_state(job.checkpoints, step, {"job": job.config.to_dict(),
                                        "plan": job.plan.to_dict()})
    job.checkpointed = step
    journal.record(job.entry())


def checkpoint_now(job: Job, ranks: Ranks, journal: Journal) -> None:
    """Between steps: every owner saves its rank file of `job.step` (the Checkpoint
    RPC), then the job's state commits it; nothing when the job takes no checkpoints
    or has one of this step."""
    if job.checkpoints is None or job.checkpointed == job.step or job.plan is None:
        return
    calls = [stub.Checkpoint.future(worker_pb2.CheckpointRequest(
        job_id=job.job_id, attempt=job.attempt, step=job.step), timeout=60)
        for stub in ranks.stubs]
    wait_all(calls, ranks)
    commit(job, job.step, journal)


def request_checkpoint(job: Job, timeout: float) -> int:
    """Checkpoints a running job at its next step boundary that no rank has started
    (`StepPump.checkpoint_after`): the owners save when that step ends, in the same
    Step call, so nothing flushes or waits. Returns the checkpoint's step (a resume
    starts there) once it is committed, waiting up to `timeout` s.

    Raises:
        FailedPrecondition: the job is not stepping, has no checkpoint directory, or
            has issued its last step.
        Aborted: the job stopped, failed or restarted before the checkpoint committed.
    """
    with job.cond:
        if job.checkpoints is None:
            raise FailedPrecondition(f"job {job.job_id} has no checkpoint directory "
                                     "(--checkpoint-dir) to write to")
        pump = job.pump
        if job.state != "RUNNING" or pump is None:
            raise FailedPrecondition(f"job {job.job_id} is {job.state}; only a job "
                                     "running steps can be checkpointed")
        after = pump.checkpoint_after()
        if after is None:
            raise FailedPrecondition(f"job {job.job_id} has issued its last step; "
                                     "its final weights come with ExportWeights")
        job.cond.wait_for(lambda: job.checkpointed > after or job.pump is not pump,
                          timeout=timeout)
        if job.checkpointed > after:
            return job.checkpointed
    raise Aborted(f"job {job.job_id} did not commit the checkpoint of step {after + 1} "
                  f"(it is {job.state}{': ' + job.error if job.error else ''})")
