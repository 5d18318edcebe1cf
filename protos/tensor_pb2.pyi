from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType
FLOAT64: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
BOOL: DType

class Transfer(_message.Message):
    __slots__ = ("job_id", "step", "microbatch", "stage", "version", "tensor_count", "kind", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    microbatch: int
    stage: int
    version: int
    tensor_count: int
    kind: str
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., stage: _Optional[int] = ..., version: _Optional[int] = ..., tensor_count: _Optional[int] = ..., kind: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("transfer", "data", "headers")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    data: bytes
    headers: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ..., data: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("bytes", "tensors")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    tensors: int
    def __init__(self, bytes: _Optional[int] = ..., tensors: _Optional[int] = ...) -> None: ...
