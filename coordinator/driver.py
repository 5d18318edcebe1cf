"""Drives a job: waits for workers, plans, assigns ranks, runs steps, collects weights.

[Note: first failure] A step runs on every rank at once. When one rank fails, the others
block on it; the driver keeps the first failure, probes which workers are still alive to
name a dead one, drains the rest (which aborts their waits), clears the job's stash keys
and fails the job with that message.

[Note: restarts] With `max_restarts` > 0 a failed attempt is replayed instead: every rank
that answers is drained, the job's stash keys (all attempts) are deleted, each dead rank
is replaced by a worker registered under the same name (a relaunched process or pod) or
else by any idle one, and every rank is assigned again with attempt + 1 from the newest
checkpoint at or before the last reported step (step 0 without one), whose weights and
optimizer state every owner restores. Steps already reported are run again but not
reported twice. Workers refuse the calls and transfers of older attempts ([Note: attempt
fencing] in worker/service.py). A lost offload store (its Redis run id changes, or it stops
answering) fails the attempt the same way: what it held is gone, so the steps are replayed.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from coordinator.journal import Entry, Journal
from coordinator.metrics import CoordinatorMetrics
from coordinator.profiling import ProfileCache, profile_workers
from coordinator.registry import Registry, WorkerRecord
from coordinator.rendezvous import Rendezvous
from coordinator.stepping import IN_FLIGHT, StepPump
from offload_store import OffloadStore, connect
from pipefb.errors import Aborted, ConfigError, ScheduleError, WorkerFailed
from pipefb.job.config import AUTO, JobConfig, layer_policies
from pipefb.plan.migration import repartitioned
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import Plan, schedule_for
from pipefb.planner.insitu import STEPS as IN_SITU_STEPS
from pipefb.planner.insitu import fit, median_action_seconds
from pipefb.planner.job import job_cluster, label, plan_job, summary
from pipefb.planner.replan import Replanner, ReplanSettings
from pipefb.runtime.checkpoint import latest, resolve_under, write_state
from pipefb.runtime.evaluate import evaluate
from pipefb.sim.cluster import Cluster
from pipefb.sim.costs import Profile
from protos import coordinator_pb2, job_pb2, server, wire, worker_pb2, worker_pb2_grpc
from protos.convert import job_to_proto, plan_to_proto
from protos.server import FailedPrecondition

log = logging.getLogger(__name__)

TERMINAL = ("DONE", "FAILED", "STOPPED")
RECOVERABLE = (WorkerFailed, grpc.RpcError)  # an attempt that failed so may be replayed
# job fields a resumed job may set otherwise than the checkpointed one
RESUME_MAY_CHANGE = frozenset({"steps", "resume", "job_id", "checkpoint_every", "eval_every",
                               "max_restarts", "slowdown", "check_groups_every"})
DRAIN_TIMEOUT_SECONDS = 30.0  # a worker's Drain waits up to 10 s for its running step
STORE_TIMEOUT_SECONDS = 2.0  # the store's INFO during a run (the liveness check)
STORE_CHECK_SECONDS = 0.5  # at most this often (poll runs after every step)


class Stopped(RuntimeError):
    """StopJob took effect: before the job had its workers, or at a step boundary."""


class Drained(RuntimeError):
    """The coordinator is stopping: the job paused at a step boundary, journaled."""


class Repartitioned(RuntimeError):
    """The job paused at a step boundary and checkpointed, to go on with a new plan."""


@dataclass
class Job:
    """A job's state as the coordinator tracks it; `cond` guards and signals changes."""

    config: JobConfig
    layer_costs: list[float] = field(default_factory=list)  # from check_job at submit
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
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def job_id(self) -> str:
        """The job's id."""
        return self.config.job_id

    def set_state(self, state: str, error: str = "") -> None:
        """Moves the state machine and wakes followers."""
        with self.cond:
            self.state, self.error = state, error or self.error
            self.cond.notify_all()


@dataclass
class Ranks:
    """Stubs of a job's ranks, by rank."""

    workers: list[WorkerRecord]
    stubs: list[worker_pb2_grpc.StageWorkerStub]
    channels: list[grpc.Channel]
    closed: bool = False  # a restart or a move closed them: nothing to drain through them

    @classmethod
    def connect(cls, workers: list[WorkerRecord]) -> Ranks:
        """Opens a channel to every rank."""
        channels = [server.channel(w.address) for w in workers]
        return cls(workers, [worker_pb2_grpc.StageWorkerStub(c) for c in channels], channels)

    def describe(self, rank: int) -> str:
        """Names a rank's worker for error messages."""
        w = self.workers[rank]
        return f"worker {w.worker_id} ({w.name}, {w.address}, rank {rank})"

    def close(self) -> None:
        """Closes every channel (once; later calls do nothing)."""
        for c in self.channels:
            c.close()
        self.channels = []
        self.closed = True


