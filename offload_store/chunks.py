"""Chunked stash values: a value over the chunk size stored as a manifest and chunk keys,
written in one pipeline and read over several pooled connections at once.

[Note: chunked values] A value (a `pipefb.codec.pack` frame) longer than the store's chunk
size is stored as its *manifest* under its own key (`keys.stash_key`): `MAGIC`, the tensor
data's byte count and the chunk size, then the frame's codec header; and its tensor data
cut into chunks of the chunk size (the last one shorter) under `keys.chunk_key(key, i)`. A
manifest never starts as a frame does (`MAGIC` is not the codec's magic), so a take knows
a chunked value from the reply of its one GETDEL pipeline (which receives a manifest as
bytes, [Note: values received in place] in `offload_store.receive`); a value up to the
chunk size is one key. A put sends the chunks (views of the tensor's memory,
[Note: zero-copy put]) with the manifests and small values in one SET pipeline on the
calling thread: Redis reads commands on one thread, so writing over several connections
only adds client threads, and a put spread over them was slower (bench/findings.md). A take,
after its first pipeline, GETDELs the chunks over up to `connections` pooled connections,
one pipeline each, from a small thread pool (`ChunkIO`; redis-py receives with the GIL
released), each connection's replies received straight from its socket into one buffer
per value (`receive.getdel_into`: no bytes object per chunk, no copy between), then
validates the whole buffer as a value of one key is validated, and only then hands out a
tensor that views the buffer's data (`pipefb.codec.unpack_in_place`; the data starts on a
`receive.ALIGN` boundary, `receive.frame_buffer`): the take copies nothing after the
socket, and no tensor exists before those checks. A manifest is written with its chunks,
not after them, so a value left half written (a store full midway, a crashed writer) may
have a manifest and not every chunk: a take checks that each chunk came back with exactly
its span's bytes, and a missing one raises `KeyError` naming the chunk's key, a short or
long one `CodecError`, never a tensor. A manifest's sizes are bounded (the codec's largest
tensor, `MIN_CHUNK_BYTES`) before its buffer is allocated. Every chunk a take asks for is
deleted by its GETDEL all the same; a put that fails unlinks every key it may have written
(after its pipeline finished); SCAN by the job's pattern finds chunk keys, so
`clear_job` and the TTL reclaim a crashed writer's chunks. Chunks also keep each SET under
Redis's largest argument (`proto-max-bulk-len`, 512 MB by default), which a value of one
key must fit.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.connection import ConnectionPool

from offload_store.frames import Frame
from offload_store.keys import chunk_key
from offload_store.receive import Received, frame_buffer, getdel_into
from pipefb.codec import DEFAULT_MAX_BYTES, MAX_RANK
from pipefb.errors import CodecError

# Values longer than this are chunked: large enough that a chunk's command costs little
# beside moving its bytes, small enough that a 16 MiB stash's take spreads over 4
# connections.
CHUNK_BYTES = 4 << 20
# Connections one chunked take uses at once: Redis runs commands on one thread, so more
# connections only add client threads; 4 let a 16 MiB value's chunks arrive together.
CONNECTIONS = 4
MIN_CHUNK_BYTES = 4096  # the smallest chunk size a store accepts (bounds a value's keys)
MAGIC = b"PFC1"  # a manifest's first bytes; a frame starts with the codec's b"PFT1"
_LAYOUT = struct.Struct("<4sQQ")  # magic, tensor data bytes, chunk bytes; the header follows
MAX_HEADER_BYTES = 6 + 8 * MAX_RANK  # the longest codec header: bounds a manifest
# the chunk size of the stores `offload_store.store.open_redis_store` opens (0: never
# chunk); unset or empty: `CHUNK_BYTES`
CHUNK_ENV = "PIPEFB_STORE_CHUNK_BYTES"
Value = bytes | Frame  # what one SET of a put writes: a frame, a manifest or a chunk
V = TypeVar("V", bound=Sized)  # a value that `spread` weighs by its length
T = TypeVar("T")  # a group of `ChunkIO.run`'s work
R = TypeVar("R")  # what the work of one group returns


@dataclass(frozen=True)
class Manifest:
    """How one chunked value is laid out: its codec header, data bytes and chunk size."""

    head: bytes  # the frame's codec header
    body_bytes: int  # the tensor data's bytes, cut into chunks
    chunk_bytes: int  # every chunk's length but the last one's

    @property
    def count(self) -> int:
        """The number of chunks."""
        return -(-self.body_bytes // self.chunk_bytes)

    @property
    def frame_bytes(self) -> int:
        """The whole value's length: header and data."""
        return len(self.head) + self.body_bytes

    def span(self, index: int) -> tuple[int, int]:
        """Where chunk `index` lies in the frame: (start, stop)."""
        start = len(self.head) + index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.frame_bytes)

    def encode(self) -> bytes:
        """The manifest as stored under the value's key."""
        return _LAYOUT.pack(MAGIC, self.body_bytes, self.chunk_bytes) + self.head

    @classmethod
    def parse(cls, value: bytes, key: str) -> Manifest:
        """Reads a manifest, bounding what it may make a take allocate and ask for.

        Raises:
            CodecError: too short or too long, a data size above the codec's limit, or a
                chunk size below `MIN_CHUNK_BYTES`; names the key.
        """
        if not _LAYOUT.size <= len(value) <= _LAYOUT.size + MAX_HEADER_BYTES:
            raise CodecError(f"chunk manifest {key!r} of {len(value)} bytes is malformed")
        _, body, chunk = _LAYOUT.unpack_from(value)
        if not 0 < body <= DEFAULT_MAX_BYTES or chunk < MIN_CHUNK_BYTES:
            raise CodecError(f"chunk manifest {key!r} declares {body} data bytes in "
                             f"chunks of {chunk}")
        return cls(bytes(value[_LAYOUT.size:]), body, chunk)


