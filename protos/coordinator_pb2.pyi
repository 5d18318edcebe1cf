from protos import job_pb2 as _job_pb2
from protos import tensor_pb2 as _tensor_pb2
from protos import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PENDING: _ClassVar[JobState]
    PLANNING: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    MIGRATING: _ClassVar[JobState]
    CHECKPOINTING: _ClassVar[JobState]
    RECOVERING: _ClassVar[JobState]
    DONE: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    STOPPED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
PENDING: JobState
PLANNING: JobState
RUNNING: JobState
MIGRATING: JobState
CHECKPOINTING: JobState
RECOVERING: JobState
DONE: JobState
FAILED: JobState
STOPPED: JobState

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "name")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("worker_id", "heartbeat_seconds", "heartbeat_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    heartbeat_seconds: float
    heartbeat_port: int
    def __init__(self, worker_id: _Optional[int] = ..., heartbeat_seconds: _Optional[float] = ..., heartbeat_port: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    address: str
    def __init__(self, worker_id: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("job_id", "step", "loss", "seconds", "samples_per_second", "workers", "eval", "attempt", "migration", "lr", "grad_norm", "skipped", "samples_per_second_median", "seconds_left", "loss_scale")
    class EvalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    loss: float
    seconds: float
    samples_per_second: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStepStats]
    eval: _containers.ScalarMap[str, float]
    attempt: int
    migration: Migration
    lr: float
    grad_norm: float
    skipped: bool
    samples_per_second_median: float
    seconds_left: float
    loss_scale: float
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., seconds: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStepStats, _Mapping]]] = ..., eval: _Optional[_Mapping[str, float]] = ..., attempt: _Optional[int] = ..., migration: _Optional[_Union[Migration, _Mapping]] = ..., lr: _Optional[float] = ..., grad_norm: _Optional[float] = ..., skipped: _Optional[bool] = ..., samples_per_second_median: _Optional[float] = ..., seconds_left: _Optional[float] = ..., loss_scale: _Optional[float] = ...) -> None: ...

class WorkerStepStats(_message.Message):
    __slots__ = ("rank", "worker_id", "role", "stage", "compute_seconds", "idle_seconds", "peak_memory_bytes", "memory_bytes", "bytes_sent", "bytes_stashed", "action_seconds", "spans", "versions", "kept_versions", "weight_version", "kind_peak_bytes", "activation_peak_bytes", "device_memory_bytes", "group", "weights_digest", "layer_seconds", "metrics", "tied_digests")
    class MemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ActionSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class KindPeakBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DeviceMemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LayerSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TiedDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_STASHED_FIELD_NUMBER: _ClassVar[int]
    ACTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KEPT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TIED_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    worker_id: int
    role: str
    stage: int
    compute_seconds: float
    idle_seconds: float
    peak_memory_bytes: int
    memory_bytes: _containers.ScalarMap[str, int]
    bytes_sent: int
    bytes_stashed: int
    action_seconds: _containers.ScalarMap[str, float]
    spans: _containers.RepeatedCompositeFieldContainer[_worker_pb2.ActionSpan]
    versions: _containers.RepeatedCompositeFieldContainer[_worker_pb2.VersionTag]
    kept_versions: _containers.RepeatedScalarFieldContainer[int]
    weight_version: int
    kind_peak_bytes: _containers.ScalarMap[str, int]
    activation_peak_bytes: int
    device_memory_bytes: _containers.ScalarMap[str, int]
    group: int
    weights_digest: str
    layer_seconds: _containers.ScalarMap[int, float]
    metrics: _containers.ScalarMap[str, float]
    tied_digests: _containers.ScalarMap[str, str]
    def __init__(self, rank: _Optional[int] = ..., worker_id: _Optional[int] = ..., role: _Optional[str] = ..., stage: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ..., bytes_sent: _Optional[int] = ..., bytes_stashed: _Optional[int] = ..., action_seconds: _Optional[_Mapping[str, float]] = ..., spans: _Optional[_Iterable[_Union[_worker_pb2.ActionSpan, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[_worker_pb2.VersionTag, _Mapping]]] = ..., kept_versions: _Optional[_Iterable[int]] = ..., weight_version: _Optional[int] = ..., kind_peak_bytes: _Optional[_Mapping[str, int]] = ..., activation_peak_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[_Mapping[str, int]] = ..., group: _Optional[int] = ..., weights_digest: _Optional[str] = ..., layer_seconds: _Optional[_Mapping[int, float]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., tied_digests: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RepartitionRequest(_message.Message):
    __slots__ = ("job_id", "forward_partition", "backward_partition", "fail_ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    FAIL_RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    forward_partition: _containers.RepeatedScalarFieldContainer[int]
    backward_partition: _containers.RepeatedScalarFieldContainer[int]
    fail_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., forward_partition: _Optional[_Iterable[int]] = ..., backward_partition: _Optional[_Iterable[int]] = ..., fail_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Migration(_message.Message):
    __slots__ = ("step", "seconds", "bytes", "forward_partition", "backward_partition", "rolled_back")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_PARTITION_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    step: int
    seconds: float
    bytes: int
    forward_partition: _containers.RepeatedScalarFieldContainer[int]
    backward_partition: _containers.RepeatedScalarFieldContainer[int]
    rolled_back: str
    def __init__(self, step: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., forward_partition: _Optional[_Iterable[int]] = ..., backward_partition: _Optional[_Iterable[int]] = ..., rolled_back: _Optional[str] = ...) -> None: ...

class CheckpointJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "spec", "plan", "error", "worker_ids", "planner_json", "attempt", "restarts", "migrations", "checkpointed", "start_step", "refused_checkpoints", "warnings")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_JSON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    step: int
    spec: _job_pb2.JobSpec
    plan: _job_pb2.Plan
    error: str
    worker_ids: _containers.RepeatedScalarFieldContainer[int]
    planner_json: str
    attempt: int
    restarts: _containers.RepeatedScalarFieldContainer[str]
    migrations: _containers.RepeatedCompositeFieldContainer[Migration]
    checkpointed: int
    start_step: int
    refused_checkpoints: _containers.RepeatedScalarFieldContainer[str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., spec: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., plan: _Optional[_Union[_job_pb2.Plan, _Mapping]] = ..., error: _Optional[str] = ..., worker_ids: _Optional[_Iterable[int]] = ..., planner_json: _Optional[str] = ..., attempt: _Optional[int] = ..., restarts: _Optional[_Iterable[str]] = ..., migrations: _Optional[_Iterable[_Union[Migration, _Mapping]]] = ..., checkpointed: _Optional[int] = ..., start_step: _Optional[int] = ..., refused_checkpoints: _Optional[_Iterable[str]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "name", "alive", "job_id", "last_heartbeat_age_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    address: str
    name: str
    alive: bool
    job_id: str
    last_heartbeat_age_seconds: float
    def __init__(self, worker_id: _Optional[int] = ..., address: _Optional[str] = ..., name: _Optional[str] = ..., alive: _Optional[bool] = ..., job_id: _Optional[str] = ..., last_heartbeat_age_seconds: _Optional[float] = ...) -> None: ...

class ListWorkersReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...
