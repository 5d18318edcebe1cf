"""Re-shaping a running job: moving its layers to new partitions (asked for, or decided by
the re-planner from step reports) at a step boundary, and rolling a failed move back.

[Note: migration] The job paused at step v with every issued step done; the next
assignment gives every rank the new plan with attempt + 1 and the paused attempt as its
source (`assign_all` in coordinator/assign.py): each rank keeps what it held and takes the
rest from the old owners' paused state over the workers' `Migrate` stream ([Note:
migration, worker side] in worker/takeover.py), so the forward and backward ranks switch
together at step v and losses and weights go on exactly as without the move (sync). If
any rank fails the move, every rank is assigned the old plan with attempt + 2 from the
same source: the move rolls back and nothing is lost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from coordinator.jobs import Job
from coordinator.journal import Journal
from coordinator.metrics import CoordinatorMetrics
from coordinator.ranks import Ranks
from pipefb.errors import ConfigError, WorkerFailed
from pipefb.plan.migration import repartitioned
from pipefb.planner.replan import Replanner, ReplanSettings
from pipefb.sim.cluster import Cluster
from protos import coordinator_pb2, worker_pb2
from protos.server import FailedPrecondition

log = logging.getLogger(__name__)

#: assigns every rank the job's current plan; the argument names ranks that fail the move
Assign = Callable[[Iterable[int]], list[worker_pb2.AssignReply]]


def repartition(job: Job, forward: list[int], backward: list[int],
                fail_ranks: Iterable[int] = ()) -> None:
    """Asks a running job to move to new partitions at its next step boundary
    ([Note: migration]); `fail_ranks` inject a failure of the move on those ranks (tests).

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


def watch(job: Job, cluster: Cluster | None) -> None:
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
    bandwidth = cluster.network.bandwidth if cluster else ReplanSettings().bandwidth
    job.replanner = Replanner(job.plan, forward, backward, sizes,
                              ReplanSettings(bandwidth=bandwidth))


def consider_move(job: Job, report: coordinator_pb2.StepReport) -> None:
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


def switch_plan(job: Job, ranks: Ranks, journal: Journal,
                metrics: CoordinatorMetrics | None) -> None:
    """Takes the job's pending plan at the step it paused at ([Note: migration]): records
    the move, closes the old ranks, and makes the new plan the job's with attempt + 1;
    the next assignment (`migrate`) carries it out."""
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
    journal.record(job.entry())
    if metrics is not None:
        metrics.migrated(job.job_id)


def migrate(job: Job, assign: Assign, journal: Journal,
            metrics: CoordinatorMetrics | None) -> None:
    """Assigns the new plan from the paused attempt; on a failure, the old plan from
    the same source ([Note: migration]). A failed rollback is the job's failure (and
    its restart from the newest checkpoint, with `max_restarts`)."""
    assert job.migrating_from is not None
    move = job.migrations[-1]
    try:
        replies = assign(job.fail_ranks)
    except WorkerFailed as error:
        log.warning("job %s: the move at step %d failed, rolling back: %s", job.job_id,
                    job.step, error)
        move["rolled_back"] = str(error)
        job.plan = job.migrating_from[0]
        job.attempt += 1
        journal.record(job.entry())
        replies = assign(())
    finally:  # a failed rollback restarts the job from its checkpoint, not a move
        job.fail_ranks, job.migrating_from = (), None
    move["bytes"] = sum(r.migrated_bytes for r in replies)
    move["seconds"] = time.monotonic() - move.pop("_t0")
    if job.replanner is not None:
        job.replanner.moved(move["seconds"])
    if metrics is not None:
        metrics.migration_done(job.job_id, move["bytes"], move["seconds"])
    log.info("job %s: %s in %.2f s: %s", job.job_id,
             "rolled back" if "rolled_back" in move else "migrated", move["seconds"], move)


def migration_proto(move: dict[str, Any]) -> coordinator_pb2.Migration:
    """A migration record of `Job.migrations` as its message."""
    return coordinator_pb2.Migration(**{k: v for k, v in move.items() if not k.startswith("_")})