def is_manifest(value: object) -> bool:
    """Whether a GETDEL reply is a chunked value's manifest."""
    return isinstance(value, bytes) and value.startswith(MAGIC)


def chunk_bytes_from_env() -> int:
    """The chunk size ``$PIPEFB_STORE_CHUNK_BYTES`` sets; unset or empty: `CHUNK_BYTES`.

    Raises:
        ValueError: not 0 or an int >= `MIN_CHUNK_BYTES`; names the variable.
    """
    raw = os.environ.get(CHUNK_ENV, "")
    if not raw:
        return CHUNK_BYTES
    try:
        return check_chunk_bytes(int(raw))
    except ValueError:
        raise ValueError(f"${CHUNK_ENV} {raw!r} must be 0 (no chunks) or an int >= "
                         f"{MIN_CHUNK_BYTES}") from None


def check_chunk_bytes(chunk_bytes: int) -> int:
    """Returns a valid chunk size (0: values are never chunked).

    Raises:
        ValueError: not an int, or between 1 and `MIN_CHUNK_BYTES` - 1; names the value.
    """
    if (not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool)
            or (chunk_bytes != 0 and chunk_bytes < MIN_CHUNK_BYTES)):
        raise ValueError(f"chunk_bytes {chunk_bytes!r} must be 0 (no chunks) or an int "
                         f">= {MIN_CHUNK_BYTES}")
    return chunk_bytes


def split(key: str, frame: Frame, chunk_bytes: int) -> dict[str, Value]:
    """The keys and values of one frame: itself under `key` when it fits a chunk (or
    `chunk_bytes` is 0), else its manifest and its chunks, views of its data."""
    if not chunk_bytes or len(frame) <= chunk_bytes:
        return {key: frame}
    manifest = Manifest(frame.head, frame.body.nbytes, chunk_bytes)
    out: dict[str, Value] = {key: manifest.encode()}
    for index in range(manifest.count):
        start, stop = (offset - len(frame.head) for offset in manifest.span(index))
        out[chunk_key(key, index)] = Frame(b"", frame.body[start:stop])
    return out


def spread(items: Mapping[str, V], groups: int) -> list[dict[str, V]]:
    """Deals items over at most `groups` groups, each to the group with the fewest bytes
    so far, largest first; empty groups are dropped."""
    out: list[dict[str, V]] = [{} for _ in range(max(1, groups))]
    sizes = [0] * len(out)
    for key, value in sorted(items.items(), key=lambda kv: -len(kv[1])):
        least = sizes.index(min(sizes))
        out[least][key] = value
        sizes[least] += len(value)
    return [group for group in out if group]


def chunk_keys(key: str, manifest: Manifest) -> list[str]:
    """The chunk keys of a chunked value stored under `key`."""
    return [chunk_key(key, index) for index in range(manifest.count)]


def named_chunks(keys: Sequence[str], values: Sequence[Any]) -> list[str]:
    """The chunk keys that the manifests among a GETDEL pipeline's replies name (a corrupt
    manifest names none: its chunks go with the TTL or the job's clear)."""
    out: list[str] = []
    for key, value in zip(keys, values, strict=True):
        if is_manifest(value):
            with suppress(CodecError):
                out += chunk_keys(key, Manifest.parse(value, key))
    return out


