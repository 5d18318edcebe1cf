"""Tensor streams over protobuf: round trips, chunk limits, and hostile streams rejected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefb import codec
from pipefb.errors import CodecError
from protos import tensor_pb2, wire


def transfer() -> tensor_pb2.Transfer:
    return tensor_pb2.Transfer(job_id="j", step=1, microbatch=2, stage=1, version=1,
                               kind="RECV_F")


def test_proto_enum_matches_codec() -> None:
    for name, code in codec.CODES.items():
        assert tensor_pb2.DType.Value(name.upper()) == code
    assert len(tensor_pb2.DType.keys()) == len(codec.DTYPES) + 1  # plus UNSPECIFIED


def test_round_trip_named_tensors_of_every_dtype() -> None:
    tensors = {n: torch.arange(6).reshape(2, 3).to(dtype) for n, dtype in codec.DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 5)
    tensors["strided"] = torch.arange(20.0).reshape(4, 5).t()[::2]
    got_transfer, got = wire.decode_stream(wire.encode_stream(transfer(), tensors))
    assert got_transfer.tensor_count == len(tensors)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)


def test_large_tensor_is_chunked_at_one_mebibyte() -> None:
    big = torch.randn(3 * (1 << 20) // 4 + 7)  # 3 MiB + 28 bytes of float32
    messages = list(wire.encode_stream(transfer(), {"x": big}))
    assert len(messages) == 4
    assert all(len(m.data) <= codec.CHUNK_BYTES for m in messages)
    assert messages[0].HasField("transfer") and not messages[1].HasField("transfer")
    torch.testing.assert_close(wire.decode_stream(messages)[1]["x"], big, rtol=0, atol=0)


def header(name: str = "x", dtype: int = 3, shape: tuple[int, ...] = (2,), nbytes: int = 8
           ) -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=shape, nbytes=nbytes)


def first(count: int = 1, **kw: object) -> tensor_pb2.TensorChunk:
    t = transfer()
    t.tensor_count = count
    return tensor_pb2.TensorChunk(transfer=t, header=header(**kw), data=b"\0" * 8)  # type: ignore[arg-type]


HOSTILE = {
    "no transfer header": [tensor_pb2.TensorChunk(header=header(), data=b"\0" * 8)],
    "empty stream": [],
    "unspecified dtype": [first(dtype=0)],
    "unknown dtype": [first(dtype=99)],
    "negative dim": [first(shape=(-2,))],
    "rank above max": [first(shape=(1,) * 9, nbytes=4)],
    "overflowing shape": [first(shape=(2**62, 2**62), nbytes=8)],
    "nbytes lies": [first(nbytes=16)],
    "too many bytes": [first(), tensor_pb2.TensorChunk(data=b"\0")],
    "too few bytes": [first(shape=(4,), nbytes=16)],
    "count lies": [first(count=2)],
    "more tensors than announced": [first(), tensor_pb2.TensorChunk(header=header("y"),
                                                                     data=b"\0" * 8)],
    "duplicate name": [first(count=2), tensor_pb2.TensorChunk(header=header(), data=b"\0" * 8)],
    "chunk over 1 MiB": [first(shape=(1 << 19,), nbytes=1 << 21, count=1),
                         tensor_pb2.TensorChunk(data=b"\0" * ((1 << 20) + 1))],
    "nameless tensor": [first(name="")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_stream_is_rejected(case: str) -> None:
    with pytest.raises(CodecError):
        wire.decode_stream(HOSTILE[case])


def test_announced_size_above_limit_is_refused_before_allocation() -> None:
    msg = first(shape=(1 << 40,), nbytes=4 << 40)
    with pytest.raises(CodecError, match="exceeds"):
        wire.decode_stream([msg])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_messages_raise_only_codec_errors(blobs: list[bytes]) -> None:
    messages = []
    for blob in blobs:
        msg = tensor_pb2.TensorChunk()
        try:
            msg.ParseFromString(blob)
        except Exception:
            continue
        messages.append(msg)
    try:
        wire.decode_stream(messages)
    except CodecError:
        pass
