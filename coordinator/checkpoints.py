"""A job's checkpoints: where they go, asking for one, and committing one at a step."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from coordinator.jobs import TERMINAL, Job
from coordinator.journal import Journal
from coordinator.ranks import Ranks, wait_all
from pipefb.errors import Aborted, ConfigError, WorkerFailed
from pipefb.job.config import JobConfig
from pipefb.runtime.checkpoint import Digest, resolve_under
from pipefb.runtime.manifest import check_owner, committed, write_manifest
from protos import worker_pb2
from protos.server import FailedPrecondition

DEFAULT_DIR = "checkpoints"  # a job that takes checkpoints and names no directory: its own
# checkpoints/{job id} inside the checkpoint root


def checkpoint_dir(cfg: JobConfig, root: str) -> Path | None:
    """The job's checkpoint directory under `root`, or None when it uses none."""
    if cfg.checkpoint_every or cfg.resume or (cfg.checkpoint_dir and root):
        return resolve_under(root, cfg.checkpoint_dir)
    return None


def own_directory(cfg: JobConfig) -> JobConfig:
    """The job with its checkpoint directory named: `checkpoints/{job id}` when it takes
    checkpoints (or resumes) and names none, so no two jobs share one by default."""
    if cfg.checkpoint_dir or not (cfg.checkpoint_every or cfg.resume):
        return cfg
    return replace(cfg, checkpoint_dir=f"{DEFAULT_DIR}/{cfg.job_id}")


def claim_directory(cfg: JobConfig, jobs: Iterable[Job], root: str) -> None:
    """Refuses a submitted job whose checkpoint directory an unfinished job uses, or which
    would write over another job's checkpoints (a fresh job, not a resume).

    Raises:
        FailedPrecondition: either case, naming the directory and the other job.
        PermissionError: the directory is outside the checkpoint root, or there is none.
    """
    path = checkpoint_dir(cfg, root)
    if path is None:
        return
    for other in jobs:
        if other.state not in TERMINAL and other.config.checkpoint_dir and resolve_under(
                root, other.config.checkpoint_dir) == path:
            raise FailedPrecondition(f"checkpoint directory {cfg.checkpoint_dir!r} is in use "
                                     f"by job {other.job_id}; name another --checkpoint-dir")
    if cfg.resume:
        return
    for manifest in committed(path):
        try:
            check_owner(manifest, cfg.to_dict())
        except ConfigError as error:
            raise FailedPrecondition(f"checkpoint directory {cfg.checkpoint_dir!r} holds "
                                     f"another job's checkpoints ({error}); name another "
                                     "--checkpoint-dir or resume that job") from None


def rank_files(replies: Sequence[worker_pb2.StepReply | worker_pb2.CheckpointReply]
               ) -> dict[str, Digest]:
    """Name -> digest of the rank files that ranks' replies say they wrote."""
    files: dict[str, Digest] = {}
    for reply in replies:
        got = (reply.checkpoint_file if isinstance(reply, worker_pb2.StepReply) else reply.file)
        if got.name:
            files[got.name] = Digest(got.sha256, got.bytes)
    return files


def commit(job: Job, step: int, files: Mapping[str, Digest], journal: Journal) -> None:
    """Writes the manifest of `step` over the owners' rank files `files`, which commits
    that checkpoint ([Note: manifests]), and journals it.

    Raises:
        WorkerFailed: an owner rank reported no file.
    """
    assert job.checkpoints is not None and job.plan is not None
    missing = [a.rank for a in job.plan.assignment
               if a.role != "forward" and f"rank-{a.rank}.safetensors" not in files]
    if missing:
        raise WorkerFailed(f"rank {missing[0]} reported no checkpoint file for step {step}")
    write_manifest(job.checkpoints, step, job.config.to_dict(), job.plan.to_dict(), files)
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
    commit(job, job.step, rank_files(wait_all(calls, ranks)), journal)


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
