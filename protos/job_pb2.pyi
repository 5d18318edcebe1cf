from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobSpec(_message.Message):
    __slots__ = ("job_id", "model", "model_config_json", "dataset", "dataset_config_json", "loss", "optimizer", "optimizer_config_json", "lr", "seed", "batch_size", "microbatches", "steps", "schedule", "workers", "mode", "staleness", "policy", "eval_every", "plan", "memory_cap", "device", "groups", "checkpoint_every", "checkpoint_dir", "resume", "max_restarts", "slowdown", "replan", "check_groups_every", "loss_config_json", "lr_schedule", "warmup_steps", "min_lr", "clip_grad_norm", "precision", "initial_loss_scale", "loss_scale_window", "staleness_microbatches")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    REPLAN_FIELD_NUMBER: _ClassVar[int]
    CHECK_GROUPS_EVERY_FIELD_NUMBER: _ClassVar[int]
    LOSS_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_FIELD_NUMBER: _ClassVar[int]
    CLIP_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    INITIAL_LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model: str
    model_config_json: str
    dataset: str
    dataset_config_json: str
    loss: str
    optimizer: str
    optimizer_config_json: str
    lr: float
    seed: int
    batch_size: int
    microbatches: int
    steps: int
    schedule: str
    workers: int
    mode: str
    staleness: int
    policy: str
    eval_every: int
    plan: str
    memory_cap: int
    device: str
    groups: int
    checkpoint_every: int
    checkpoint_dir: str
    resume: bool
    max_restarts: int
    slowdown: str
    replan: bool
    check_groups_every: int
    loss_config_json: str
    lr_schedule: str
    warmup_steps: int
    min_lr: float
    clip_grad_norm: float
    precision: str
    initial_loss_scale: float
    loss_scale_window: int
    staleness_microbatches: int
    def __init__(self, job_id: _Optional[str] = ..., model: _Optional[str] = ..., model_config_json: _Optional[str] = ..., dataset: _Optional[str] = ..., dataset_config_json: _Optional[str] = ..., loss: _Optional[str] = ..., optimizer: _Optional[str] = ..., optimizer_config_json: _Optional[str] = ..., lr: _Optional[float] = ..., seed: _Optional[int] = ..., batch_size: _Optional[int] = ..., microbatches: _Optional[int] = ..., steps: _Optional[int] = ..., schedule: _Optional[str] = ..., workers: _Optional[int] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., policy: _Optional[str] = ..., eval_every: _Optional[int] = ..., plan: _Optional[str] = ..., memory_cap: _Optional[int] = ..., device: _Optional[str] = ..., groups: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., resume: _Optional[bool] = ..., max_restarts: _Optional[int] = ..., slowdown: _Optional[str] = ..., replan: _Optional[bool] = ..., check_groups_every: _Optional[int] = ..., loss_config_json: _Optional[str] = ..., lr_schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., min_lr: _Optional[float] = ..., clip_grad_norm: _Optional[float] = ..., precision: _Optional[str] = ..., initial_loss_scale: _Optional[float] = ..., loss_scale_window: _Optional[int] = ..., staleness_microbatches: _Optional[int] = ...) -> None: ...

class WorkerAssignment(_message.Message):
    __slots__ = ("rank", "group", "role", "stage")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    group: int
    role: str
    stage: int
    def __init__(self, rank: _Optional[int] = ..., group: _Optional[int] = ..., role: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("schedule", "microbatches", "microbatch_size", "forward_partition", "backward_partition", "policy", "groups", "assignment", "predicted_step_seconds", "mode", "staleness", "predicted_peak_memory_bytes", "stale_microbatches")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALE_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    schedule: str
    microbatches: int
    microbatch_size: int
    forward_partition: _containers.RepeatedScalarFieldContainer[int]
    backward_partition: _containers.RepeatedScalarFieldContainer[int]
    policy: _containers.RepeatedScalarFieldContainer[str]
    groups: int
    assignment: _containers.RepeatedCompositeFieldContainer[WorkerAssignment]
    predicted_step_seconds: float
    mode: str
    staleness: int
    predicted_peak_memory_bytes: _containers.RepeatedScalarFieldContainer[int]
    stale_microbatches: int
    def __init__(self, schedule: _Optional[str] = ..., microbatches: _Optional[int] = ..., microbatch_size: _Optional[int] = ..., forward_partition: _Optional[_Iterable[int]] = ..., backward_partition: _Optional[_Iterable[int]] = ..., policy: _Optional[_Iterable[str]] = ..., groups: _Optional[int] = ..., assignment: _Optional[_Iterable[_Union[WorkerAssignment, _Mapping]]] = ..., predicted_step_seconds: _Optional[float] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., predicted_peak_memory_bytes: _Optional[_Iterable[int]] = ..., stale_microbatches: _Optional[int] = ...) -> None: ...

class ExportWeightsRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
