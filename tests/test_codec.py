"""Round trips and hostile inputs for pipefb.codec."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipefb import codec
from pipefb.errors import CodecError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def make(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dtype = codec.DTYPES[dtype_name]
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def roundtrip(t: torch.Tensor) -> None:
    enc = codec.encode(t)
    assert len(enc.data) == t.numel() * t.element_size()
    out = codec.decode(enc.dtype, enc.shape, enc.data)
    assert out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()
    assert codec.encode(out).data == enc.data  # bit-exact, NaN and -0.0 included
    assert torch.equal(out, t.contiguous()) or t.dtype.is_floating_point
    packed = codec.unpack(codec.pack(t))
    assert packed.dtype == t.dtype and torch.equal(packed, out)


@pytest.mark.parametrize("dtype_name", list(codec.DTYPES))
@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_roundtrip_every_dtype(dtype_name: str, shape: tuple[int, ...], seed: int) -> None:
    roundtrip(make(dtype_name, shape, seed))


@pytest.mark.parametrize("dtype_name", list(codec.DTYPES))
@SETTINGS
@given(
    shape=st.lists(st.integers(1, 6), min_size=2, max_size=4).map(tuple),
    step=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_roundtrip_non_contiguous(
    dtype_name: str, shape: tuple[int, ...], step: int, seed: int
) -> None:
    base = make(dtype_name, shape, seed)
    for view in (base.transpose(0, -1), base[..., ::step], base[::step, ...][1:]):
        roundtrip(view)


def test_zero_dim_and_empty() -> None:
    roundtrip(torch.tensor(3.5))
    roundtrip(torch.zeros(0, 3, dtype=torch.int16))
    assert codec.decode("float32", (), struct.pack("<f", 1.5)).item() == 1.5


def test_decoded_tensor_owns_writable_memory() -> None:
    data = bytearray(struct.pack("<4f", 1, 2, 3, 4))
    out = codec.decode("float32", [4], data)
    data[:] = bytes(16)
    out += 1  # writable
    assert out.tolist() == [2, 3, 4, 5]


def test_bfloat16_bits_exact() -> None:
    t = torch.tensor([1.0, -2.5, float("inf"), 1e-30], dtype=torch.bfloat16)
    assert codec.encode(t).data == t.view(torch.int16).numpy().tobytes()
    roundtrip(t)


def test_dtype_codes_are_stable() -> None:
    assert list(codec.DTYPES) == [
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "bool",
    ]
    assert codec.CODES["float16"] == 1 and codec.CODES["bool"] == 10


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "needle"),
    [
        ("complex64", (1,), 8, "complex64"),
        ("float32", (1,) * (codec.MAX_RANK + 1), 4, "rank"),
        ("float32", (2, -1), 0, "-1"),
        ("float32", (2**62, 2**62), 0, "exceeds"),
        ("float32", (0, 2**62, 2**62), 0, "exceeds"),  # empty, but strides would overflow
        ("float32", (3,), 8, "needs 12 bytes, got 8"),
        ("int64", (2,), 17, "needs 16 bytes, got 17"),
        ("float32", (2.0,), 8, "2.0"),
        ("float32", (True,), 4, "True"),
    ],
)
def test_decode_rejects(dtype: str, shape: tuple, nbytes: int, needle: str) -> None:
    with pytest.raises(CodecError, match=needle.replace("(", r"\(")):
        codec.decode(dtype, shape, bytes(nbytes))


def test_decode_respects_max_bytes() -> None:
    with pytest.raises(CodecError, match="exceeds 64 bytes"):
        codec.decode("float64", (9,), bytes(72), max_bytes=64)
    assert codec.decode("float64", (8,), bytes(64), max_bytes=64).shape == (8,)


def test_bool_bytes_must_be_zero_or_one() -> None:
    with pytest.raises(CodecError, match="bool"):
        codec.decode("bool", (3,), bytes([0, 1, 2]))


def test_encode_rejects_unknown_dtype() -> None:
    with pytest.raises(CodecError, match="complex64"):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


def frame(code: int, dims: list[int], data: bytes = b"", magic: bytes = b"PFT1") -> bytes:
    head = struct.pack("<4sBB", magic, code, len(dims))
    return head + b"".join(struct.pack("<q", d) for d in dims) + data


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "shorter than its header"),
        (b"PFT1\x03", "shorter than its header"),
        (frame(3, [2], bytes(8), magic=b"XXXX"), "magic"),
        (frame(0, [1], bytes(4)), "dtype code 0"),
        (frame(11, [1], bytes(4)), "dtype code 11"),
        (frame(3, [1] * 9, bytes(4)), "rank 9"),
        (frame(3, [2, 2])[:-3], "shorter than its 2 dimensions"),
        (frame(3, [-4], bytes(0)), "-4"),
        (frame(3, [2**62, 2**62]), "exceeds"),
        (frame(3, [4], bytes(15)), "needs 16 bytes, got 15"),
        (frame(3, [4], bytes(17)), "needs 16 bytes, got 17"),
    ],
)
def test_unpack_rejects(raw: bytes, needle: str) -> None:
    with pytest.raises(CodecError, match=needle):
        codec.unpack(raw)


def test_unpack_truncated_frames() -> None:
    packed = codec.pack(torch.arange(6, dtype=torch.int32).reshape(2, 3))
    for cut in range(len(packed)):
        with pytest.raises(CodecError):
            codec.unpack(packed[:cut])


@settings(max_examples=1000, deadline=None)  # issue 8: >= 1000 cases per entry point
@given(raw=st.binary(max_size=120))
def test_unpack_random_bytes_only_raises_codec_error(raw: bytes) -> None:
    try:
        codec.unpack(raw)
    except CodecError:
        pass


@settings(max_examples=1000, deadline=None)  # issue 8: >= 1000 cases per entry point
@given(
    code=st.integers(0, 12),
    dims=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=9),
    data=st.binary(max_size=64),
)
def test_unpack_random_headers_only_raise_codec_error(
    code: int, dims: list[int], data: bytes
) -> None:
    try:
        out = codec.unpack(frame(code, dims, data))
    except CodecError:
        return
    assert out.numel() * out.element_size() == len(data)


def _frame_at(tensor: torch.Tensor, skew: int) -> torch.Tensor:
    """`tensor`'s frame in a uint8 tensor, its data `skew` bytes past a 64-byte boundary."""
    frame = codec.pack(tensor)
    head = len(frame) - tensor.numel() * tensor.element_size()
    buf = torch.empty(128 + len(frame), dtype=torch.uint8)[(-head + skew) % 64:][:len(frame)]
    buf.numpy()[:] = memoryview(frame)
    return buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.bool, torch.uint8])
