"""Tensor streams over protobuf: round trips, chunk limits, and hostile streams rejected."""

from __future__ import annotations

from unittest.mock import patch

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


def test_small_tensors_share_messages_and_large_ones_span_several() -> None:
    """[Note: packed messages]: 200 weights of 4 KiB go in one message; after a 2.5 MiB
    tensor they fill the rest of its last message, then one more."""
    small = {f"{i}.weight": torch.full((1024,), float(i)) for i in range(200)}
    messages = list(wire.encode_stream(transfer(), small))
    assert len(messages) == 1 and len(messages[0].headers) == 200
    mixed = {"a": torch.ones(10), "big": torch.randn(5 * (1 << 20) // 8), **small}
    messages = list(wire.encode_stream(transfer(), mixed))
    assert [len(m.headers) for m in messages] == [2, 0, 128, 72]  # 40 B + 2.5 MiB + 800 KiB
    assert [len(m.data) for m in messages] == [1 << 20] * 3 + [40 + 5 * (1 << 19) + 200 * 4096
                                                                - 3 * (1 << 20)]
    got = wire.decode_stream(messages)[1]
    assert list(got) == list(mixed)
    for name, t in mixed.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=12), chunk=st.integers(1, 33))
def test_any_tensor_sizes_round_trip_through_any_chunk_size(sizes: list[int], chunk: int
                                                            ) -> None:
    """Every split of tensors over messages decodes to the same tensors, bit for bit, with
    no message over the chunk size (patched small, so tensors straddle many messages)."""
    tensors = {f"t{i}": torch.arange(n, dtype=torch.int8) + i for i, n in enumerate(sizes)}
    with patch.object(codec, "CHUNK_BYTES", chunk):
        messages = list(wire.encode_stream(transfer(), tensors))
        assert all(len(m.data) <= chunk for m in messages)
        assert sum(len(m.data) for m in messages) == sum(sizes)
        got = wire.decode_stream(messages)[1]
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], t)


def header(name: str = "x", dtype: int = 3, shape: tuple[int, ...] = (2,), nbytes: int = 8
           ) -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(name=name, dtype=dtype, shape=shape, nbytes=nbytes)


def first(count: int = 1, data: bytes = b"\0" * 8,
          extra: list[tensor_pb2.TensorHeader] | None = None, **kw: object
          ) -> tensor_pb2.TensorChunk:
    """A transfer's first message: tensor "x" (of `header(**kw)`), then `extra` headers."""
    t = transfer()
    t.tensor_count = count
    return tensor_pb2.TensorChunk(transfer=t, headers=[header(**kw), *(extra or [])],  # type: ignore[arg-type]
                                  data=data)


HOSTILE = {
    "no transfer header": [tensor_pb2.TensorChunk(headers=[header()], data=b"\0" * 8)],
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
    "more tensors than announced": [first(), tensor_pb2.TensorChunk(headers=[header("y")],
                                                                     data=b"\0" * 8)],
    "duplicate name": [first(count=2), tensor_pb2.TensorChunk(headers=[header()],
                                                              data=b"\0" * 8)],
    "duplicate name in one message": [first(count=2, data=b"\0" * 16, extra=[header()])],
    "header before the last tensor is full": [first(count=2, shape=(4,), nbytes=16,
                                                    extra=[header("y")])],
    "bytes beyond its tensors": [first(data=b"\0" * 9)],
    "data before any header": [
        tensor_pb2.TensorChunk(transfer=tensor_pb2.Transfer(tensor_count=1), data=b"\0")],
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
