"""Gives a job its workers and a plan, and assigns every rank its part of that plan."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from coordinator.jobs import Drained, Job, Stopped
from coordinator.profiling import ProfileCache, profile_workers
from coordinator.ranks import Ranks, wait_all
from coordinator.registry import Registry, WorkerRecord
from pipefb.errors import WorkerFailed
from pipefb.job.config import layer_policies
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import Plan
from pipefb.planner.job import job_cluster, label, plan_job, summary
from pipefb.sim.cluster import Cluster
from protos import worker_pb2
from protos.convert import job_to_proto, plan_to_proto

log = logging.getLogger(__name__)


def acquire_workers(registry: Registry, job: Job, wait_seconds: float,
                    draining: threading.Event) -> list[WorkerRecord]:
    """Reserves the job's workers, waiting up to `wait_seconds` for enough idle ones.

    Raises:
        WorkerFailed: too few workers in time.
        Stopped, Drained: StopJob arrived, or the coordinator is stopping.
    """
    deadline = time.monotonic() + wait_seconds
    while not job.stop_requested:
        if draining.is_set():
            raise Drained("the coordinator stopped before the job had its workers")
        got = registry.acquire(job.config.workers, job.job_id)
        if got is not None:
            return got
        if time.monotonic() > deadline:
            alive = sum(registry.alive(w) for w in registry.workers())
            raise WorkerFailed(f"job needs {job.config.workers} idle workers; "
                               f"{alive} alive after {wait_seconds:.0f} s")
        time.sleep(0.1)
    raise Stopped("stopped before it started")


def balanced(job: Job) -> Plan:
    """The job's plan from its spec and placeholder layer costs (no profiling)."""
    cfg = job.config
    return balanced_plan(cfg.schedule, cfg.workers, job.layer_costs, cfg.batch_size,
                         cfg.microbatches, layer_policies(cfg, len(job.layer_costs)),
                         cfg.mode, cfg.staleness, cfg.groups, cfg.stale_microbatches())


def auto_plan(job: Job, ranks: Ranks, profiles: ProfileCache, cluster: Cluster | None
              ) -> Plan:
    """Profiles the layers on the job's workers (one after another), then searches
    and simulates (pipefb.planner.job); the search's summary goes into the job status.
    A worker asked the same before answers from the cache ([Note: profile reuse]);
    `cluster` is what the search assumes of links, store and caps (uniform if None)."""
    cfg = job.config
    names = [w.address for w in ranks.workers]
    profile, speeds, reused = profile_workers(ranks.stubs, cfg, cfg.microbatch_size,
                                              cache=(profiles, names))
    base = cluster or Cluster.uniform(cfg.workers)
    planned_on = job_cluster(base, cfg.workers, speeds, cfg.memory_cap, cfg.device)
    result = plan_job(cfg, profile, planned_on)
    job.costs = (profile, planned_on)
    job.planner = {**summary(result), "profile": profile.to_dict(),
                   "speeds": speeds, "profiles_reused": reused}
    log.info("job %s: planned %s, predicted %.2f ms/step (%d of %d workers' profiles "
             "reused)", job.job_id, label(result), result.best.step_seconds * 1e3, reused,
             len(names))
    return result.plan


def assign_all(job: Job, ranks: Ranks, store_address: str, rendezvous: Callable[[], str],
               fail_ranks: Iterable[int] = (), store_user: tuple[str, str] = ("", "")
               ) -> list[worker_pb2.AssignReply]:
    """Assigns every rank the job's plan and attempt, from its start step (and from
    the paused attempt, during a migration); `rendezvous` opens the all-reduce
    rendezvous (pipefb.runtime.allreduce), which the ranks join where they need it;
    `store_user` is the job's own store user and password ([Note: job store users] in
    offload_store/acl.py)."""
    assert job.plan is not None
    spec, plan_msg = job_to_proto(job.config), plan_to_proto(job.plan)
    peers = [w.address for w in ranks.workers]
    # several groups all-reduce their gradients; clipping exchanges the stages' norms, fp16
    # its overflow flags ([Note: loss scaling]); the owners of a tied parameter's copies
    # exchange its gradients (the model shows ties, not the spec: every job gets the
    # address, and only the ranks that need it join)
    meeting = rendezvous()
    source = None
    if job.migrating_from is not None:
        old, attempt = job.migrating_from
        source = worker_pb2.MigrationSource(plan=plan_to_proto(old), attempt=attempt)
    failing = set(fail_ranks)
    calls = []
    for r, stub in enumerate(ranks.stubs):
        request = worker_pb2.AssignRequest(
            job=spec, plan=plan_msg, rank=r, peers=peers, store_address=store_address,
            rendezvous=meeting, resume_step=job.start_step, attempt=job.attempt,
            store_user=store_user[0], store_password=store_user[1])
        if source is not None:
            request.source.CopyFrom(source)
            request.source.fail = r in failing
        calls.append(stub.Assign.future(request, timeout=300))
    return wait_all(calls, ranks)