class Driver:
    """Runs each submitted job in its own thread."""

    def __init__(self, registry: Registry, store_address: str,
                 worker_wait_seconds: float = 120.0, cluster: Cluster | None = None,
                 metrics: CoordinatorMetrics | None = None, checkpoint_root: str = "",
                 rendezvous_host: str = "127.0.0.1", rendezvous_advertise: str = "",
                 rendezvous_port: int = 0, journal: Journal | None = None) -> None:
        self.registry, self.store_address = registry, store_address
        self.journal = journal or Journal(None)  # unfinished jobs, for a restarted coordinator
        self.worker_wait_seconds = worker_wait_seconds
        self.cluster = cluster  # what plan "auto" assumes of links, store and caps
        self.metrics = metrics  # sees every job's start and step reports
        self.checkpoint_root = checkpoint_root  # jobs' checkpoint directories lie inside
        # where the all-reduce rendezvous of multi-group jobs listens and how workers reach
        # it; opened by the first such job, shared by all (keys are per job and attempt)
        self.rendezvous_at = (rendezvous_host, rendezvous_advertise or rendezvous_host,
                              rendezvous_port)
        self._rendezvous: Rendezvous | None = None
        self._rendezvous_lock = threading.Lock()
        self.draining = threading.Event()  # SIGTERM: jobs pause, checkpoint and stay journaled
        self.profiles = ProfileCache()  # workers' Profile replies ([Note: profile reuse])
        self._threads: list[threading.Thread] = []

    def rendezvous(self) -> str:
        """host:port of the all-reduce rendezvous, opened on first use."""
        with self._rendezvous_lock:
            if self._rendezvous is None:
                self._rendezvous = Rendezvous(*self.rendezvous_at)
            return self._rendezvous.address

    def start(self, job: Job) -> None:
        """Journals the job and starts its thread."""
        self._record(job)
        thread = threading.Thread(target=self.run, args=(job,), name=f"job-{job.job_id}",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()

    def drain_all(self, timeout: float) -> None:
        """Pauses every running job at its next step boundary (the coordinator is stopping):
        each one's issued steps end, a job that takes checkpoints writes one at that step,
        and it stays in the journal for the next coordinator. Waits up to `timeout` s."""
        self.draining.set()
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        still = [t.name for t in self._threads if t.is_alive()]
        if still:
            log.warning("stopping with jobs still running: %s", ", ".join(still))

    def run(self, job: Job) -> None:
        """The job's whole life; never raises (failures land in the job's state).

        [Note: first failure] applies: the first failure is kept, every rank is drained
        (which waits, bounded, for running steps to stop), and only then are the job's
        stash keys deleted, so no late stash outlives the job.
        """
        ranks: Ranks | None = None
        final: tuple[str, str] | None = None  # the state and message it ends with
        if self.metrics is not None:
            self.metrics.job_started(job.job_id)
        try:
            job.workers = self._wait_for_workers(job)
            while True:
                ranks = Ranks.connect(job.workers)
                try:
                    self._plan_and_assign(job, ranks)
                    self._run_steps(job, ranks)
                    break
                except Repartitioned:
                    self._switch_plan(job, ranks)
                    ranks = None
                except RECOVERABLE as error:
                    if len(job.restarts) >= job.config.max_restarts or job.stop_requested:
                        raise
                    self._restart(job, ranks, error)
                    ranks = None
            if job.costs is not None and job.reports:
                self._fit_in_situ(job)
            if job.state == "RUNNING":
                job.weights = self._collect_weights(job, ranks)
                self._check_store_empty(job)
                if job.attempt:  # late stashes of a worker stopped in an earlier attempt
                    self._clear_store(job)
                job.set_state("DONE")
        except Stopped as stopped:
            final = ("STOPPED", str(stopped))
        except Drained as paused:
            log.info("job %s paused: %s", job.job_id, paused)
            final = ("PENDING", str(paused))
        except Exception as error:
            dead = self._dead_ranks(ranks) if ranks is not None else []
            message = self._diagnose(error, ranks, dead)
            self._forget(ranks, dead)
            if job.restarts:
                message = f"{message} (gave up after {len(job.restarts)} restarts)"
            log.error("job %s failed: %s", job.job_id, message)
            final = ("FAILED", message)
        finally:  # the state a follower sees last: cleanup is done when it changes
            state = final[0] if final else job.state
            if ranks is not None and not ranks.closed:
                self._drain(job, ranks, reason=state)
                ranks.close()
            if state in ("FAILED", "STOPPED"):
                self._clear_store(job)
            if final:
                job.set_state(*final)
            if job.state in TERMINAL:
                self.journal.finish(job.job_id)
            self.registry.release(job.job_id)

    def _record(self, job: Job) -> None:
        """Journals what a restarted coordinator needs to resume the job."""
        self.journal.record(Entry(job.config, job.plan, job.attempt, job.checkpointed,
                                  list(job.restarts)))

    def _wait_for_workers(self, job: Job) -> list[WorkerRecord]:
        deadline = time.monotonic() + self.worker_wait_seconds
        while not job.stop_requested:
            if self.draining.is_set():
                raise Drained("the coordinator stopped before the job had its workers")
            got = self.registry.acquire(job.config.workers, job.job_id)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                alive = sum(self.registry.alive(w) for w in self.registry.workers())
                raise WorkerFailed(f"job needs {job.config.workers} idle workers; "
                                   f"{alive} alive after {self.worker_wait_seconds:.0f} s")
            time.sleep(0.1)
        raise Stopped("stopped before it started")

    def _plan_and_assign(self, job: Job, ranks: Ranks) -> None:
        job.set_state("PLANNING")
        cfg = job.config
        if cfg.checkpoint_every or cfg.resume or (cfg.checkpoint_dir and self.checkpoint_root):
            job.checkpoints = resolve_under(self.checkpoint_root, cfg.checkpoint_dir)
        if job.migrating_from is not None:
            plan = job.plan  # [Note: migration]: the new plan, from the paused step
            job.start_step = job.step
        elif job.attempt and job.plan is not None:
            plan = job.plan  # a replay runs the same plan from its checkpoint
            job.start_step = self._replay_point(job)
        elif cfg.resume:
            plan = self._resume_point(job)
            job.first_step = job.start_step
        elif cfg.plan == AUTO:
            plan = self._auto_plan(job, ranks)
        else:
            plan = balanced_plan(cfg.schedule, cfg.workers, job.layer_costs, cfg.batch_size,
                                 cfg.microbatches, layer_policies(cfg, len(job.layer_costs)),
                                 cfg.mode, cfg.staleness, cfg.groups)
        schedule_for(plan)  # refuses a plan whose schedule fails validation or deadlocks
        job.plan = plan
        self._record(job)
        if job.migrating_from is None:
            self._assign_all(job, ranks)
        else:
            self._migrate(job, ranks)
        job.set_state("RUNNING")

    def _assign_all(self, job: Job, ranks: Ranks, fail_ranks: Iterable[int] = ()
                    ) -> list[worker_pb2.AssignReply]:
        """Assigns every rank the job's plan and attempt, from its start step (and from
        the paused attempt, during a migration)."""
        assert job.plan is not None
        spec, plan_msg = job_to_proto(job.config), plan_to_proto(job.plan)
        peers = [w.address for w in ranks.workers]
        rendezvous = self.rendezvous() if job.plan.groups > 1 else ""
        source = None
        if job.migrating_from is not None:
            old, attempt = job.migrating_from
            source = worker_pb2.MigrationSource(plan=plan_to_proto(old), attempt=attempt)
        failing = set(fail_ranks)
        calls = []
        for r, stub in enumerate(ranks.stubs):
            request = worker_pb2.AssignRequest(
                job=spec, plan=plan_msg, rank=r, peers=peers, store_address=self.store_address,
                rendezvous=rendezvous, resume_step=job.start_step, attempt=job.attempt)
            if source is not None:
                request.source.CopyFrom(source)
                request.source.fail = r in failing
            calls.append(stub.Assign.future(request, timeout=300))
        return _wait_all(calls, ranks)

    def _migrate(self, job: Job, ranks: Ranks) -> None:
        """Assigns the new plan from the paused attempt; on a failure, the old plan from
        the same source ([Note: migration]). A failed rollback is the job's failure (and
        its restart from the newest checkpoint, with `max_restarts`)."""
        assert job.migrating_from is not None
        move = job.migrations[-1]
        try:
            replies = self._assign_all(job, ranks, job.fail_ranks)
        except WorkerFailed as error:
            log.warning("job %s: the move at step %d failed, rolling back: %s", job.job_id,
                        job.step, error)
            move["rolled_back"] = str(error)
            job.plan = job.migrating_from[0]
            job.attempt += 1
            self._record(job)
            replies = self._assign_all(job, ranks)
        finally:  # a failed rollback restarts the job from its checkpoint, not a move
            job.fail_ranks, job.migrating_from = (), None
        move["bytes"] = sum(r.migrated_bytes for r in replies)
        move["seconds"] = time.monotonic() - move.pop("_t0")
        if job.replanner is not None:
            job.replanner.moved(move["seconds"])
        if self.metrics is not None:
            self.metrics.migration_done(job.job_id, move["bytes"], move["seconds"])
        log.info("job %s: %s in %.2f s: %s", job.job_id,
                 "rolled back" if "rolled_back" in move else "migrated", move["seconds"], move)

    def _resume_point(self, job: Job) -> Plan:
        """The newest checkpoint's plan; sets the job's start step to its step.

        Raises:
            ConfigError: no checkpoint, one of another job (naming the first field that
                differs), another worker count, or one at or past the job's last step.
        """
        assert job.checkpoints is not None
        found = latest(job.checkpoints)
        if found is None:
            raise ConfigError(f"no checkpoint to resume from in {job.config.checkpoint_dir!r}")
        step, state = found
        saved, mine = state.get("job", {}), job.config.to_dict()
        for key in sorted(set(saved) | set(mine)):
            if key not in RESUME_MAY_CHANGE and saved.get(key) != mine.get(key):
                raise ConfigError(f"checkpoint of step {step} is of another job: {key} "
                                  f"{saved.get(key)!r} there, {mine.get(key)!r} here")
        plan = Plan.from_dict(state["plan"])
        if step >= job.config.steps:
            raise ConfigError(f"the checkpoint is at step {step}; the job has "
                              f"{job.config.steps} steps")
        job.start_step = job.step = step
        return plan

    def _replay_point(self, job: Job) -> int:
        """The step a replay starts from: the newest checkpoint of this job at or before
        its last reported step (a sync job's), else step 0."""
        if job.checkpoints is None or job.config.mode != "sync":
            return 0
        found = latest(job.checkpoints, at_most=job.step)
        if found is None:
            return 0
        step, state = found
        saved, mine = state.get("job", {}), job.config.to_dict()
        if any(saved.get(k) != mine.get(k) for k in set(saved) | set(mine)
               if k not in RESUME_MAY_CHANGE):
            log.warning("job %s: the checkpoint of step %d is of another job; replaying "
                        "from step 0", job.job_id, step)
            return 0
        return step

    def _restart(self, job: Job, ranks: Ranks, error: Exception) -> None:
        """Ends a failed attempt and readies the next ([Note: restarts]): drains the ranks
        that answer, clears the stash, waits for the store and for replacements of the
        dead ranks, and counts the restart."""
        dead = self._dead_ranks(ranks)
        message = self._diagnose(error, ranks, dead)
        log.warning("job %s: attempt %d failed: %s; restarting (%d of %d)", job.job_id,
                    job.attempt, message, len(job.restarts) + 1, job.config.max_restarts)
        with job.cond:
            job.restarts.append(message)
        job.set_state("RECOVERING")
        self._drain(job, ranks, skip=dead)
        ranks.close()
        if self.metrics is not None:
            self.metrics.restarted(job.job_id)
        self._wait_for_store(job)
        self._clear_store(job)
        job.workers = self._replace(job, ranks, dead)
        job.attempt += 1
        self._record(job)

    def _replace(self, job: Job, ranks: Ranks, dead: list[int]) -> list[WorkerRecord]:
        """The job's workers with each dead rank's replaced: by a worker of the same name
        if one registers, else by any idle one; waits up to `worker_wait_seconds`.

        Raises:
            WorkerFailed: a dead rank found no replacement in time (names them).
            Stopped: StopJob arrived while waiting.
        """
        workers = list(job.workers)
        self._forget(ranks, dead)
        missing = set(dead)
        deadline = time.monotonic() + self.worker_wait_seconds
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
            self._check_interrupted(job, "while it waited for workers")
            if time.monotonic() > deadline:
                names = ", ".join(ranks.describe(r) for r in sorted(missing))
                raise WorkerFailed(f"no worker replaced {names} within "
                                   f"{self.worker_wait_seconds:.0f} s")
            time.sleep(0.1)
        return workers

    def _check_interrupted(self, job: Job, where: str) -> None:
        """Raises Stopped after StopJob, Drained while the coordinator stops."""
        if job.stop_requested:
            raise Stopped(f"stopped {where}")
        if self.draining.is_set():
            raise Drained(f"the coordinator stopped {where}")

    def _forget(self, ranks: Ranks | None, dead: list[int]) -> None:
        """Drops dead ranks' workers from the registry: no later job may take them before
        their heartbeats time out (a relaunched process registers anew)."""
        for r in dead:
            assert ranks is not None
            self.registry.forget(ranks.workers[r].worker_id)
            self.profiles.forget(ranks.workers[r].address)

    def _wait_for_store(self, job: Job) -> None:
        """Waits until the offload store answers (a restarted one comes back empty).

        Raises:
            WorkerFailed: it did not answer within `worker_wait_seconds`.
            Stopped, Drained: StopJob arrived, or the coordinator is stopping.
        """
        deadline = time.monotonic() + self.worker_wait_seconds
        client = fail_fast_client(self.store_address)
        try:
            while True:
                try:
                    client.ping()
                    return
                except RedisError as error:
                    self._check_interrupted(job, "while the store was away")
                    if time.monotonic() > deadline:
                        raise WorkerFailed(f"the offload store at {self.store_address} did "
                                           f"not come back: {error}") from None
                    time.sleep(0.2)
        finally:
            client.close()

    def _auto_plan(self, job: Job, ranks: Ranks) -> Plan:
        """Profiles the layers on the job's workers (one after another), then searches
        and simulates (pipefb.planner.job); the search's summary goes into the job status.
        A worker asked the same before answers from the cache ([Note: profile reuse])."""
        cfg = job.config
        names = [w.address for w in ranks.workers]
        profile, speeds, reused = profile_workers(ranks.stubs, cfg, cfg.microbatch_size,
                                                  cache=(self.profiles, names))
        base = self.cluster or Cluster.uniform(cfg.workers)
        cluster = job_cluster(base, cfg.workers, speeds, cfg.memory_cap)
        result = plan_job(cfg, profile, cluster)
        job.costs = (profile, cluster)
        job.planner = {**summary(result), "profile": profile.to_dict(),
                       "speeds": speeds, "profiles_reused": reused}
        log.info("job %s: planned %s, predicted %.2f ms/step (%d of %d workers' profiles "
                 "reused)", job.job_id, label(result), result.best.step_seconds * 1e3, reused,
                 len(names))
        return result.plan

    def _run_steps(self, job: Job, ranks: Ranks) -> None:
        def on_step(step: int, replies: list[worker_pb2.StepReply], seconds: float) -> None:
            report = _report(job, step, seconds, replies, ranks)
            check_groups_agree(report)
            if step < job.step:  # a replay ([Note: restarts]): reported before
                _compare_replay(job, report)
                return
            self._consider_move(job, report)
            every = job.config.eval_every
            if every and (step + 1) % every == 0 and step + 1 < job.config.steps:
                report.eval.update(self._evaluate(job, ranks, step + 1))
            if job.checkpoints is not None and pump.checkpointed_after(step):
                assert job.plan is not None
                write_state(job.checkpoints, step + 1, {"job": job.config.to_dict(),
                                                        "plan": job.plan.to_dict()})
                job.checkpointed = step + 1
                self._record(job)
            if self.metrics is not None:
                self.metrics.step_done(report, job.planner.get("predicted_step_seconds", 0.0))
            with job.cond:
                job.reports.append(report)
                job.step = step + 1
                job.cond.notify_all()

        assert job.plan is not None
        if job.config.replan:
            self._watch(job)
        # async forward ranks may run `staleness` steps ahead of the backward ranks
        pump = StepPump(job.job_id, ranks.stubs, job.config.steps, on_step,
                        in_flight=IN_FLIGHT + job.plan.staleness, start=job.start_step,
                        checkpoint_every=job.config.checkpoint_every, attempt=job.attempt)

        store = StoreWatch(self.store_address)

        def poll() -> None:
            if job.stop_requested or self.draining.is_set() or job.pending_plan is not None:
                pump.stop()
            _check_heartbeats(self.registry, ranks, range(len(ranks.workers)))
            store.check(every=STORE_CHECK_SECONDS)

        with job.cond:
            job.pump = pump
        try:
            failures = pump.run(poll)
            if failures:
                store.check()  # a lost store is the root cause of the ranks' failures
        finally:
            with job.cond:
                job.pump = None
                job.cond.notify_all()
            store.close()
        if failures:
            raise _first_failure(failures, ranks)
        if job.step < job.config.steps and self.draining.is_set():
            self._checkpoint_now(job, ranks)
            raise Drained(f"the coordinator stopped after step {job.step}; a coordinator "
                          f"on the same journal resumes from step {job.checkpointed}")
        if job.step < job.config.steps and job.pending_plan is not None and (
                not job.stop_requested):
            raise Repartitioned(job.job_id)
        if job.step < job.config.steps:
            raise Stopped("stopped by request")

    def repartition(self, job: Job, forward: list[int], backward: list[int],
                    fail_ranks: Iterable[int] = ()) -> None:
        """Asks a running job to move to new partitions at its next step boundary (see
        `_switch_plan`); `fail_ranks` inject a failure of the move on those ranks (tests).

        Raises:
            FailedPrecondition: the job is not running, is not sync, or has a move pending.
            ConfigError: the partitions are bad for this job (pipefb.plan.migration), or a
                fault names no rank of it.
        """
        with job.cond:
            if job.state != "RUNNING" or job.plan is None:
                raise FailedPrecondition(f"job {job.job_id} is {job.state}; only a running "
                                         "job can be repartitioned")
            bad = sorted(set(fail_ranks) - set(range(len(job.plan.assignment))))
            if bad:
                raise ConfigError(f"fail_ranks {bad} are not ranks of job {job.job_id}")
            if job.pending_plan is not None:
                raise FailedPrecondition(f"job {job.job_id} has a repartition pending")
            if job.config.mode != "sync":
                raise FailedPrecondition(f"job {job.job_id} is {job.config.mode}; only sync "
                                         "jobs move layers (a checkpoint holds no old "
                                         "weight versions)")
            job.pending_plan = repartitioned(job.plan, forward, backward)
            job.fail_ranks = tuple(fail_ranks)

    def checkpoint(self, job: Job, timeout: float) -> int:
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

    def _watch(self, job: Job) -> None:
        """Starts (or, on a new plan, restarts) the job's re-planner ([Note: online
        re-planning] in pipefb/planner/replan.py): layer costs from the profile of plan "auto",
        else the placeholder costs (a backward twice its forward); move cost over the
        cluster's worker-to-worker network (layers move rank to rank)."""
        assert job.plan is not None
        if job.replanner is not None:
            job.replanner.reset(job.plan)
            return
        if job.costs is not None:
            profile = job.costs[0]
            forward = [layer.forward_seconds for layer in profile.layers]
            backward = [layer.backward_seconds for layer in profile.layers]
            state = profile.optimizer_state_ratio
            sizes = {i: (layer.param_bytes, int(layer.param_bytes * state))
                     for i, layer in enumerate(profile.layers)}
        else:  # 1 + parameter count per layer; fp32 weights, AdamW keeps two moments
            forward, backward = job.layer_costs, [2 * c for c in job.layer_costs]
            state = 2 if job.config.optimizer == "adamw" else 1
            sizes = {i: (4 * int(c - 1), 4 * state * int(c - 1))
                     for i, c in enumerate(job.layer_costs)}
        bandwidth = (self.cluster.network.bandwidth if self.cluster
                     else ReplanSettings().bandwidth)
        job.replanner = Replanner(job.plan, forward, backward, sizes,
                                  ReplanSettings(bandwidth=bandwidth))

    def _consider_move(self, job: Job, report: coordinator_pb2.StepReport) -> None:
        """With `replan`: feeds the step's compute times to the re-planner; a decision
        becomes the job's pending plan, taken at the next step boundary."""
        if job.replanner is None or job.pending_plan is not None:
            return
        first = [w for w in report.workers if w.group == 0]
        decision = job.replanner.observe({w.rank: w.compute_seconds for w in first},
                                         steps_left=job.config.steps - report.step - 1,
                                         layers={w.rank: dict(w.layer_seconds) for w in first})
        if decision is None:
            return
        log.info("job %s: re-planning after step %d: %.1f ms/step measured, %.1f ms "
                 "predicted on forward %s backward %s (move %.1f ms)", job.job_id,
                 report.step, decision.current_seconds * 1e3, decision.new_seconds * 1e3,
                 list(decision.plan.forward_partition),
                 list(decision.plan.backward_partition), decision.move_seconds * 1e3)
        with job.cond:
            job.pending_plan = decision.plan

    def _switch_plan(self, job: Job, ranks: Ranks) -> None:
        """[Note: migration] The job paused at step v with every issued step done; the
        next assignment gives every rank the new plan with attempt + 1 and the paused
        attempt as its source (`_assign_all`): each rank keeps what it held and takes the
        rest from the old owners' paused state over the workers' `Migrate` stream
        ([Note: migration, worker side] in worker/takeover.py), so the forward and backward
        ranks switch together at step v and losses and weights go on exactly as without
        the move (sync). If any rank fails the move, every rank is assigned the old plan
        with attempt + 2 from the same source: the move rolls back and nothing is lost."""
        assert job.plan is not None and job.pending_plan is not None
        new = job.pending_plan
        job.migrations.append({
            "step": job.step, "forward_partition": list(new.forward_partition),
            "backward_partition": list(new.backward_partition), "_t0": time.monotonic()})
        job.set_state("MIGRATING")
        ranks.close()
        job.migrating_from = (job.plan, job.attempt)
        job.plan, job.pending_plan = new, None
        job.attempt += 1
        self._record(job)
        if self.metrics is not None:
            self.metrics.migrated(job.job_id)

    def _checkpoint_now(self, job: Job, ranks: Ranks) -> None:
        """Between steps: every owner saves its rank file of `job.step` (the Checkpoint
        RPC), then the job's state commits it; nothing when the job takes no checkpoints
        or has one of this step."""
        if job.checkpoints is None or job.checkpointed == job.step or job.plan is None:
            return
        calls = [stub.Checkpoint.future(worker_pb2.CheckpointRequest(
            job_id=job.job_id, attempt=job.attempt, step=job.step), timeout=60)
            for stub in ranks.stubs]
        _wait_all(calls, ranks)
        write_state(job.checkpoints, job.step, {"job": job.config.to_dict(),
                                                "plan": job.plan.to_dict()})
        job.checkpointed = job.step
        self._record(job)

    def _fit_in_situ(self, job: Job) -> None:
        """Fits the plan's costs to the action times of steps 1-8 (pipefb.planner.insitu; fewer
        if the job had fewer); the factors and refined step time go into the planner
        summary. It runs after the last step: on a shared machine, simulating mid-run
        would take cores from the workers and disturb the steps it explains."""
        assert job.costs is not None and job.plan is not None
        reports = job.reports[IN_SITU_STEPS.start:IN_SITU_STEPS.stop] or job.reports
        # the simulation runs the first group (every group runs the same program)
        measured = median_action_seconds([[w.action_seconds for w in r.workers if w.group == 0]
                                          for r in reports])
        try:
            refined = fit(job.plan, *job.costs, measured)
        except (ScheduleError, ConfigError, ValueError) as error:  # explains; never fails a job
            log.warning("job %s: in-situ fit failed: %s", job.job_id, error)
            return
        with job.cond:
            job.planner["in_situ"] = {**refined.to_dict(), "steps": len(reports)}
        log.info("job %s: in-situ factors %s, refined %.2f ms/step", job.job_id,
                 refined.factors, refined.step_seconds * 1e3)

    def _collect_weights(self, job: Job, ranks: Ranks, version: int = 0
                         ) -> dict[str, torch.Tensor]:
        """The whole model's weights from the ranks that own them (0: the current ones)."""
        weights: dict[str, torch.Tensor] = {}
        # every group holds the same weights (summed gradients): group 0's are the model's
        owners = ({a.rank for a in job.plan.assignment if a.role != "forward" and a.group == 0}
                  if job.plan else set())
        for rank in sorted(owners):
            stream = ranks.stubs[rank].ExportWeights(
                job_pb2.ExportWeightsRequest(job_id=job.job_id, version=version), timeout=120)
            weights.update(wire.decode_stream(stream)[1])
        return weights

    def _evaluate(self, job: Job, ranks: Ranks, version: int) -> dict[str, float]:
        """Held-out metrics of weight version `version` (kept by the owners for this)."""
        started = time.perf_counter()
        try:
            metrics = evaluate(job.config, self._collect_weights(job, ranks, version))
        except (grpc.RpcError, ConfigError) as error:  # training goes on without this report
            log.warning("job %s: no held-out evaluation of version %d: %s", job.job_id,
                        version, error)
            return {}
        log.info("job %s version %d held-out %s (%.2f s)", job.job_id, version, metrics,
                 time.perf_counter() - started)
        return metrics

    def _check_store_empty(self, job: Job) -> None:
        left = self._store(job).count_keys()
        if left:
            log.warning("job %s left %d keys in the offload store", job.job_id, left)

    def _clear_store(self, job: Job) -> None:
        try:
            self._store(job).clear_job()
        except Exception as error:
            log.warning("could not clear the store of job %s: %s", job.job_id, error)

    def _store(self, job: Job) -> OffloadStore:
        """The job's stash, through a client that fails at once when the store is down
        (no retries): a job's end must not wait on a dead store."""
        return OffloadStore(fail_fast_client(self.store_address), job.job_id)

    def _drain(self, job: Job, ranks: Ranks, skip: Iterable[int] = (), reason: str = ""
               ) -> None:
        """Drains every rank at once but those in `skip` (dead: nothing to drain)."""
        request = worker_pb2.DrainRequest(job_id=job.job_id, reason=reason or job.state,
                                          attempt=job.attempt)
        calls = [stub.Drain.future(request, timeout=DRAIN_TIMEOUT_SECONDS)
                 for r, stub in enumerate(ranks.stubs) if r not in set(skip)]
        for call in calls:
            with contextlib.suppress(grpc.RpcError):
                call.result()

    def _dead_ranks(self, ranks: Ranks) -> list[int]:
        """The ranks whose worker does not answer a health check within a second."""
        return [r for r in range(len(ranks.workers)) if not _answers(ranks.workers[r].address)]

    def _diagnose(self, error: Exception, ranks: Ranks | None,
                  dead: list[int] | None = None) -> str:
        if ranks is None:
            return str(error)
        dead = self._dead_ranks(ranks) if dead is None else dead
        if dead:
            return f"{', '.join(ranks.describe(r) for r in dead)} died: {error}"
        return str(error)


def fail_fast_client(address: str, retries: int = 0) -> Any:
    """A client of the store for the coordinator's own calls: short timeouts and few
    retries, none waited for, so a dead store shows at once (the workers' clients keep
    redis-py's backoff)."""
    return connect(address, retry=Retry(NoBackoff(), retries),
                   socket_timeout=STORE_TIMEOUT_SECONDS,
                   socket_connect_timeout=STORE_TIMEOUT_SECONDS)


class StoreWatch:
    """Notices a lost offload store during a run: its Redis run id changes when it restarts
    (empty), and INFO fails while it is down."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._client = fail_fast_client(address, retries=2)  # a blip must not fail a job
        self._run_id = self._read()
        self._checked = time.monotonic()

    def _read(self) -> str:
        try:
            return str(self._client.info("server")["run_id"])
        except (RedisError, KeyError) as error:
            raise WorkerFailed(f"the offload store at {self.address} does not answer: "
                               f"{error}") from None

    def check(self, every: float = 0.0) -> None:
        """Raises WorkerFailed if the store restarted or does not answer; with `every`,
        asks only if the last check is that many seconds old."""
        if every and time.monotonic() - self._checked < every:
            return
        self._checked = time.monotonic()
        now = self._read()
        if now != self._run_id:
            raise WorkerFailed(f"the offload store at {self.address} restarted (run id "
                               f"{self._run_id[:8]} -> {now[:8]}): the stash of steps in "
                               "flight is lost")

    def close(self) -> None:
        """Closes the client."""
        self._client.close()


def _compare_replay(job: Job, report: coordinator_pb2.StepReport) -> None:
    """A replayed step's loss against the one reported before: equal in sync mode."""
    index = report.step - job.first_step
    if not 0 <= index < len(job.reports):  # reported by an earlier coordinator
        return
    before = job.reports[index].loss
    if job.config.mode == "sync" and before != report.loss and before == before:
        log.warning("job %s: replayed step %d has loss %r, reported before %r", job.job_id,
                    report.step, report.loss, before)


def _answers(address: str) -> bool:
    """Whether the worker at `address` answers a health check within a second."""
    with server.channel(address) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return True
        except grpc.RpcError:
            return False


def _wait_all(calls: list[grpc.Future], ranks: Ranks) -> list[Any]:
    """Waits for one call per rank; any failure becomes the job's error."""
    done = threading.Event()
    remaining = [len(calls)]
    lock = threading.Lock()

    def finished(_: grpc.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0 or _.exception() is not None:
                done.set()

    for call in calls:
        call.add_done_callback(finished)
    done.wait()
    failures = [(r, c.exception()) for r, c in enumerate(calls)
                if c.done() and c.exception() is not None]
    if failures:
        raise _first_failure(failures, ranks)
    return [c.result() for c in calls]


def _first_failure(failures: list[tuple[int, Any]], ranks: Ranks) -> WorkerFailed:
    """The root cause among failed calls: a rank that aborted was only waiting on another."""
    rank, error = sorted(failures, key=lambda f: f[1].code() == grpc.StatusCode.ABORTED)[0]
    return WorkerFailed(f"{ranks.describe(rank)} failed: {error.code().name}: {error.details()}")


def _check_heartbeats(registry: Registry, ranks: Ranks, pending: Iterable[int]) -> None:
    known = {w.worker_id: w for w in registry.workers()}
    for r in pending:
        rec = known.get(ranks.workers[r].worker_id)
        if rec is None or not registry.alive(rec):
            raise WorkerFailed(f"{ranks.describe(r)} stopped sending heartbeats")


def _report(job: Job, step: int, seconds: float, replies: list[worker_pb2.StepReply],
            ranks: Ranks) -> coordinator_pb2.StepReport:
    losses = [loss for reply in replies for loss in reply.losses]
    assert job.plan is not None
    stats = [coordinator_pb2.WorkerStepStats(
        rank=a.rank, worker_id=ranks.workers[a.rank].worker_id, role=a.role, stage=a.stage,
        group=a.group,
        compute_seconds=rep.compute_seconds, idle_seconds=rep.idle_seconds,
        peak_memory_bytes=rep.peak_memory_bytes, memory_bytes=rep.memory_bytes,
        bytes_sent=rep.bytes_sent, bytes_stashed=rep.bytes_stashed,
        action_seconds=rep.action_seconds, spans=rep.spans, versions=rep.versions,
        kept_versions=rep.kept_versions, weight_version=rep.weight_version,
        kind_peak_bytes=rep.kind_peak_bytes, activation_peak_bytes=rep.activation_peak_bytes,
        device_memory_bytes=rep.device_memory_bytes, weights_digest=rep.weights_digest,
        layer_seconds=rep.layer_seconds)
        for a, rep in zip(job.plan.assignment, replies, strict=True)]
    report = coordinator_pb2.StepReport(
        job_id=job.job_id, step=step, loss=statistics.fmean(losses) if losses else float("nan"),
        seconds=seconds, samples_per_second=job.config.batch_size / seconds, workers=stats,
        attempt=job.attempt)
    moves = [m for m in job.migrations if m["step"] == step and "seconds" in m]
    if moves:
        report.migration.CopyFrom(migration_proto(moves[-1]))
    return report


def migration_proto(move: dict[str, Any]) -> coordinator_pb2.Migration:
    """A migration record of `Job.migrations` as its message."""
    return coordinator_pb2.Migration(**{k: v for k, v in move.items() if not k.startswith("_")})


def check_groups_agree(report: coordinator_pb2.StepReport) -> None:
    """Every group's copy of each backward stage holds the same weights after the step.

    Steps off the job's `check_groups_every` cadence carry no digest; on it, every weight
    owner (a backward or combined rank) sends one.

    Raises:
        WorkerFailed: two groups' digests differ, or an owner sent none where another did;
            names the step, stage and ranks.
    """
    owners = [w for w in report.workers if w.role != "forward"]
    sent = [w for w in owners if w.weights_digest]
    missing = [w for w in owners if not w.weights_digest]
    if sent and missing:
        raise WorkerFailed(f"groups unchecked at step {report.step}: rank {missing[0].rank} "
                           f"(group {missing[0].group}, stage {missing[0].stage}) sent no "
                           f"weights digest, rank {sent[0].rank} did")
    first: dict[int, coordinator_pb2.WorkerStepStats] = {}
    for w in sent:
        seen = first.setdefault(w.stage, w)
        if seen.weights_digest != w.weights_digest:
            raise WorkerFailed(f"groups diverged at step {report.step}: stage {w.stage} "
                               f"weights of rank {seen.rank} (group {seen.group}) and rank "
                               f"{w.rank} (group {w.group}) differ")
