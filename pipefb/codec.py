"""The one tensor codec: dtype allow-list, shape and raw little-endian bytes; never pickles.

`encode`/`decode` are the wire API (the header travels in protobuf fields, the bytes in
messages of at most `CHUNK_BYTES`, `protos.wire`); `pack`/`unpack` frame one tensor as a single
self-describing value for storage (the offload store). Every decode validates the dtype,
the rank, each dimension and the byte count, overflow-checked, before allocating.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import torch

from pipefb.errors import CodecError

# Allow-listed dtypes by wire name. The order fixes the numeric codes of `pack` frames and
# matches the `DType` enum of protos/tensor.proto (code = index + 1); a test checks both.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
CODES: dict[str, int] = {name: code for code, name in enumerate(DTYPES, start=1)}
ITEMSIZE: dict[str, int] = {
    name: torch.empty((), dtype=d).element_size() for name, d in DTYPES.items()
}

_NUMPY_DTYPES = frozenset(DTYPES.values()) - {torch.bfloat16}  # those numpy can view

MAX_RANK = 8  # deepest tensor any pipefb layer exchanges; more is hostile or a bug
CHUNK_BYTES = 1 << 20  # largest data chunk in one gRPC message (1 MiB)
DEFAULT_MAX_BYTES = 1 << 31  # 2 GiB: the largest single tensor a peer may make us allocate

_MAGIC = b"PFT1"
_HEADER = struct.Struct("<4sBB")  # magic, dtype code, rank
_DIM = struct.Struct("<q")
FRAME_PREFIX = _HEADER.size  # a frame's first bytes, which fix its header's length

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("pipefb's codec assumes a little-endian host")


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as the wire carries it: dtype name, shape and raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def raw_view(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    """The dtype name, shape and a byte view of a tensor: no copy if it is already dense.

    The view aliases the tensor's memory; it stays valid while the caller holds it.

    Raises:
        CodecError: the dtype is not on the allow-list.
    """
    name = NAMES.get(tensor.dtype)
    if name is None:
        raise CodecError(f"dtype {tensor.dtype} is not allowed on the wire")
    if (tensor.is_cpu and not tensor.requires_grad and tensor.dtype in _NUMPY_DTYPES
            and tensor.is_contiguous() and tensor.numel()):
        # one call where the general path below makes five: a hop sends on the compute
        # thread, and each torch call after a wake-up costs it microseconds
        return name, tuple(tensor.shape), tensor.numpy().data.cast("B")
    flat = tensor.detach().to("cpu").reshape(-1)
    if flat.stride() != (1,):  # size-1 dims can leave a stride torch calls contiguous
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    return name, tuple(tensor.shape), flat.view(torch.uint8).numpy().data


def encode(tensor: torch.Tensor) -> EncodedTensor:
    """Encodes a tensor of any strides as dtype name, shape and raw bytes (one copy).

    Raises:
        CodecError: the dtype is not on the allow-list.
    """
    name, shape, view = raw_view(tensor)
    return EncodedTensor(name, shape, view.tobytes())


def check_header(dtype: str, shape: tuple[int, ...] | list[int], max_bytes: int) -> int:
    """Validates a tensor header and returns the byte count it implies.

    Raises:
        CodecError: unknown dtype, rank above `MAX_RANK`, a negative dimension, or a size
            above `max_bytes` (checked as it is multiplied, so it cannot overflow; zero
            dimensions count as 1 in this bound).
    """
    if dtype not in DTYPES:
        raise CodecError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if len(shape) > MAX_RANK:
        raise CodecError(f"rank {len(shape)} exceeds the maximum {MAX_RANK}")
    # The span counts a zero dimension as 1: an empty tensor whose other dimensions are huge
    # would overflow torch's stride arithmetic, so it is bounded by max_bytes too.
    span = ITEMSIZE[dtype]
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise CodecError(f"dimension {dim!r} of shape {list(shape)} is not a size")
        if max(dim, 1) > max_bytes // span:
            raise CodecError(f"shape {list(shape)} of {dtype} exceeds {max_bytes} bytes")
        span *= max(dim, 1)
    if span > max_bytes:
        raise CodecError(f"shape {list(shape)} of {dtype} exceeds {max_bytes} bytes")
    return 0 if 0 in shape else span


def decode(
    dtype: str,
    shape: tuple[int, ...] | list[int],
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> torch.Tensor:
    """Decodes raw bytes into a new, writable tensor after validating the header.

    Raises:
        CodecError: a bad header (see `check_header`), a byte count that does not match,
            or bool data with bytes other than 0 and 1.
    """
    shape = tuple(shape)
    nbytes = check_header(dtype, shape, max_bytes)
    raw = _byte_view(data)
    if len(raw) != nbytes:
        raise CodecError(
            f"{dtype} tensor of shape {list(shape)} needs {nbytes} bytes, got {len(raw)}"
        )
    out = torch.empty(shape, dtype=DTYPES[dtype])
    if nbytes:
        out_bytes = out.reshape(-1).view(torch.uint8)
        out_bytes.numpy()[:] = raw
        if dtype == "bool" and bool((out_bytes > 1).any()):
            raise CodecError("bool tensor data holds bytes other than 0 and 1")
    return out


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """Returns `data` as a flat view of bytes (so `len` counts bytes, not items)."""
    try:
        return memoryview(data).cast("B")
    except TypeError as exc:  # a non-contiguous or non-buffer object
        raise CodecError(f"tensor data of type {type(data).__name__} is not bytes: {exc}") from exc


def pack_parts(tensor: torch.Tensor) -> tuple[bytes, memoryview]:
    """The frame of `pack` as (header, data view): no copy of a dense tensor's data; the
    view aliases the tensor and stays valid while the caller holds it."""
    name, shape, view = raw_view(tensor)
    dims = b"".join(_DIM.pack(d) for d in shape)
    return _HEADER.pack(_MAGIC, CODES[name], len(shape)) + dims, view


def pack(tensor: torch.Tensor) -> bytes:
    """Frames one tensor as a self-describing value: magic, dtype code, rank, dims, data."""
    head, data = pack_parts(tensor)
    return head + data


def unpack(
    frame: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> torch.Tensor:
    """Inverts `pack`, validating the frame before allocating.

    Raises:
        CodecError: a truncated or foreign frame, or any header error of `decode`.
    """
    view = _byte_view(frame)
    dtype, shape, start = _frame_header(view)
    return decode(dtype, shape, view[start:], max_bytes=max_bytes)


def unpack_in_place(frame: torch.Tensor, *, max_bytes: int = DEFAULT_MAX_BYTES
                    ) -> torch.Tensor:
    """`unpack` of a frame held in a 1-D uint8 CPU tensor the caller gives away: the same
    checks, before any tensor of the value exists, then a tensor that views the frame's
    data (no copy) where the data starts at an address its dtype's size divides; else a
    copy, as `unpack` makes.

    Raises:
        CodecError: as `unpack`.
    """
    if frame.dtype != torch.uint8 or frame.dim() != 1 or not frame.is_contiguous():
        raise CodecError(f"a frame in place is a flat uint8 tensor, not {frame.dtype} "
                         f"of shape {list(frame.shape)}")
    view = frame.numpy().data.cast("B")
    dtype, shape, start = _frame_header(view)
    nbytes = check_header(dtype, shape, max_bytes)
    if len(view) - start != nbytes:
        raise CodecError(f"{dtype} tensor of shape {list(shape)} needs {nbytes} bytes, "
                         f"got {len(view) - start}")
    data = frame[start:]
    if (data.data_ptr() % ITEMSIZE[dtype]) or not nbytes:
        return decode(dtype, shape, view[start:], max_bytes=max_bytes)
    if dtype == "bool" and bool((data > 1).any()):
        raise CodecError("bool tensor data holds bytes other than 0 and 1")
    return data.view(DTYPES[dtype]).view(shape)


def frame_head_bytes(prefix: bytes | bytearray | memoryview) -> int | None:
    """The length of the header of a frame that starts with `prefix` (its first
    `FRAME_PREFIX` bytes or more); None where `prefix` is shorter or not a frame's start.

    Only where a receiver places the frame rests on it (its data on an aligned address):
    `unpack` still checks the whole frame.
    """
    if len(prefix) < _HEADER.size:
        return None
    magic, _, rank = _HEADER.unpack_from(prefix)
    return _HEADER.size + rank * _DIM.size if magic == _MAGIC else None


def _frame_header(view: memoryview) -> tuple[str, tuple[int, ...], int]:
    """A frame's dtype, shape and where its data starts, after checking its magic, dtype
    code, rank and length against the header (the shape's size is `check_header`'s).

    Raises:
        CodecError: a truncated or foreign frame.
    """
    if len(view) < _HEADER.size:
        raise CodecError(f"frame of {len(view)} bytes is shorter than its header")
    magic, code, rank = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise CodecError(f"frame magic {magic!r} is not {_MAGIC!r}")
    if not 1 <= code <= len(DTYPES):
        raise CodecError(f"dtype code {code} is not one of 1..{len(DTYPES)}")
    if rank > MAX_RANK:
        raise CodecError(f"rank {rank} exceeds the maximum {MAX_RANK}")
    start = _HEADER.size + rank * _DIM.size
    if len(view) < start:
        raise CodecError(f"frame of {len(view)} bytes is shorter than its {rank} dimensions")
    shape = tuple(_DIM.unpack_from(view, _HEADER.size + i * _DIM.size)[0] for i in range(rank))
    return list(DTYPES)[code - 1], shape, start
