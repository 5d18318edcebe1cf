from protos import job_pb2 as _job_pb2
from protos import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AssignRequest(_message.Message):
    __slots__ = ("job", "plan", "rank", "peers", "store_address", "attempt", "rendezvous", "resume_step", "source", "store_user", "store_password")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STORE_USER_FIELD_NUMBER: _ClassVar[int]
    STORE_PASSWORD_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.JobSpec
    plan: _job_pb2.Plan
    rank: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    store_address: str
    attempt: int
    rendezvous: str
    resume_step: int
    source: MigrationSource
    store_user: str
    store_password: str
    def __init__(self, job: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., plan: _Optional[_Union[_job_pb2.Plan, _Mapping]] = ..., rank: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., store_address: _Optional[str] = ..., attempt: _Optional[int] = ..., rendezvous: _Optional[str] = ..., resume_step: _Optional[int] = ..., source: _Optional[_Union[MigrationSource, _Mapping]] = ..., store_user: _Optional[str] = ..., store_password: _Optional[str] = ...) -> None: ...

class MigrationSource(_message.Message):
    __slots__ = ("plan", "attempt", "fail")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FAIL_FIELD_NUMBER: _ClassVar[int]
    plan: _job_pb2.Plan
    attempt: int
    fail: bool
    def __init__(self, plan: _Optional[_Union[_job_pb2.Plan, _Mapping]] = ..., attempt: _Optional[int] = ..., fail: _Optional[bool] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("job_id", "attempt", "step", "layers", "optimizer_layers", "buffers_only")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_ONLY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    step: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    optimizer_layers: _containers.RepeatedScalarFieldContainer[int]
    buffers_only: bool
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., optimizer_layers: _Optional[_Iterable[int]] = ..., buffers_only: _Optional[bool] = ...) -> None: ...

class AssignReply(_message.Message):
    __slots__ = ("role", "actions", "parameter_bytes", "migrated_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    actions: _containers.RepeatedScalarFieldContainer[str]
    parameter_bytes: int
    migrated_bytes: int
    def __init__(self, role: _Optional[str] = ..., actions: _Optional[_Iterable[str]] = ..., parameter_bytes: _Optional[int] = ..., migrated_bytes: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("job_id", "step", "checkpoint", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    checkpoint: bool
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., checkpoint: _Optional[bool] = ..., attempt: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "losses", "compute_seconds", "idle_seconds", "memory_bytes", "peak_memory_bytes", "bytes_sent", "bytes_stashed", "weight_version", "action_seconds", "spans", "versions", "kept_versions", "kind_peak_bytes", "activation_peak_bytes", "device_memory_bytes", "weights_digest", "layer_seconds", "metrics", "lr", "grad_norm", "skipped", "loss_scale", "checkpoint_file", "tied_digests")
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
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_STASHED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KEPT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KIND_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FILE_FIELD_NUMBER: _ClassVar[int]
    TIED_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    losses: _containers.RepeatedScalarFieldContainer[float]
    compute_seconds: float
    idle_seconds: float
    memory_bytes: _containers.ScalarMap[str, int]
    peak_memory_bytes: int
    bytes_sent: int
    bytes_stashed: int
    weight_version: int
    action_seconds: _containers.ScalarMap[str, float]
    spans: _containers.RepeatedCompositeFieldContainer[ActionSpan]
    versions: _containers.RepeatedCompositeFieldContainer[VersionTag]
    kept_versions: _containers.RepeatedScalarFieldContainer[int]
    kind_peak_bytes: _containers.ScalarMap[str, int]
    activation_peak_bytes: int
    device_memory_bytes: _containers.ScalarMap[str, int]
    weights_digest: str
    layer_seconds: _containers.ScalarMap[int, float]
    metrics: _containers.ScalarMap[str, float]
    lr: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    checkpoint_file: CheckpointFile
    tied_digests: _containers.ScalarMap[str, str]
    def __init__(self, step: _Optional[int] = ..., losses: _Optional[_Iterable[float]] = ..., compute_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ..., peak_memory_bytes: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_stashed: _Optional[int] = ..., weight_version: _Optional[int] = ..., action_seconds: _Optional[_Mapping[str, float]] = ..., spans: _Optional[_Iterable[_Union[ActionSpan, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[VersionTag, _Mapping]]] = ..., kept_versions: _Optional[_Iterable[int]] = ..., kind_peak_bytes: _Optional[_Mapping[str, int]] = ..., activation_peak_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[_Mapping[str, int]] = ..., weights_digest: _Optional[str] = ..., layer_seconds: _Optional[_Mapping[int, float]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., lr: _Optional[float] = ..., grad_norm: _Optional[float] = ..., skipped: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., checkpoint_file: _Optional[_Union[CheckpointFile, _Mapping]] = ..., tied_digests: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("name", "sha256", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    bytes: int
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class VersionTag(_message.Message):
    __slots__ = ("action", "step", "version")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    action: str
    step: int
    version: int
    def __init__(self, action: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ActionSpan(_message.Message):
    __slots__ = ("action", "start", "end")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    action: str
    start: float
    end: float
    def __init__(self, action: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("job_id", "reason", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("job_id", "attempt", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    step: int
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("saved", "file")
    SAVED_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    saved: bool
    file: CheckpointFile
    def __init__(self, saved: _Optional[bool] = ..., file: _Optional[_Union[CheckpointFile, _Mapping]] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    def __init__(self, drained: _Optional[bool] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("job", "microbatch_size", "warmup", "repeats", "layers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.JobSpec
    microbatch_size: int
    warmup: int
    repeats: int
    layers: LayerRange
    def __init__(self, job: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., microbatch_size: _Optional[int] = ..., warmup: _Optional[int] = ..., repeats: _Optional[int] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class LayerProfile(_message.Message):
    __slots__ = ("name", "forward_seconds", "backward_seconds", "input_bytes", "output_bytes", "saved_bytes", "param_bytes", "forward_fixed_seconds", "backward_fixed_seconds", "weight_grad_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GRAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    forward_seconds: float
    backward_seconds: float
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    param_bytes: int
    forward_fixed_seconds: float
    backward_fixed_seconds: float
    weight_grad_seconds: float
    def __init__(self, name: _Optional[str] = ..., forward_seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., input_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ..., saved_bytes: _Optional[int] = ..., param_bytes: _Optional[int] = ..., forward_fixed_seconds: _Optional[float] = ..., backward_fixed_seconds: _Optional[float] = ..., weight_grad_seconds: _Optional[float] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("microbatch_size", "layers", "optimizer_seconds_per_byte", "optimizer_state_ratio", "source", "torch_threads", "data_seconds", "optimizer_fixed_seconds", "weight_copy_seconds_per_byte")
    MICROBATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_SECONDS_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_RATIO_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TORCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_COPY_SECONDS_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    microbatch_size: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerProfile]
    optimizer_seconds_per_byte: float
    optimizer_state_ratio: float
    source: str
    torch_threads: int
    data_seconds: float
    optimizer_fixed_seconds: float
    weight_copy_seconds_per_byte: float
    def __init__(self, microbatch_size: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerProfile, _Mapping]]] = ..., optimizer_seconds_per_byte: _Optional[float] = ..., optimizer_state_ratio: _Optional[float] = ..., source: _Optional[str] = ..., torch_threads: _Optional[int] = ..., data_seconds: _Optional[float] = ..., optimizer_fixed_seconds: _Optional[float] = ..., weight_copy_seconds_per_byte: _Optional[float] = ...) -> None: ...
