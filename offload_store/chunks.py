"""Chunked stash values: a value over the chunk size stored as a manifest and chunk keys,
written and read over several pooled connections at once.

[Note: chunked values] A value (a `pipefb.codec.pack` frame) longer than the store's chunk
size is stored as its *manifest* under its own key (`keys.stash_key`): `MAGIC`, the
tensor data's byte count and the chunk size, then the frame's codec header; and its
tensor data cut into chunks of the chunk size (the last one shorter) under
`keys.chunk_key(key, i)`. A manifest never starts as a frame does (`MAGIC` is not the
codec's magic), so a take knows a chunked value from the reply of its one GETDEL pipeline;
values up to the chunk size are stored and taken exactly as before. A put sends the
chunks (views of the tensor's memory, [Note: zero-copy put]) with the manifests and small
values spread over up to `connections` pooled connections, one SET pipeline each, from a
small thread pool (redis-py sends with the GIL released). A take, after that first
pipeline, GETDELs the chunks the same way, each connection's replies received straight
from its socket into one preallocated buffer per value (`fetch_into`: no bytes object per
chunk), then validates and decodes the whole buffer with `pipefb.codec.unpack`, as a
value of one key. A manifest is written with its chunks, not after them, so a value left
half written (a store full midway, a crashed writer) may have a manifest and not every
chunk: a take checks that each chunk came back with exactly its span's bytes, and a
missing one raises `KeyError` naming the chunk's key, a short or long one `CodecError`,
never a tensor. Every chunk a take asks for is deleted by its GETDEL all the same; a put
that fails unlinks every key it may have written; SCAN by the job's pattern finds chunk
keys, so `clear_job` and the TTL reclaim a crashed writer's chunks.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass
from typing import TypeVar

from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from offload_store.frames import Frame
from offload_store.keys import chunk_key
from pipefb.codec import DEFAULT_MAX_BYTES, MAX_RANK
from pipefb.errors import CodecError

# Values longer than this are chunked: large enough that a chunk's command costs little
# beside moving its bytes, small enough that a 16 MiB stash spreads over 4 connections.
CHUNK_BYTES = 4 << 20
# Connections one chunked put or take uses at once: Redis runs commands on one thread, so
# more connections only add client threads; 4 let a 16 MiB value's chunks move together.
CONNECTIONS = 4
MIN_CHUNK_BYTES = 4096  # the smallest chunk size a store accepts (bounds a value's keys)
MAGIC = b"PFC1"  # a manifest's first bytes; a frame starts with the codec's b"PFT1"
_LAYOUT = struct.Struct("<4sQQ")  # magic, tensor data bytes, chunk bytes; the header follows
MAX_HEADER_BYTES = 6 + 8 * MAX_RANK  # the longest codec header: bounds a manifest
V = TypeVar("V", bound=Sized)  # a value that `spread` weighs by its length
LINE_READ = 4096  # bytes asked of the socket while reading a reply's first line
MAX_LINE = 64  # a longer reply line than this is not a GETDEL reply


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


def split(key: str, frame: Frame, chunk_bytes: int) -> dict[str, bytes | Frame]:
    """The keys and values of one frame: itself under `key` when it fits a chunk (or
    `chunk_bytes` is 0), else its manifest and its chunks, views of its data."""
    if not chunk_bytes or len(frame) <= chunk_bytes:
        return {key: frame}
    manifest = Manifest(frame.head, frame.body.nbytes, chunk_bytes)
    out: dict[str, bytes | Frame] = {key: manifest.encode()}
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


Received = int | None | ResponseError  # a chunk's byte count, None: missing, or an error


def fetch_into(pool: ConnectionPool, jobs: Iterable[tuple[str, memoryview]]
               ) -> list[Received]:
    """GETDELs each key on one pooled connection, sent once (no resend, [Note: no
    resend] in offload_store.store), and receives each value straight into its view.

    A value whose length is not its view's is read and dropped, its length returned.

    Returns:
        Per key: the value's byte count, None where the key was missing, or the server's
        error reply.

    Raises:
        redis.exceptions.ConnectionError, TimeoutError: the connection failed (it is
            disconnected before it goes back to the pool, never left mid-reply).
    """
    jobs = list(jobs)
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("GETDEL", key) for key, _ in jobs]))
        sock = conn._sock  # the parser holds nothing: every reply is still on the socket
        if sock is None:
            raise RedisConnectionError("the connection closed while sending")
        replies = _Replies(sock)
        got = [replies.bulk_into(view) for _, view in jobs]
        # the connection answered: as after redis-py's own reads, its next use sends no
        # PING before `health_check_interval` has passed
        if conn.health_check_interval:
            conn.next_health_check = time.monotonic() + conn.health_check_interval
        return got
    except TimeoutError as error:
        conn.disconnect()
        raise RedisTimeoutError(f"timeout reading chunks: {error}") from None
    except OSError as error:
        conn.disconnect()
        raise RedisConnectionError(f"error reading chunks: {error}") from None
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class _Replies:
    """RESP replies read from a socket, bulk strings received into the caller's buffers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()  # bytes received past the last line read

    def bulk_into(self, view: memoryview) -> Received:
        """Reads one GETDEL reply; its value goes into `view` when its length is the view's.
        """
        line = self._line()
        kind, rest = line[:1], bytes(line[1:])
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind == b"_" or line == b"$-1":  # nil (RESP3, RESP2)
            return None
        if kind != b"$" or not rest.isdigit():
            raise InvalidResponse(f"unexpected reply to GETDEL: {bytes(line[:MAX_LINE])!r}")
        length = int(rest)
        if length == len(view):
            self._into(view)
        else:
            self._skip(length)
        if self._line():
            raise InvalidResponse("a bulk string not followed by CRLF")
        return length

    def _line(self) -> bytearray:
        """The next line, without its CRLF."""
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > MAX_LINE:
                raise InvalidResponse(f"reply line too long: {bytes(self._buf[:MAX_LINE])!r}")
            self._more(LINE_READ)
        line = self._buf[:end]
        del self._buf[:end + 2]
        return line

    def _more(self, nbytes: int) -> None:
        data = self._sock.recv(nbytes)
        if not data:
            raise RedisConnectionError("the store closed the connection")
        self._buf += data

    def _into(self, view: memoryview) -> None:
        """Fills `view`: first from the bytes already received, then from the socket."""
        got = min(len(self._buf), len(view))
        view[:got] = self._buf[:got]
        del self._buf[:got]
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise RedisConnectionError("the store closed the connection")
            got += n

    def _skip(self, nbytes: int) -> None:
        """Reads and drops `nbytes` bytes."""
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            part = scratch[:min(nbytes, len(scratch))]
            self._into(part)
            nbytes -= len(part)