def test_unpack_in_place_views_an_aligned_frame_and_copies_a_skewed_one(
        dtype: torch.dtype) -> None:
    src = (torch.arange(24).reshape(2, 3, 4) % 2).to(dtype)
    aligned = _frame_at(src, 0)
    got = codec.unpack_in_place(aligned)
    assert torch.equal(got, src) and got.shape == src.shape and got.dtype == dtype
    assert got.untyped_storage().data_ptr() == aligned.untyped_storage().data_ptr()  # a view
    skewed = _frame_at(src, 1)
    copied = codec.unpack_in_place(skewed)
    assert torch.equal(copied, src)
    if dtype.itemsize > 1:  # a misaligned start is copied, as `unpack` does
        assert copied.untyped_storage().data_ptr() != skewed.untyped_storage().data_ptr()


def test_unpack_in_place_checks_as_unpack_does() -> None:
    frame = _frame_at(torch.ones(8), 0)
    with pytest.raises(CodecError, match="needs 32 bytes, got 28"):
        codec.unpack_in_place(frame[:-4])
    bad = frame.clone()
    bad[:4] = torch.tensor(list(b"XXXX"), dtype=torch.uint8)
    with pytest.raises(CodecError, match="magic"):
        codec.unpack_in_place(bad)
    flags = _frame_at(torch.ones(8, dtype=torch.bool), 0)
    flags[-1] = 2
    with pytest.raises(CodecError, match="bool tensor data holds bytes other than 0 and 1"):
        codec.unpack_in_place(flags)
    with pytest.raises(CodecError, match="flat uint8 tensor"):
        codec.unpack_in_place(torch.zeros(4, dtype=torch.int32))
    empty = codec.unpack_in_place(_frame_at(torch.zeros(0, 3), 0))
    assert empty.shape == (0, 3)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (1,) * codec.MAX_RANK])
def test_frame_head_bytes_reads_a_header_s_length_from_a_frame_s_first_bytes(
        shape: tuple[int, ...]) -> None:
    frame = codec.pack(torch.zeros(shape, dtype=torch.int16))
    head = len(frame) - 2 * torch.zeros(shape).numel()
    assert head == 6 + 8 * len(shape)
    assert codec.frame_head_bytes(frame[:codec.FRAME_PREFIX]) == head
    assert codec.frame_head_bytes(memoryview(frame)) == head


@pytest.mark.parametrize("prefix", [b"", b"PFT1\x03", b"PFC1\x00\x00", b"XFT1\x03\x01"])
def test_frame_head_bytes_of_a_short_or_foreign_start_is_none(prefix: bytes) -> None:
    assert codec.frame_head_bytes(prefix) is None