class ChunkIO:
    """A store's chunk size, and the threads that move chunks over its client's pooled
    connections ([Note: chunked values]). Safe to share between threads."""

    def __init__(self, pool: ConnectionPool, chunk_bytes: int = CHUNK_BYTES,
                 connections: int = CONNECTIONS) -> None:
        """Binds a redis-py connection pool.

        Raises:
            ValueError: a bad chunk size (see `check_chunk_bytes`) or fewer than one
                connection; names the value.
        """
        if not isinstance(connections, int) or isinstance(connections, bool) or connections < 1:
            raise ValueError(f"chunk_connections {connections!r} must be a positive int")
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.connections = connections
        self._pool = pool
        self._threads: ThreadPoolExecutor | None = None  # made on first use
        self._lock = threading.Lock()

    def split(self, items: Mapping[str, Frame]) -> dict[str, Value]:
        """What a put of `items` writes: each frame under its key, or a chunked one's
        manifest and chunks (`split`)."""
        out: dict[str, Value] = {}
        for key, frame in items.items():
            out.update(split(key, frame, self.chunk_bytes))
        return out

    def spread(self, items: Mapping[str, V]) -> list[dict[str, V]]:
        """`items` dealt over up to `connections` groups by bytes (`spread`)."""
        return spread(items, self.connections)

    def run(self, work: Callable[[T], R], groups: Sequence[T]) -> list[R]:
        """`work` of each group, on this object's threads when there are several; raises
        the first group's error only once every group has finished."""
        if len(groups) == 1:
            return [work(groups[0])]
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.connections, "store-chunks")
            threads = self._threads
        futures = [threads.submit(work, group) for group in groups]
        wait(futures)
        return [future.result() for future in futures]

    def receive(self, keys: Sequence[str], values: Sequence[Any]
                ) -> tuple[list[Any], dict[int, Manifest]]:
        """A GETDEL pipeline's replies with each chunked value's manifest replaced by its
        whole frame, its chunks GETDEL'd over up to `connections` connections into one
        buffer (or by the error they make: `KeyError` naming a missing chunk,
        `CodecError` for one of the wrong length, the server's error reply); and the
        manifests by reply index. Every chunk of every manifest found is GETDEL'd."""
        layouts: dict[int, Manifest] = {}
        out = list(values)
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            if is_manifest(value):
                try:
                    layouts[i] = Manifest.parse(value, key)
                except CodecError as error:
                    out[i] = error
        if not layouts:
            return out, layouts
        # bytes, not a tensor of the value: `unpack_in_place` checks them whole first, then
        # views the data where it lies, on an aligned address (`frame_buffer`); the
        # memory stays unwritten until the chunks arrive
        frames = {i: frame_buffer(m.frame_bytes, len(m.head)) for i, m in layouts.items()}
        buffers = {i: memoryview(frame.numpy()) for i, frame in frames.items()}
        jobs: dict[str, memoryview] = {}
        for i, m in layouts.items():
            buffers[i][:len(m.head)] = m.head
            for index, chunk in enumerate(chunk_keys(keys[i], m)):
                jobs[chunk] = buffers[i][slice(*m.span(index))]
        got: dict[str, Received] = {}
        for part in self.run(self._getdel_into, self.spread(jobs)):
            got.update(part)
        for i, m in layouts.items():
            faults = (_chunk_error(chunk, got[chunk], len(jobs[chunk]))
                      for chunk in chunk_keys(keys[i], m))
            out[i] = next((fault for fault in faults if fault is not None), frames[i])
        return out, layouts

    def close(self) -> None:
        """Stops the threads (a later `run` starts new ones)."""
        with self._lock:
            threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)

    def _getdel_into(self, group: dict[str, memoryview]) -> dict[str, Received]:
        """One connection's share of a take's chunks (`receive.getdel_into`)."""
        return dict(zip(group, getdel_into(self._pool, group.items()), strict=True))


def _chunk_error(key: str, got: Received, expected: int) -> BaseException | None:
    """What a chunk's GETDEL makes its value raise: the server's error, `KeyError` for a
    missing chunk, `CodecError` for one of the wrong length; None for a whole chunk."""
    if isinstance(got, Exception):
        return got
    if got is None:
        return KeyError(key)
    if got != expected:
        return CodecError(f"chunk {key!r} holds {got} bytes; its manifest says {expected}")
    return None


