"""Named tensors <-> streams of `TensorChunk` messages, validated before any allocation.

[Note: packed messages]
A message carries up to `codec.CHUNK_BYTES` of data, and the headers of the tensors that
start in it: first the rest of the tensor under way, then each new tensor's bytes in
order, the last of them possibly going on in the next messages. Each gRPC message costs
the stream a hand-off between the sender's and the receiver's threads, so a transfer of
many small tensors, each in messages of its own, would take much longer than one tensor of
the same bytes. Packed, a stage's weights (two tensors per Linear, a dozen per transformer
block) go in as many messages as their bytes need, as one tensor of that size would.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from pipefb import codec
from pipefb.errors import CodecError
from protos import tensor_pb2

Tensors = dict[str, torch.Tensor]
MAX_TENSORS = 4096  # most tensors one stream may announce (a whole stage's parameters)


def dtype_enum(name: str) -> int:
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
    """Yields the messages of one transfer, each up to `codec.CHUNK_BYTES` of data: small
    tensors share a message (each message costs the stream a thread hand-off), a large one
    spans several ([Note: packed messages])."""
    transfer.tensor_count = len(tensors)
    msg, pieces, room = tensor_pb2.TensorChunk(transfer=transfer), [], codec.CHUNK_BYTES
    for name, tensor in tensors.items():
        if room == 0:
            yield _sealed(msg, pieces)
            msg, pieces, room = tensor_pb2.TensorChunk(), [], codec.CHUNK_BYTES
        dtype, shape, view = codec.raw_view(tensor)  # data is copied straight from it
        msg.headers.add(name=name, dtype=dtype_enum(dtype), shape=shape, nbytes=len(view))
        offset = min(room, len(view))
        pieces.append(view[:offset])
        room -= offset
        while offset < len(view):  # the message is full: the tensor goes on in the next
            yield _sealed(msg, pieces)
            msg = tensor_pb2.TensorChunk()
            piece = view[offset:offset + codec.CHUNK_BYTES]
            pieces, room, offset = [piece], codec.CHUNK_BYTES - len(piece), offset + len(piece)
    yield _sealed(msg, pieces)


def _sealed(msg: tensor_pb2.TensorChunk, pieces: list[memoryview]) -> tensor_pb2.TensorChunk:
    """`msg` with `pieces` as its data (one copy)."""
    msg.data = b"".join(pieces)
    return msg


@dataclass
class _Pending:
    name: str
    tensor: torch.Tensor
    buffer: memoryview
    filled: int = 0


def check_tensor_header(header: tensor_pb2.TensorHeader, max_bytes: int
                        ) -> tuple[torch.dtype, tuple[int, ...], int]:
    """The dtype, shape and byte count a tensor header announces, once validated.

    Raises:
        CodecError: an unknown dtype, a bad shape, a size over `max_bytes`, a byte count
            that disagrees with the shape, or no name.
    """
    dtype = _dtype_name(header.dtype)
    shape = tuple(int(d) for d in header.shape)
    nbytes = codec.check_header(dtype, shape, max_bytes)
    if header.nbytes != nbytes:
        raise CodecError(
            f"tensor {header.name!r} declares {header.nbytes} bytes, its shape {nbytes}")
    if not header.name:
        raise CodecError("tensor header without a name")
    return codec.DTYPES[dtype], shape, nbytes


def empty_tensor(header: tensor_pb2.TensorHeader, max_bytes: int) -> torch.Tensor:
    """The tensor `header` announces, allocated after its header is validated.

    Raises:
        CodecError: as `check_tensor_header`.
    """
    dtype, shape, _ = check_tensor_header(header, max_bytes)
    return torch.empty(shape, dtype=dtype)


def tensor_on(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor viewing `data` (no copy), whose length `check_tensor_header` gave for
    `dtype` and `shape`."""
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a dense tensor's memory."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _start_tensor(header: tensor_pb2.TensorHeader, max_bytes: int) -> _Pending:
    tensor = empty_tensor(header, max_bytes)
    return _Pending(header.name, tensor, byte_view(tensor))


def _finish(pending: _Pending, out: dict[str, torch.Tensor]) -> None:
    if pending.filled != len(pending.buffer):
        raise CodecError(
            f"tensor {pending.name!r} got {pending.filled} of {len(pending.buffer)} bytes"
        )
    if pending.name in out:
        raise CodecError(f"tensor {pending.name!r} sent twice")
    out[pending.name] = pending.tensor


