"""Drives a job: waits for workers, plans, assigns ranks, runs steps, collects weights.

[Note: first failure] A step runs on every rank at once. When one rank fails, the others
block on it; the driver keeps the first failure, probes which workers are still alive to
name a dead one, drains the rest (which aborts their waits), clears the job's stash keys
and fails the job with that message. With `max_restarts` the attempt is replayed instead
([Note: restarts] in coordinator/recovery.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable

from coordinator.assign import acquire_workers, assign_all, auto_plan, balanced
from coordinator.checkpoints import (
    checkpoint_dir,
    checkpoint_now,
    commit,
    rank_files,
    request_checkpoint,
)
from coordinator.jobs import TERMINAL, Drained, Job, Repartitioned, Stopped
from coordinator.journal import Journal
from coordinator.metrics import CoordinatorMetrics
from coordinator.profiling import ProfileCache
from coordinator.ranks import Ranks, check_heartbeats, dead_ranks, diagnose, drain, first_failure
from coordinator.recovery import RECOVERABLE, Recovery, compare_replay, replay_point, resume_point
from coordinator.registry import Registry
from coordinator.rendezvous import Rendezvous
from coordinator.reshape import consider_move, migrate, repartition, switch_plan, watch
from coordinator.results import (
    check_finite_loss,
    check_groups_agree,
    check_ties_agree,
    collect_weights,
    evaluate_version,
    fit_in_situ,
    step_report,
)
from coordinator.stepping import IN_FLIGHT, StepPump
from coordinator.storewatch import (
    STORE_CHECK_SECONDS,
    StoreWatch,
    check_store_empty,
    clear_store,
    drop_store_user,
    grant_store_user,
)
from pipefb.job.config import AUTO
from pipefb.plan.plan import Plan, schedule_for
from pipefb.sim.cluster import Cluster
from protos import worker_pb2

_DEFECTS = (ValueError, RuntimeError, TypeError, KeyError, IndexError, AttributeError,
            AssertionError, ZeroDivisionError)  # exactly these types, not their subclasses

log = logging.getLogger(__name__)


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
        self.recovery = Recovery(registry, self.profiles, store_address, worker_wait_seconds,
                                 self.draining, self.journal, metrics)
        self._threads: list[threading.Thread] = []

    def rendezvous(self) -> str:
        """host:port of the all-reduce rendezvous, opened on first use."""
        with self._rendezvous_lock:
            if self._rendezvous is None:
                self._rendezvous = Rendezvous(*self.rendezvous_at)
            return self._rendezvous.address

    def start(self, job: Job) -> None:
        """Journals the job and starts its thread."""
        self.journal.record(job.entry())
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

    def repartition(self, job: Job, forward: list[int], backward: list[int],
                    fail_ranks: Iterable[int] = ()) -> None:
        """Asks a running job to move to new partitions at its next step boundary
        (coordinator.reshape.repartition, which names what it raises)."""
        repartition(job, forward, backward, fail_ranks)

    def checkpoint(self, job: Job, timeout: float) -> int:
        """Checkpoints a running job at its next step boundary; returns the committed
        checkpoint's step (coordinator.checkpoints.request_checkpoint, which names what
        it raises)."""
        return request_checkpoint(job, timeout)

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
            job.workers = acquire_workers(self.registry, job, self.worker_wait_seconds,
                                          self.draining)
            while True:
                ranks = Ranks.connect(job.workers)
                try:
                    self._plan_and_assign(job, ranks)
                    self._run_steps(job, ranks)
                    break
                except Repartitioned:
                    switch_plan(job, ranks, self.journal, self.metrics)
                    ranks = None
                except RECOVERABLE as error:
                    if len(job.restarts) >= job.config.max_restarts or job.stop_requested:
                        raise
                    self.recovery.restart(job, ranks, error)
                    ranks = None
            final = self._finish(job, ranks)
        except Stopped as stopped:
            final = ("STOPPED", str(stopped))
        except Drained as paused:
            log.info("job %s paused: %s", job.job_id, paused)
            final = ("PENDING", str(paused))
        except Exception as error:
            final = ("FAILED", self._failure(job, ranks, error))
        finally:
            self._end(job, ranks, final)

    def _finish(self, job: Job, ranks: Ranks) -> tuple[str, str] | None:
        """After the last step: the in-situ fit, the model's weights, the store's check;
        the state the job ends with (DONE, set by `_end` once the ranks are drained)."""
        if job.costs is not None and job.reports:
            fit_in_situ(job)
        if job.state != "RUNNING":
            return None
        job.weights = collect_weights(job, ranks)
        check_store_empty(self.store_address, job.job_id)
        if job.attempt:  # late stashes of a worker stopped in an earlier attempt
            clear_store(self.store_address, job.job_id)
        return ("DONE", "")

    def _failure(self, job: Job, ranks: Ranks | None, error: Exception) -> str:
        """The failed job's message, naming dead ranks, whose workers are forgotten."""
        dead = dead_ranks(ranks) if ranks is not None else []
        message = diagnose(error, ranks, dead)
        self.recovery.forget(ranks, dead)
        if job.restarts:
            message = f"{message} (gave up after {len(job.restarts)} restarts)"
        # a bare built-in error is a defect, not a failure the job's message explains:
        # the log keeps its traceback for whoever fixes it
        log.error("job %s failed: %s", job.job_id, message,
                  exc_info=error if type(error) in _DEFECTS else None)
        return message

    def _end(self, job: Job, ranks: Ranks | None, final: tuple[str, str] | None) -> None:
        """Drains what is left, clears the stash of a failed or stopped job, then sets the
        job's `final` state: the state a follower sees last, so cleanup is done when it
        changes. A terminal job leaves the journal; its workers go back to the pool."""
        state = final[0] if final else job.state
        if ranks is not None and not ranks.closed:
            drain(job, ranks, reason=state)
            ranks.close()
        if state in ("FAILED", "STOPPED"):
            clear_store(self.store_address, job.job_id)
        drop_store_user(self.store_address, job.job_id)  # [Note: job store users]
        if final:
            job.set_state(*final)
        if job.state in TERMINAL:
            self.journal.finish(job.job_id)
        self.registry.release(job.job_id)

    def _plan_and_assign(self, job: Job, ranks: Ranks) -> None:
        """Plans the attempt (refusing a plan that fails validation or deadlocks),
        journals it, and assigns every rank its part (a move's: `migrate`)."""
        job.set_state("PLANNING")
        job.checkpoints = checkpoint_dir(job.config, self.checkpoint_root)
        plan = self._choose_plan(job, ranks)
        schedule_for(plan)  # refuses a plan whose schedule fails validation or deadlocks
        job.plan = plan
        self.journal.record(job.entry())
        assign = functools.partial(self._assign, job, ranks)
        if job.migrating_from is None:
            assign(())
        else:
            migrate(job, assign, self.journal, self.metrics)
        job.set_state("RUNNING")

    def _choose_plan(self, job: Job, ranks: Ranks) -> Plan:
        """The attempt's plan and start step: a move's new plan from the paused step, a
        replay's same plan from its checkpoint, a resumed job's checkpointed plan, else
        a new one (searched for plan "auto", balanced otherwise)."""
        if job.migrating_from is not None:
            assert job.plan is not None  # [Note: migration]: the new plan
            job.start_step = job.step
            return job.plan
        if job.attempt and job.plan is not None:
            job.start_step = replay_point(job)
            return job.plan
        if job.config.resume:
            plan = resume_point(job)
            job.first_step = job.start_step
            return plan
        if job.config.plan == AUTO:
            return auto_plan(job, ranks, self.profiles, self.cluster)
        return balanced(job)

    def _assign(self, job: Job, ranks: Ranks, fail_ranks: Iterable[int]
                ) -> list[worker_pb2.AssignReply]:
        """Assigns every rank the job's current plan, as the job's own store user made
        anew for the attempt; `fail_ranks` fail a move (tests)."""
        store_user = grant_store_user(self.store_address, job.job_id)
        return assign_all(job, ranks, self.store_address, self.rendezvous, fail_ranks,
                          store_user)

    def _run_steps(self, job: Job, ranks: Ranks) -> None:
        """Runs the attempt's steps until the last, a stop, a drain or a pending move;
        polls heartbeats and the store between steps ([Note: first failure])."""
        assert job.plan is not None
        if job.config.replan:
            watch(job, self.cluster)

        def on_step(step: int, replies: list[worker_pb2.StepReply], seconds: float) -> None:
            self._on_step(job, ranks, pump, step, replies, seconds)

        # async forward ranks may run `staleness` steps ahead of the backward ranks
        pump = StepPump(job.job_id, ranks.stubs, job.config.steps, on_step,
                        in_flight=IN_FLIGHT + job.plan.staleness, start=job.start_step,
                        checkpoint_every=job.config.checkpoint_every, attempt=job.attempt)
        store = StoreWatch(self.store_address)

        def poll() -> None:
            if job.stop_requested or self.draining.is_set() or job.pending_plan is not None:
                pump.stop()
            check_heartbeats(self.registry, ranks, range(len(ranks.workers)))
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
            raise first_failure(failures, ranks)
        self._stopped_early(job, ranks)

    def _on_step(self, job: Job, ranks: Ranks, pump: StepPump, step: int,
                 replies: list[worker_pb2.StepReply], seconds: float) -> None:
        """A step every rank ended: its report, the groups' check, a replay's comparison,
        the re-planner, evaluation and checkpoint when due; then followers see it."""
        check_finite_loss(step, replies)  # before anything commits this step's weights
        report = step_report(job, step, seconds, replies, ranks)
        check_groups_agree(report)
        check_ties_agree(report)
        if step < job.step:  # a replay ([Note: restarts]): reported before
            compare_replay(job, report)
            return
        consider_move(job, report)
        every = job.config.eval_every
        if every and (step + 1) % every == 0 and step + 1 < job.config.steps:
            report.eval.update(evaluate_version(job, ranks, step + 1))
        if job.checkpoints is not None and pump.checkpointed_after(step):
            commit(job, step + 1, rank_files(replies), self.journal)
        if self.metrics is not None:
            self.metrics.step_done(report, job.planner.get("predicted_step_seconds", 0.0))
        with job.cond:
            job.reports.append(report)
            job.step = step + 1
            job.cond.notify_all()

    def _stopped_early(self, job: Job, ranks: Ranks) -> None:
        """Raises why the steps ended before the last: Drained (after a checkpoint at the
        step), Repartitioned (a move is pending), or Stopped."""
        if job.step >= job.config.steps:
            return
        if self.draining.is_set():
            checkpoint_now(job, ranks, self.journal)
            raise Drained(f"the coordinator stopped after step {job.step}; a coordinator "
                          f"on the same journal resumes from step {job.checkpointed}")
        if job.pending_plan is not None and not job.stop_requested:
            raise Repartitioned(job.job_id)
        raise Stopped("stopped by request")
