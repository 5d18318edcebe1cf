"""What a job's steps yield: step reports, the groups' weight check, the model's weights,
held-out evaluation, and the in-situ fit of the plan's costs."""

from __future__ import annotations

import logging
import math
import statistics
import time

import grpc
import torch

from coordinator.jobs import Job
from coordinator.ranks import Ranks
from coordinator.reshape import migration_proto
from pipefb.errors import ConfigError, NonFiniteLoss, ScheduleError, WorkerFailed
from pipefb.planner.insitu import STEPS as IN_SITU_STEPS
from pipefb.planner.insitu import fit, median_action_seconds
from pipefb.runtime.evaluate import evaluate
from pipefb.runtime.throughput import SPAN, WINDOW, StepRate
from protos import coordinator_pb2, job_pb2, wire, worker_pb2

log = logging.getLogger(__name__)


def step_report(job: Job, step: int, seconds: float, replies: list[worker_pb2.StepReply],
                ranks: Ranks) -> coordinator_pb2.StepReport:
    """The step's report from every rank's reply (and the move taken at it, if any)."""
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
        layer_seconds=rep.layer_seconds, metrics=rep.metrics, tied_digests=rep.tied_digests)
        for a, rep in zip(job.plan.assignment, replies, strict=True)]
    rate = StepRate(job.config.batch_size,
                    [r.seconds for r in job.reports[-(WINDOW + SPAN - 2):]] + [seconds])
    report = coordinator_pb2.StepReport(
        job_id=job.job_id, step=step, loss=statistics.fmean(losses) if losses else float("nan"),
        seconds=seconds, samples_per_second=job.config.batch_size / seconds, workers=stats,
        attempt=job.attempt, samples_per_second_median=rate.samples_per_second(),
        seconds_left=rate.seconds_left(job.config.steps - step - 1))
    optimizer_step(report, [rep for a, rep in zip(job.plan.assignment, replies, strict=True)
                            if a.role != "forward"])
    moves = [m for m in job.migrations if m["step"] == step and "seconds" in m]
    if moves:
        report.migration.CopyFrom(migration_proto(moves[-1]))
    return report


def check_finite_loss(step: int, replies: list[worker_pb2.StepReply]) -> None:
    """Every micro-batch loss of the step is a finite number: a NaN or infinite loss
    fails the job before the step is reported or checkpointed, so no job ends DONE with
    weights trained on it.

    Raises:
        NonFiniteLoss: names the step, the loss and the rank that computed it.
    """
    for rank, reply in enumerate(replies):
        for loss in reply.losses:
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"step {step} has a non-finite loss ({loss} on rank "
                                    f"{rank}); the job fails rather than go on training "
                                    "on it")
def optimizer_step(report: coordinator_pb2.StepReport, owners: list[worker_pb2.StepReply]
                   ) -> None:
    """Sets the step's learning rate, gradient norm, fp16 loss scale and whether it was
    skipped from the weight owners' replies (every owner takes the same ones: [Note:
    learning-rate schedules], [Note: global norm], [Note: loss scaling])."""
    if owners:
        report.lr = owners[0].lr
    norms = [rep.grad_norm for rep in owners if rep.HasField("grad_norm")]
    if norms:
        report.grad_norm = norms[0]
    report.skipped = any(rep.skipped for rep in owners)
    report.loss_scale = owners[0].loss_scale if owners else 0.0


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


def check_ties_agree(report: coordinator_pb2.StepReport) -> None:
    """Every copy of a tied parameter, on every rank and group, holds the same values after
    the step ([Note: tied parameters] in pipefb.runtime.tied).

    Raises:
        WorkerFailed: two copies differ; names the step, the parameter and both ranks.
    """
    first: dict[str, coordinator_pb2.WorkerStepStats] = {}
    for w in report.workers:
        for name, digest in sorted(w.tied_digests.items()):
            tie = name.partition("#")[0]
            seen = first.setdefault(tie, w)
            if seen.tied_digests[tie] != digest:
                raise WorkerFailed(f"tied copies diverged at step {report.step}: parameter "
                                   f"{tie} on rank {seen.rank} (stage {seen.stage}) and "
                                   f"rank {w.rank} (stage {w.stage}) differ")


def collect_weights(job: Job, ranks: Ranks, version: int = 0) -> dict[str, torch.Tensor]:
    """The whole model's weights (0: the current ones; else the copy of `version` kept
    for evaluation): the parameters from the ranks that own them, the buffers from the
    ranks that run the forwards ([Note: buffer owners] in pipefb.runtime.state), so every
    rank of the first group sends its part."""
    weights: dict[str, torch.Tensor] = {}
    # every group holds the same parameters (summed gradients): group 0's are the model's
    owners = {a.rank for a in job.plan.assignment if a.group == 0} if job.plan else set()
    for rank in sorted(owners):
        stream = ranks.stubs[rank].ExportWeights(
            job_pb2.ExportWeightsRequest(job_id=job.job_id, version=version), timeout=120)
        weights.update(wire.decode_stream(stream)[1])
    return weights


def evaluate_version(job: Job, ranks: Ranks, version: int) -> dict[str, float]:
    """Held-out metrics of weight version `version` (kept by the owners for this)."""
    started = time.perf_counter()
    try:
        metrics = evaluate(job.config, collect_weights(job, ranks, version))
    except (grpc.RpcError, ConfigError) as error:  # training goes on without this report
        log.warning("job %s: no held-out evaluation of version %d: %s", job.job_id,
                    version, error)
        return {}
    log.info("job %s version %d held-out %s (%.2f s)", job.job_id, version, metrics,
             time.perf_counter() - started)
    return metrics


def fit_in_situ(job: Job) -> None:
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
