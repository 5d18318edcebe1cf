"""Named tensors <-> streams of `TensorChunk` messages, validated before any allocation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from pipefb import codec
from pipefb.errors import CodecError
from protos import tensor_pb2

Tensors = dict[str, torch.Tensor]
MAX_TENSORS = 4096  # most tensors one stream may announce (a whole stage's parameters)


def _dtype_enum(name: str) -> int:
    return codec.CODES[name]


def _dtype_name(value: int) -> str:
    if not 1 <= value <= len(codec.DTYPES):
        raise CodecError(f"dtype enum {value} is not one of 1..{len(codec.DTYPES)}")
    return list(codec.DTYPES)[value - 1]


def check_enum_matches_codec() -> None:
    """Raises CodecError if protos' DType enum and pipefb.codec.DTYPES disagree."""
    for name, code in codec.CODES.items():
        if tensor_pb2.DType.Value(name.upper()) != code:
            raise CodecError(f"DType.{name.upper()} != codec code {code}")


check_enum_matches_codec()


def encode_stream(
    transfer: tensor_pb2.Transfer, tensors: Mapping[str, torch.Tensor]
) -> Iterator[tensor_pb2.TensorChunk]:
    """Yields the messages of one transfer: header first, each tensor in <= 1 MiB chunks."""
    transfer.tensor_count = len(tensors)
    first = True
    if not tensors:
        yield tensor_pb2.TensorChunk(transfer=transfer)
        return
    for name, tensor in tensors.items():
        enc = codec.encode(tensor)
        header = tensor_pb2.TensorHeader(
            name=name, dtype=_dtype_enum(enc.dtype), shape=enc.shape, nbytes=len(enc.data)
        )
        for i, piece in enumerate(codec.chunks(enc.data)):
            msg = tensor_pb2.TensorChunk(data=bytes(piece))
            if i == 0:
                msg.header.CopyFrom(header)
            if first:
                msg.transfer.CopyFrom(transfer)
                first = False
            yield msg


@dataclass
class _Pending:
    name: str
    tensor: torch.Tensor
    buffer: memoryview
    filled: int = 0


def _start_tensor(header: tensor_pb2.TensorHeader, max_bytes: int) -> _Pending:
    dtype = _dtype_name(header.dtype)
    shape = tuple(int(d) for d in header.shape)
    nbytes = codec.check_header(dtype, shape, max_bytes)
    if header.nbytes != nbytes:
        raise CodecError(
            f"tensor {header.name!r} declares {header.nbytes} bytes, its shape {nbytes}")
    if not header.name:
        raise CodecError("tensor header without a name")
    tensor = torch.empty(shape, dtype=codec.DTYPES[dtype])
    return _Pending(header.name, tensor, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def _append(pending: _Pending, data: bytes) -> None:
    if len(data) > codec.CHUNK_BYTES:
        raise CodecError(f"chunk of {len(data)} bytes exceeds {codec.CHUNK_BYTES}")
    end = pending.filled + len(data)
    if end > len(pending.buffer):
        raise CodecError(f"tensor {pending.name!r} got more than its {len(pending.buffer)} bytes")
    pending.buffer[pending.filled : end] = data
    pending.filled = end


def _finish(pending: _Pending, out: dict[str, torch.Tensor]) -> None:
    if pending.filled != len(pending.buffer):
        raise CodecError(
            f"tensor {pending.name!r} got {pending.filled} of {len(pending.buffer)} bytes"
        )
    if pending.name in out:
        raise CodecError(f"tensor {pending.name!r} sent twice")
    out[pending.name] = pending.tensor


def decode_stream(
    messages: Iterable[tensor_pb2.TensorChunk], *, max_bytes: int = codec.DEFAULT_MAX_BYTES
) -> tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]]:
    """Reassembles one transfer; every header is validated before its tensor is allocated.

    Raises:
        CodecError: a missing transfer header, a bad tensor header, too many or too few
            bytes, a chunk over 1 MiB, a duplicate name, or a tensor count that differs.
    """
    transfer: tensor_pb2.Transfer | None = None
    out: dict[str, torch.Tensor] = {}
    pending: _Pending | None = None
    for msg in messages:
        if transfer is None:
            if not msg.HasField("transfer"):
                raise CodecError("stream does not start with a transfer header")
            transfer = msg.transfer
            if not 0 <= transfer.tensor_count <= MAX_TENSORS:
                raise CodecError(f"tensor_count {transfer.tensor_count} is not in 0..{MAX_TENSORS}")
        if msg.HasField("header"):
            if pending is not None:
                _finish(pending, out)
            if len(out) >= transfer.tensor_count:
                raise CodecError(f"more tensors than the announced {transfer.tensor_count}")
            pending = _start_tensor(msg.header, max_bytes)
        elif msg.data and pending is None:
            raise CodecError("data chunk before any tensor header")
        if pending is not None:
            _append(pending, msg.data)
    if transfer is None:
        raise CodecError("empty stream")
    if pending is not None:
        _finish(pending, out)
    if len(out) != transfer.tensor_count:
        raise CodecError(f"stream carried {len(out)} tensors, announced {transfer.tensor_count}")
    return transfer, out
