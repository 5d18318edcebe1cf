"""Zero-copy stash values: a tensor frame written to Redis as its header, then its memory.

[Note: zero-copy put] A SET value must reach Redis as one RESP bulk string, but not from one
buffer: the bytes only have to follow each other on the socket. `Frame` keeps a frame as
(header, view of the tensor's memory) and `FramePacker`, given to redis-py as its command
packer, emits `$<len>\\r\\n`, the header, the view and `\\r\\n` as separate chunks, so the
tensor data is copied once, by the kernel, instead of three times (into a bytes object,
into the frame, into hiredis's packed command).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from redis.connection import Encoder, PythonRespSerializer

from pipefb.codec import pack_parts

BUFFER_CUTOFF = 6000  # bytes: smaller arguments are joined into one write (redis-py's value)


@dataclass(frozen=True)
class Frame:
    """One packed tensor as two parts; `len` is the value's byte count."""

    head: bytes
    body: memoryview

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Frame:
        """Frames a tensor without copying its data (a non-dense tensor is copied once)."""
        head, body = pack_parts(tensor)
        return cls(head, body)

    def __len__(self) -> int:
        return len(self.head) + self.body.nbytes


class FramePacker(PythonRespSerializer):
    """redis-py's RESP packer that also writes `Frame` arguments part by part."""

    def __init__(self) -> None:
        super().__init__(BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)

    def pack(self, *args: Any) -> list[Any]:
        """RESP chunks of one command; a Frame's body is passed on as a view, not copied."""
        if not any(isinstance(a, Frame) for a in args):
            return list(super().pack(*args))
        out: list[Any] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, Frame):
                out += [b"$%d\r\n" % len(arg) + arg.head, arg.body, b"\r\n"]
            else:
                value = self.encode(arg)
                out.append(b"$%d\r\n%s\r\n" % (len(value), bytes(value)))
        return out
