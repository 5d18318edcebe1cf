"""Core data (JobConfig, Plan, Profile and profile queries) <-> protobuf messages, field by
field."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig, parse_json_object
from pipefb.job.precision import INITIAL_LOSS_SCALE, LOSS_SCALE_WINDOW
from pipefb.plan.plan import Plan, WorkerAssignment
from pipefb.profile.measure import REPEATS, WARMUP
from pipefb.sim.costs import LayerProfile, Profile
from protos import job_pb2, worker_pb2


def job_to_proto(job: JobConfig) -> job_pb2.JobSpec:
    """A JobConfig as the JobSpec message."""
    return job_pb2.JobSpec(
        job_id=job.job_id, model=job.model, model_config_json=json.dumps(job.model_config),
        dataset=job.dataset, dataset_config_json=json.dumps(job.dataset_config),
        loss=job.loss, optimizer=job.optimizer,
        optimizer_config_json=json.dumps(job.optimizer_config), lr=job.lr, seed=job.seed,
        batch_size=job.batch_size, microbatches=job.microbatches, steps=job.steps,
        schedule=job.schedule, workers=job.workers, mode=job.mode,
        staleness=job.staleness, staleness_microbatches=job.staleness_microbatches,
        policy=job.policy, eval_every=job.eval_every,
        plan=job.plan, memory_cap=job.memory_cap, device=job.device, groups=job.groups,
        checkpoint_every=job.checkpoint_every, checkpoint_dir=job.checkpoint_dir,
        resume=job.resume, max_restarts=job.max_restarts, slowdown=job.slowdown,
        replan=job.replan, check_groups_every=job.check_groups_every,
        loss_config_json=json.dumps(job.loss_config),
        lr_schedule=job.lr_schedule, warmup_steps=job.warmup_steps, min_lr=job.min_lr,
        clip_grad_norm=job.clip_grad_norm,
        precision=job.precision,
        initial_loss_scale=job.initial_loss_scale, loss_scale_window=job.loss_scale_window,
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
        staleness=spec.staleness, staleness_microbatches=spec.staleness_microbatches,
        policy=spec.policy, eval_every=spec.eval_every,
        plan=spec.plan, memory_cap=spec.memory_cap, device=spec.device or "cpu",
        groups=spec.groups or (0 if spec.plan == "auto" else 1),
        checkpoint_every=spec.checkpoint_every, checkpoint_dir=spec.checkpoint_dir,
        resume=spec.resume, max_restarts=spec.max_restarts, slowdown=spec.slowdown,
        replan=spec.replan, check_groups_every=spec.check_groups_every,
        loss_config=parse_json_object(spec.loss_config_json, "loss config"),
        lr_schedule=spec.lr_schedule or "constant", warmup_steps=spec.warmup_steps,
        min_lr=spec.min_lr, clip_grad_norm=spec.clip_grad_norm,
        precision=spec.precision or "fp32",
        initial_loss_scale=spec.initial_loss_scale or INITIAL_LOSS_SCALE,
        loss_scale_window=spec.loss_scale_window or LOSS_SCALE_WINDOW,
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
        stale_microbatches=plan.stale_microbatches,
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
        stale_microbatches=msg.stale_microbatches,
    )


@dataclass(frozen=True)
class ProfileQuery:
    """What a Profile request asks: the arguments of `pipefb.profile.measure.measure_profile`."""

    job: JobConfig
    microbatch_size: int
    layers: range | None = None  # None: time every layer
    warmup: int = WARMUP
    repeats: int = REPEATS

    def to_proto(self) -> worker_pb2.ProfileRequest:
        """The ProfileRequest message."""
        request = worker_pb2.ProfileRequest(job=job_to_proto(self.job),
                                            microbatch_size=self.microbatch_size,
                                            warmup=self.warmup, repeats=self.repeats)
        if self.layers is not None:
            if self.layers.step != 1:
                raise ConfigError(f"layers {self.layers!r} must be a range of step 1")
            request.layers.start, request.layers.stop = self.layers.start, self.layers.stop
        return request

    @classmethod
    def from_proto(cls, request: worker_pb2.ProfileRequest) -> ProfileQuery:
        """Decodes a ProfileRequest (ConfigError naming a bad job field); the values are
        checked by `measure_profile`."""
        layers = (range(request.layers.start, request.layers.stop)
                  if request.HasField("layers") else None)
        return cls(job=job_from_proto(request.job), microbatch_size=request.microbatch_size,
                   layers=layers,
                   warmup=request.warmup if request.HasField("warmup") else WARMUP,
                   repeats=request.repeats if request.HasField("repeats") else REPEATS)


def profile_to_proto(profile: Profile, torch_threads: int) -> worker_pb2.ProfileReply:
    """A profile as the ProfileReply message, with the thread count it was timed with."""
    return worker_pb2.ProfileReply(
        microbatch_size=profile.microbatch_size,
        layers=[_layer_to_proto(x) for x in profile.layers],
        optimizer_seconds_per_byte=profile.optimizer_seconds_per_byte,
        optimizer_state_ratio=profile.optimizer_state_ratio, source=profile.source,
        torch_threads=torch_threads, data_seconds=profile.data_seconds,
        optimizer_fixed_seconds=profile.optimizer_fixed_seconds,
        weight_copy_seconds_per_byte=profile.weight_copy_seconds_per_byte)


def profile_from_proto(reply: worker_pb2.ProfileReply) -> Profile:
    """A ProfileReply as a Profile (ConfigError on a negative or missing value)."""
    return Profile(
        microbatch_size=reply.microbatch_size,
        layers=tuple(_layer_from_proto(x) for x in reply.layers),
        optimizer_seconds_per_byte=reply.optimizer_seconds_per_byte,
        optimizer_state_ratio=reply.optimizer_state_ratio, source=reply.source,
        data_seconds=reply.data_seconds, optimizer_fixed_seconds=reply.optimizer_fixed_seconds,
        weight_copy_seconds_per_byte=reply.weight_copy_seconds_per_byte)


def _layer_to_proto(x: LayerProfile) -> worker_pb2.LayerProfile:
    return worker_pb2.LayerProfile(
        name=x.name, forward_seconds=x.forward_seconds, backward_seconds=x.backward_seconds,
        input_bytes=x.input_bytes, output_bytes=x.output_bytes, saved_bytes=x.saved_bytes,
        param_bytes=x.param_bytes, forward_fixed_seconds=x.forward_fixed_seconds,
        backward_fixed_seconds=x.backward_fixed_seconds, weight_grad_seconds=x.weight_grad_seconds)


def _layer_from_proto(x: worker_pb2.LayerProfile) -> LayerProfile:
    return LayerProfile(
        name=x.name, forward_seconds=x.forward_seconds, backward_seconds=x.backward_seconds,
        input_bytes=x.input_bytes, output_bytes=x.output_bytes, saved_bytes=x.saved_bytes,
        param_bytes=x.param_bytes, forward_fixed_seconds=x.forward_fixed_seconds,
        backward_fixed_seconds=x.backward_fixed_seconds, weight_grad_seconds=x.weight_grad_seconds)
