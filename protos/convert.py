"""Core data (JobConfig, Plan, StepResult) <-> protobuf messages, field by field."""

from __future__ import annotations

import json

from pipefb.config import JobConfig, parse_json_object
from pipefb.plan import Plan, WorkerAssignment
from protos import job_pb2


def job_to_proto(job: JobConfig) -> job_pb2.JobSpec:
    """A JobConfig as the JobSpec message."""
    return job_pb2.JobSpec(
        job_id=job.job_id, model=job.model, model_config_json=json.dumps(job.model_config),
        dataset=job.dataset, dataset_config_json=json.dumps(job.dataset_config),
        loss=job.loss, optimizer=job.optimizer,
        optimizer_config_json=json.dumps(job.optimizer_config), lr=job.lr, seed=job.seed,
        batch_size=job.batch_size, microbatches=job.microbatches, steps=job.steps,
        schedule=job.schedule, workers=job.workers, mode=job.mode,
        staleness=job.staleness, policy=job.policy, eval_every=job.eval_every,
        plan=job.plan, memory_cap=job.memory_cap,
    )


def job_from_proto(spec: job_pb2.JobSpec) -> JobConfig:
    """Validates a JobSpec into a JobConfig (ConfigError naming a bad field)."""
    return JobConfig(
        job_id=spec.job_id, model=spec.model,
        model_config=parse_json_object(spec.model_config_json, "model config"),
        dataset=spec.dataset,
        dataset_config=parse_json_object(spec.dataset_config_json, "dataset config"),
        loss=spec.loss, optimizer=spec.optimizer,
        optimizer_config=parse_json_object(spec.optimizer_config_json, "optimizer config"),
        lr=spec.lr, seed=spec.seed, batch_size=spec.batch_size, microbatches=spec.microbatches,
        steps=spec.steps, schedule=spec.schedule, workers=spec.workers, mode=spec.mode or "sync",
        staleness=spec.staleness, policy=spec.policy, eval_every=spec.eval_every,
        plan=spec.plan, memory_cap=spec.memory_cap,
    )


def plan_to_proto(plan: Plan) -> job_pb2.Plan:
    """A Plan as the Plan message."""
    return job_pb2.Plan(
        schedule=plan.schedule, microbatches=plan.microbatches,
        microbatch_size=plan.microbatch_size, forward_partition=plan.forward_partition,
        backward_partition=plan.backward_partition, policy=plan.policy, groups=plan.groups,
        assignment=[job_pb2.WorkerAssignment(rank=a.rank, group=a.group, role=a.role,
                                             stage=a.stage) for a in plan.assignment],
        predicted_step_seconds=plan.predicted_step_seconds, mode=plan.mode,
        staleness=plan.staleness, predicted_peak_memory_bytes=plan.predicted_peak_memory_bytes,
    )


def plan_from_proto(msg: job_pb2.Plan) -> Plan:
    """A Plan message as a Plan (ConfigError/ScheduleError on inconsistent fields)."""
    return Plan(
        schedule=msg.schedule, microbatches=msg.microbatches,
        microbatch_size=msg.microbatch_size,
        forward_partition=tuple(msg.forward_partition),
        backward_partition=tuple(msg.backward_partition), policy=tuple(msg.policy),
        groups=msg.groups or 1,
        assignment=tuple(WorkerAssignment(rank=a.rank, role=a.role, stage=a.stage,
                                          group=a.group) for a in msg.assignment),
        predicted_step_seconds=msg.predicted_step_seconds, mode=msg.mode or "sync",
        staleness=msg.staleness,
        predicted_peak_memory_bytes=tuple(msg.predicted_peak_memory_bytes),
    )
