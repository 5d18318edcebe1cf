from protos import job_pb2 as _job_pb2
from protos import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AssignRequest(_message.Message):
    __slots__ = ("job", "plan", "rank", "peers", "store_address", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: _job_pb2.JobSpec
    plan: _job_pb2.Plan
    rank: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    store_address: str
    attempt: int
    def __init__(self, job: _Optional[_Union[_job_pb2.JobSpec, _Mapping]] = ..., plan: _Optional[_Union[_job_pb2.Plan, _Mapping]] = ..., rank: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., store_address: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class AssignReply(_message.Message):
    __slots__ = ("role", "actions", "parameter_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    actions: _containers.RepeatedScalarFieldContainer[str]
    parameter_bytes: int
    def __init__(self, role: _Optional[str] = ..., actions: _Optional[_Iterable[str]] = ..., parameter_bytes: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step", "losses", "compute_seconds", "idle_seconds", "memory_bytes", "peak_memory_bytes", "bytes_sent", "bytes_stashed", "weight_version", "action_seconds", "spans", "versions", "kept_versions", "kind_peak_bytes", "activation_peak_bytes")
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
    def __init__(self, step: _Optional[int] = ..., losses: _Optional[_Iterable[float]] = ..., compute_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., memory_bytes: _Optional[_Mapping[str, int]] = ..., peak_memory_bytes: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_stashed: _Optional[int] = ..., weight_version: _Optional[int] = ..., action_seconds: _Optional[_Mapping[str, float]] = ..., spans: _Optional[_Iterable[_Union[ActionSpan, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[VersionTag, _Mapping]]] = ..., kept_versions: _Optional[_Iterable[int]] = ..., kind_peak_bytes: _Optional[_Mapping[str, int]] = ..., activation_peak_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    def __init__(self, drained: _Optional[bool] = ...) -> None: ...