class TransferDecoder:
    """Reassembles consecutive transfers from one stream, message by message.

    A transfer starts with a message carrying `transfer` and ends with the last byte of its
    `tensor_count`-th tensor; the next message may start the next transfer. Every header
    is validated before its tensor is allocated.
    """

    def __init__(self, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._reset()

    def _reset(self) -> None:
        self.transfer: tensor_pb2.Transfer | None = None
        self.out: dict[str, torch.Tensor] = {}
        self.pending: _Pending | None = None

    def feed(self, msg: tensor_pb2.TensorChunk
             ) -> tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]] | None:
        """Takes one message; returns the transfer it completes, if any.

        Raises:
            CodecError: a message outside a transfer, a transfer header inside one, a bad
                tensor header, a header before the tensor under way has all its bytes, data
                beyond the message's tensors, too many tensors, a chunk over 1 MiB, a
                duplicate name.
        """
        count = self._start_transfer(msg)
        data = memoryview(msg.data)
        if len(data) > codec.CHUNK_BYTES:
            raise CodecError(f"chunk of {len(data)} bytes exceeds {codec.CHUNK_BYTES}")
        used = self._fill(data) if self.pending is not None else 0
        for header in msg.headers:
            if self.pending is not None:
                raise CodecError(f"tensor {self.pending.name!r} got {self.pending.filled} of "
                                 f"{len(self.pending.buffer)} bytes before the next header")
            if len(self.out) >= count:
                raise CodecError(f"more tensors than the announced {count}")
            self.pending = _start_tensor(header, self.max_bytes)
            used += self._fill(data[used:])
        if used < len(data):
            raise CodecError(f"{len(data) - used} bytes of a message belong to no tensor")
        return self._complete()

    def _fill(self, data: memoryview) -> int:
        """Gives the tensor under way what it still lacks from the front of `data`; a full
        tensor is finished. Returns how many bytes it took."""
        pending = self.pending
        assert pending is not None
        n = min(len(data), len(pending.buffer) - pending.filled)
        pending.buffer[pending.filled:pending.filled + n] = data[:n]
        pending.filled += n
        if pending.filled == len(pending.buffer):
            _finish(pending, self.out)
            self.pending = None
        return n

    def _start_transfer(self, msg: tensor_pb2.TensorChunk) -> int:
        """Opens a transfer on its header message; returns the current one's tensor count."""
        if msg.HasField("transfer"):
            if self.transfer is not None:
                raise CodecError("a transfer header arrived inside an unfinished transfer")
            if not 0 <= msg.transfer.tensor_count <= MAX_TENSORS:
                raise CodecError(
                    f"tensor_count {msg.transfer.tensor_count} is not in 0..{MAX_TENSORS}")
            self.transfer = msg.transfer
        elif self.transfer is None:
            raise CodecError("message outside any transfer (no transfer header)")
        return self.transfer.tensor_count

    def _complete(self) -> tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]] | None:
        assert self.transfer is not None
        if self.pending is not None or len(self.out) < self.transfer.tensor_count:
            return None
        done = (self.transfer, self.out)
        self._reset()
        return done

    def close(self) -> None:
        """Raises CodecError if the stream ended inside a transfer."""
        if self.transfer is not None:
            count = len(self.out) + (self.pending is not None)
            raise CodecError(f"stream ended inside a transfer: {count} of "
                             f"{self.transfer.tensor_count} tensors, the last incomplete")


def decode_transfers(
    messages: Iterable[tensor_pb2.TensorChunk], *, max_bytes: int = codec.DEFAULT_MAX_BYTES
) -> Iterator[tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]]]:
    """Yields each complete transfer of a stream as soon as its last byte arrives."""
    decoder = TransferDecoder(max_bytes)
    for msg in messages:
        done = decoder.feed(msg)
        if done is not None:
            yield done
    decoder.close()


def decode_stream(
    messages: Iterable[tensor_pb2.TensorChunk], *, max_bytes: int = codec.DEFAULT_MAX_BYTES
) -> tuple[tensor_pb2.Transfer, dict[str, torch.Tensor]]:
    """Reassembles a stream that carries exactly one transfer.

    Raises:
        CodecError: any error of `TransferDecoder`, an empty stream or a second transfer.
    """
    found = None
    for done in decode_transfers(messages, max_bytes=max_bytes):
        if found is not None:
            raise CodecError("stream carried more than one transfer")
        found = done
    if found is None:
        raise CodecError("empty stream")
    return found
