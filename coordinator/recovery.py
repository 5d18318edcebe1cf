"""Recovery: replays a failed attempt, resumes a job from its checkpoint.

[Note: restarts] With `max_restarts` > 0 a failed attempt is replayed instead: every rank
that answers is drained, the job's stash keys (all attempts) are deleted, each dead rank
is replaced by a worker registered under the same name (a relaunched process or pod) or
else by any idle one, and every rank is assigned again with attempt + 1 from the newest
checkpoint intact for the job at or before the last reported step (step 0 without one;
[Note: manifests] in pipefb/runtime/manifest.py), whose weights and optimizer state (and
the old weight versions an async job's next forwards run on: [Note: resumed leads],
[Note: resumed stale forwards] in pipefb/runtime/state.py) every rank restores. Steps already
reported are run again but not reported twice. Workers refuse the calls and transfers of
older attempts ([Note: attempt fencing] in worker/service.py). A lost offload store (its
Redis run id changes, or it stops answering) fails the attempt the same way: what it held
is gone, so the steps are replayed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from coordinator.jobs import Job, check_interrupted
from coordinator.journal import Journal
from coordinator.metrics import CoordinatorMetrics
from coordinator.profiling import ProfileCache
from coordinator.ranks import Ranks, dead_ranks, diagnose, drain
from coordinator.registry import Registry, WorkerRecord
from coordinator.storewatch import clear_store, wait_for_store
from pipefb.errors import ConfigError, WorkerFailed
from pipefb.plan.plan import Plan
from pipefb.runtime.manifest import Manifest, newest_intact
from protos import coordinator_pb2

log = logging.getLogger(__name__)

RECOVERABLE = (WorkerFailed, grpc.RpcError)  # an attempt that failed so may be replayed


@dataclass
class Recovery:
    """Ends a failed attempt and readies the next ([Note: restarts])."""

    registry: Registry
    profiles: ProfileCache  # a dead worker's profile replies are forgotten with it
    store_address: str
    wait_seconds: float  # for the store and for replacements of dead ranks
    draining: threading.Event  # set while the coordinator stops: waits give up
    journal: Journal
    metrics: CoordinatorMetrics | None = None

    def restart(self, job: Job, ranks: Ranks, error: Exception) -> None:
        """Drains the ranks that answer, clears the stash, waits for the store and for
        replacements of the dead ranks, and counts the restart."""
        dead = dead_ranks(ranks)
        message = diagnose(error, ranks, dead)
        log.warning("job %s: attempt %d failed: %s; restarting (%d of %d)", job.job_id,
                    job.attempt, message, len(job.restarts) + 1, job.config.max_restarts)
        with job.cond:
            job.restarts.append(message)
        job.set_state("RECOVERING")
        drain(job, ranks, skip=dead)
        ranks.close()
        if self.metrics is not None:
            self.metrics.restarted(job.job_id)
        wait_for_store(self.store_address, self.wait_seconds, lambda: check_interrupted(
            job, self.draining, "while the store was away"))
        clear_store(self.store_address, job.job_id)
        job.workers = self.replace(job, ranks, dead)
        job.attempt += 1
        self.journal.record(job.entry())

    def replace(self, job: Job, ranks: Ranks, dead: list[int]) -> list[WorkerRecord]:
        """The job's workers with each dead rank's replaced: by a worker of the same name
        if one registers, else by any idle one; waits up to `wait_seconds`.

        Raises:
            WorkerFailed: a dead rank found no replacement in time (names them).
            Stopped: StopJob arrived while waiting.
        """
        workers = list(job.workers)
        self.forget(ranks, dead)
        missing = set(dead)
        deadline = time.monotonic() + self.wait_seconds
        while missing:
            for r in sorted(missing):
                found = self.registry.acquire_replacement(workers[r].name, job.job_id)
                if found is not None:
                    log.info("job %s: rank %d now runs on worker %d (%s, %s)", job.job_id, r,
                             found.worker_id, found.name, found.address)
                    workers[r] = found
                    missing.discard(r)
            if not missing:
                break
            check_interrupted(job, self.draining, "while it waited for workers")
            if time.monotonic() > deadline:
                names = ", ".join(ranks.describe(r) for r in sorted(missing))
                raise WorkerFailed(f"no worker replaced {names} within "
                                   f"{self.wait_seconds:.0f} s")
            time.sleep(0.1)
        return workers

    def forget(self, ranks: Ranks | None, dead: list[int]) -> None:
        """Drops dead ranks' workers from the registry: no later job may take them before
        their heartbeats time out (a relaunched process registers anew)."""
        for r in dead:
            assert ranks is not None
            self.registry.forget(ranks.workers[r].worker_id)
            self.profiles.forget(ranks.workers[r].address)


def resume_point(job: Job) -> Plan:
    """The plan of the newest checkpoint intact for this job ([Note: manifests]); sets the
    job's start step to its step and notes the newer ones it passed over.

    Raises:
        ConfigError: no intact checkpoint (naming why the newest was refused), or one at
            or past the job's last step.
    """
    assert job.checkpoints is not None
    found = _newest_intact(job, None)
    if found is None:
        why = f": {job.refused[0]}" if job.refused else " (it holds none)"
        raise ConfigError(f"no intact checkpoint of this job to resume from in "
                          f"{job.config.checkpoint_dir!r}{why}")
    if found.step >= job.config.steps:
        raise ConfigError(f"the checkpoint is at step {found.step}; the job has "
                          f"{job.config.steps} steps")
    job.start_step = job.step = found.step
    return Plan.from_dict(found.plan)


def replay_point(job: Job) -> int:
    """The step a replay starts from: the newest checkpoint intact for this job at or
    before its last reported step, else step 0."""
    if job.checkpoints is None:
        return 0
    found = _newest_intact(job, job.step)
    return 0 if found is None else found.step


def _newest_intact(job: Job, at_most: int | None) -> Manifest | None:
    """`newest_intact` of the job's directory; each checkpoint passed over is logged and
    kept in `job.refused` (JobStatus.refused_checkpoints)."""
    assert job.checkpoints is not None
    found, refused = newest_intact(job.checkpoints, job.config.to_dict(), at_most)
    for why in refused:
        log.warning("job %s: checkpoint refused: %s", job.job_id, why)
    if found is not None and refused:
        log.warning("job %s: starting from the intact checkpoint of step %d", job.job_id,
                    found.step)
    with job.cond:
        job.refused[:0] = [r for r in refused if r not in job.refused]
    return found


def compare_replay(job: Job, report: coordinator_pb2.StepReport) -> None:
    """A replayed step's loss against the one reported before: equal, as a job resumes
    from its checkpoints bit for bit."""
    index = report.step - job.first_step
    if not 0 <= index < len(job.reports):  # reported by an earlier coordinator
        return
    before = job.reports[index].loss
    if before != report.loss and before == before:
        log.warning("job %s: replayed step %d has loss %r, reported before %r", job.job_id,
                    report.step, report.loss, before)
