"""The Coordinator servicer: decodes requests, calls the registry and driver, encodes replies."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from functools import partial

import grpc

from coordinator.checkpoints import claim_directory, own_directory
from coordinator.driver import Driver
from coordinator.jobs import TERMINAL, Job
from coordinator.journal import Entry
from coordinator.limits import check_worker
from coordinator.registry import Registry
from coordinator.reshape import migration_proto
from pipefb.errors import ConfigError
from pipefb.job.config import MAX_JOB_ID
from pipefb.job.size import SizeLimits
from pipefb.runtime.splitcheck import check_submit
from pipefb.schedule.kinds import runs_in_process
from protos import coordinator_pb2, coordinator_pb2_grpc, job_pb2, security, tensor_pb2, wire
from protos.convert import job_from_proto, job_to_proto, plan_to_proto
from protos.server import FailedPrecondition

log = logging.getLogger(__name__)
CHECKPOINT_WAIT_SECONDS = 600.0  # Checkpoint waits at most this long for the commit
REPORT_WAIT_SECONDS = 1.0  # a follower looks again at least this often, notified or not
KEEP_FINISHED_JOBS = 32  # finished jobs whose status, reports and weights stay queryable


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Jobs by id, workers by registry."""

    def __init__(self, registry: Registry, driver: Driver,
                 size_limits: SizeLimits | None = None) -> None:
        self.registry, self.driver = registry, driver
        self.size_limits = size_limits or SizeLimits()  # what one job may ask for
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.heartbeat_port = 0  # the workers' own server, once started ([Note: workers'
        # path] in coordinator/workerpath.py); 0: none, heartbeats come to this port

    def _job(self, job_id: str, context: grpc.ServicerContext) -> Job:
        """The job `job_id` (an id the caller chose, in its own namespace, or a whole id)
        if the caller submitted it or is the admin; another's job is as missing as an
        unknown id ([Note: access] in protos/security.py)."""
        who = security.caller(context)
        job = self._jobs.get(owned_id(job_id, who)) or self._jobs.get(job_id)
        if job is None or not visible(job, who):
            raise KeyError(f"no job {job_id!r}")
        return job

    def RegisterWorker(self, request: coordinator_pb2.RegisterWorkerRequest,
                       context: grpc.ServicerContext) -> coordinator_pb2.RegisterWorkerReply:
        if not request.address:
            raise ValueError("RegisterWorker needs an address")
        check_worker(request.address, request.name)
        worker_id = self.registry.register(request.address, request.name)
        self.driver.profiles.forget(request.address)  # a new process: profile it anew
        return coordinator_pb2.RegisterWorkerReply(
            worker_id=worker_id, heartbeat_seconds=self.registry.heartbeat_seconds,
            heartbeat_port=self.heartbeat_port)

    def Heartbeat(self, request: coordinator_pb2.HeartbeatRequest,
                  context: grpc.ServicerContext) -> coordinator_pb2.HeartbeatReply:
        return coordinator_pb2.HeartbeatReply(
            known=self.registry.heartbeat(request.worker_id, request.address))

    def SubmitJob(self, request: job_pb2.JobSpec, context: grpc.ServicerContext
                  ) -> coordinator_pb2.JobStatus:
        config = job_from_proto(request)
        if runs_in_process(config.schedule):
            raise ValueError("schedule 'single' runs in the client, not on a cluster")
        if config.checkpoint_dir:  # a directory in use is refused before the model's checks
            with self._lock:  # (and checked again below, with the job's registration)
                claim_directory(config, self._jobs.values(), self.driver.checkpoint_root)
        checked = check_submit(config, self.size_limits)
        owner = security.caller(context)
        chosen = owned_id(config.job_id, owner) if config.job_id else ""
        with self._lock:
            job_id = chosen or self._fresh_id()
            if job_id in self._jobs:  # the caller's own namespace: [Note: job ids]
                raise FailedPrecondition(f"job id {config.job_id!r} is already in use")
            config = own_directory(replace(config, job_id=job_id))
            claim_directory(config, self._jobs.values(), self.driver.checkpoint_root)
            job = Job(config, layer_costs=checked.costs, owner=owner,
                      warnings=checked.warnings)
            self._forget_old_jobs()
            self._jobs[job_id] = job
        self.driver.start(job)
        return _status(job)

    def unfinished(self) -> set[str]:
        """The ids of the jobs not ended yet (admission counts them: coordinator.limits)."""
        with self._lock:
            return {j.job_id for j in self._jobs.values() if j.state not in TERMINAL}

    def _fresh_id(self) -> str:
        """job-<16 random hex digits>: an id nobody guesses (resumed jobs keep theirs)."""
        while (job_id := f"job-{secrets.token_hex(8)}") in self._jobs:
            pass
        return job_id

    def resume(self, entries: list[Entry]) -> None:
        """Starts the journaled jobs of an earlier coordinator ([Note: restarts] in
        coordinator/recovery.py): each with attempt + 1, its plan, from its newest
        checkpoint."""
        for entry in entries:
            step = entry.step
            try:
                costs = check_submit(entry.config, self.size_limits).costs
            except ValueError as error:  # ConfigError too: e.g. a model plugin is gone
                log.error("journaled job %s cannot resume: %s", entry.config.job_id, error)
                continue
            job = Job(entry.config, layer_costs=costs, plan=entry.plan,
                      attempt=entry.attempt + 1, step=step, start_step=step,
                      first_step=step, checkpointed=step,
                      restarts=[*entry.restarts, "the coordinator restarted"],
                      owner=entry.owner)
            with self._lock:
                self._jobs[job.job_id] = job
            log.info("resuming job %s from step %d (attempt %d)", job.job_id, step,
                     job.attempt)
            self.driver.start(job)

    def _forget_old_jobs(self) -> None:
        """Keeps the newest KEEP_FINISHED_JOBS finished jobs (their weights and reports)."""
        finished = [j for j in self._jobs.values() if j.state in TERMINAL]
        for job in finished[:max(0, len(finished) - KEEP_FINISHED_JOBS)]:
            del self._jobs[job.job_id]
            if self.driver.metrics is not None:
                self.driver.metrics.forget(job.job_id)

    async def Train(self, request: coordinator_pb2.TrainRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[coordinator_pb2.StepReport]:
        """Streams the job's step reports as they come, on the event loop: a follower
        holds no thread ([Note: asyncio server] in protos/aioserver.py); a client that
        goes away cancels it at its wait."""
        job = self._job(request.job_id, context)
        sent = 0
        while True:
            with job.cond:
                new, state, error = job.reports[sent:], job.state, job.error
            for report in new:
                yield report
            sent += len(new)
            if state in TERMINAL and sent == len(job.reports):
                if state == "FAILED":
                    await context.abort(grpc.StatusCode.ABORTED,
                                        f"job {job.job_id} failed: {error}")
                return
            await job.cond.changed(partial(_moved_on, job, sent), REPORT_WAIT_SECONDS)

    def GetJob(self, request: coordinator_pb2.GetJobRequest, context: grpc.ServicerContext
               ) -> coordinator_pb2.JobStatus:
        return _status(self._job(request.job_id, context))

    def ListWorkers(self, request: coordinator_pb2.ListWorkersRequest,
                    context: grpc.ServicerContext) -> coordinator_pb2.ListWorkersReply:
        now = time.monotonic()
        return coordinator_pb2.ListWorkersReply(workers=[
            coordinator_pb2.WorkerInfo(worker_id=w.worker_id, address=w.address, name=w.name,
                                       alive=self.registry.alive(w), job_id=w.job_id,
                                       last_heartbeat_age_seconds=now - w.last_seen)
            for w in self.registry.workers()])

    def StopJob(self, request: coordinator_pb2.StopJobRequest, context: grpc.ServicerContext
                ) -> coordinator_pb2.JobStatus:
        job = self._job(request.job_id, context)
        with job.cond:
            job.stop_requested = True
        return _status(job)

    def Repartition(self, request: coordinator_pb2.RepartitionRequest,
                    context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        job = self._job(request.job_id, context)
        self.driver.repartition(job, list(request.forward_partition),
                                list(request.backward_partition), request.fail_ranks)
        return _status(job)

    def Checkpoint(self, request: coordinator_pb2.CheckpointJobRequest,
                   context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        job = self._job(request.job_id, context)
        remaining = context.time_remaining()
        timeout = CHECKPOINT_WAIT_SECONDS if remaining is None else min(
            remaining, CHECKPOINT_WAIT_SECONDS)
        self.driver.checkpoint(job, timeout)
        return _status(job)

    def ExportWeights(self, request: job_pb2.ExportWeightsRequest,
                      context: grpc.ServicerContext) -> Iterator[tensor_pb2.TensorChunk]:
        job = self._job(request.job_id, context)
        if job.state != "DONE":
            raise FailedPrecondition(f"job {job.job_id} is {job.state}; weights come when DONE")
        transfer = tensor_pb2.Transfer(job_id=job.job_id, version=job.config.steps,
                                       microbatch=-1, kind="EXPORT")
        yield from wire.encode_stream(transfer, job.weights)


def owned_id(chosen: str, owner: str) -> str:
    """The whole id of a job id `owner` chose.

    [Note: job ids] Job ids are per owner: a user's chosen id `run` is the job
    `USER.run` (user names hold no dot, so no two users' ids meet, and random ids
    `job-<16 hex>` hold none either), and the user may call it by either name. So whether
    another user holds an id never shows: a submit can collide only with the caller's own
    jobs. The admin's chosen ids are whole as given.

    Raises:
        ConfigError: the whole id would be longer than a job id may be.
    """
    if owner == security.ADMIN:
        return chosen
    whole = f"{owner}.{chosen}"
    if len(whole) > MAX_JOB_ID:
        raise ConfigError(f"job id {chosen!r} is too long: {owner}'s ids have at most "
                          f"{MAX_JOB_ID - len(owner) - 1} characters")
    return whole


def _moved_on(job: Job, sent: int) -> bool:
    """Whether `job` has reports after the first `sent`, or ended (hold its lock)."""
    return len(job.reports) > sent or job.state in TERMINAL


def visible(job: Job, who: str) -> bool:
    """Whether the caller `who` may see and steer `job`: its submitter or the admin."""
    return who in (job.owner, security.ADMIN)


def _status(job: Job) -> coordinator_pb2.JobStatus:
    status = coordinator_pb2.JobStatus(
        job_id=job.job_id, state=coordinator_pb2.JobState.Value(job.state), step=job.step,
        spec=job_to_proto(job.config), error=job.error,
        worker_ids=[w.worker_id for w in job.workers], attempt=job.attempt,
        restarts=job.restarts, checkpointed=job.checkpointed,
        migrations=[migration_proto(m) for m in job.migrations])
    status.start_step = job.start_step
    status.refused_checkpoints.extend(job.refused)
    status.warnings.extend(job.warnings)
    if job.plan is not None:
        status.plan.CopyFrom(plan_to_proto(job.plan))
    if job.planner:
        status.planner_json = json.dumps(job.planner)
    return status
