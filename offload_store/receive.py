"""GETDEL replies received straight from a pooled connection's socket into buffers: a
take's values each into a tensor allocated once its length line has been read, the chunks
of chunked values into their value's buffer; no bytes object and no copy between.

[Note: values received in place] A take's one GETDEL pipeline (`getdel_frames`) reads
each reply's length line, then the value's first `FRAME_PREFIX` bytes, which tell a codec
frame's header length (`pipefb.codec.frame_head_bytes`), and only then allocates: a frame
goes into an uninitialised uint8 tensor placed so that the frame's data starts on an
`ALIGN` boundary (`frame_buffer`), which `pipefb.codec.unpack_in_place` checks whole and
then views; any other value (a chunked value's manifest, a foreign value the codec will
refuse) arrives as bytes. A value longer than the take's limit is read and dropped
without a buffer and becomes a `CodecError` naming its key and length; a missing key is
None, an error reply the server's error. Every reply is read to its end, so the
connection goes back to the pool ready for its next command; a connection error
disconnects it first, never leaving a half-read reply to the next user. The chunks of a
chunked value ([Note: chunked values] in offload_store.chunks) arrive the same way, each
into its span of its value's buffer (`getdel_into`). redis-py's parser is bypassed: the
reader below handles what a GETDEL can answer (RESP2 and RESP3 bulk strings, nils,
errors, and RESP3 pushes before a reply, dropped).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
from redis._parsers.base import BaseParser
from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipefb.codec import FRAME_PREFIX, frame_head_bytes
from pipefb.errors import CodecError

LINE_READ = 4096  # bytes asked of the socket while reading a reply's first line
MAX_LINE = 64  # a longer reply line than this is not a GETDEL reply
SKIP_BYTES = 1 << 20  # the scratch buffer a value of the wrong length is read into
ALIGN = 64  # a frame's data starts on this boundary of its buffer: any dtype's size

Received = int | None | ResponseError  # a value's byte count, None: missing, or an error
# a frame in its own buffer, another value as bytes, None: missing, or the error it makes
Taken = torch.Tensor | bytes | Exception | None
R = TypeVar("R")  # what reading one reply gives


def frame_buffer(frame_bytes: int, head_bytes: int) -> torch.Tensor:
    """An uninitialised flat uint8 tensor of `frame_bytes` whose byte `head_bytes` (where
    a frame's data starts after a header of that length) lies on an `ALIGN` boundary
    (torch allocates on one); its storage is at most `ALIGN` bytes longer."""
    return torch.empty(ALIGN + frame_bytes, dtype=torch.uint8)[
        -head_bytes % ALIGN:][:frame_bytes]


def getdel_frames(pool: ConnectionPool, keys: Sequence[str], max_value_bytes: int
                  ) -> list[Taken]:
    """GETDELs each key on one pooled connection, sent once (no resend, [Note: no
    resend] in offload_store.store), each value received into a buffer of its own
    ([Note: values received in place]).

    Returns:
        Per key: a codec frame as a flat uint8 tensor (its data `ALIGN`ed), any other
        value as bytes, None where the key was missing, the server's error reply, or a
        `CodecError` naming the key for a value over `max_value_bytes` (dropped unread).

    Raises:
        redis.exceptions.ConnectionError, TimeoutError, InvalidResponse: as `getdel_into`.
    """
    return _getdel(pool, keys, lambda replies, i: replies.value(keys[i], max_value_bytes))


def getdel_into(pool: ConnectionPool, jobs: Iterable[tuple[str, memoryview]]
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
        redis.exceptions.InvalidResponse: a reply a GETDEL cannot give (disconnected too).
    """
    jobs = list(jobs)
    return _getdel(pool, [key for key, _ in jobs],
                   lambda replies, i: replies.bulk_into(jobs[i][1]))


def _getdel(pool: ConnectionPool, keys: Sequence[str], read: Callable[[_Replies, int], R]
            ) -> list[R]:
    """Sends one GETDEL per key on a pooled connection and reads reply `i` with
    `read(replies, i)`, in order; the connection is disconnected on any failure."""
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("GETDEL", key) for key in keys]))
        sock = conn._sock  # the parser holds nothing: every reply is still on the socket
        if sock is None:
            raise RedisConnectionError("the connection closed while sending")
        replies = _Replies(sock)
        got = [read(replies, i) for i in range(len(keys))]
        # the connection answered: as after redis-py's own reads, its next use sends no
        # PING before `health_check_interval` has passed
        if conn.health_check_interval:
            conn.next_health_check = time.monotonic() + conn.health_check_interval
        return got
    except TimeoutError as error:
        conn.disconnect()
        raise RedisTimeoutError(f"timeout reading GETDEL replies: {error}") from None
    except OSError as error:
        conn.disconnect()
        raise RedisConnectionError(f"error reading GETDEL replies: {error}") from None
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
        length = self._length()
        if not isinstance(length, int):
            return length
        if length == len(view):
            self._into(view)
        else:
            self._skip(length)
        self._end()
        return length

    def value(self, key: str, max_bytes: int) -> Taken:
        """Reads one GETDEL reply into a buffer of its own ([Note: values received in
        place]); a value over `max_bytes` is dropped and refused."""
        length = self._length()
        if not isinstance(length, int):
            return length
        if length > max_bytes:
            self._skip(length)
            self._end()
            return CodecError(f"stash value {key!r} of {length} bytes exceeds the "
                              f"{max_bytes} bytes a take accepts")
        head = frame_head_bytes(self._peek(min(length, FRAME_PREFIX)))
        if head is None:  # not a frame: a manifest, or a value the codec will refuse
            other = bytearray(length)
            self._into(memoryview(other))
            self._end()
            return bytes(other)
        frame = frame_buffer(length, head)
        self._into(memoryview(frame.numpy()))
        self._end()
        return frame

    def _length(self) -> int | ResponseError | None:
        """Reads a GETDEL reply's first line: a value's length (its bytes follow), None
        for a missing key, or the server's error."""
        line = self._line()
        while line[:1] == b">":  # a RESP3 push (a server's notice) before the reply: dropped
            for _ in range(_count(line)):
                self._drop_value()
            line = self._line()
        kind, rest = line[:1], bytes(line[1:])
        if kind == b"-":  # redis-py's error classes (NOPERM: NoPermissionError, ...)
            return BaseParser.parse_error(rest.decode(errors="replace"))
        if kind == b"_" or line == b"$-1":  # nil (RESP3, RESP2)
            return None
        if kind != b"$" or not rest.isdigit():
            raise InvalidResponse(f"unexpected reply to GETDEL: {bytes(line[:MAX_LINE])!r}")
        return int(rest)

    def _end(self) -> None:
        """Reads the CRLF that ends a bulk string."""
        end = memoryview(bytearray(2))
        self._into(end)
        if end != b"\r\n":
            raise InvalidResponse(f"a bulk string followed by {bytes(end)!r}, not CRLF")

    def _drop_value(self) -> None:
        """Reads and drops one RESP value of any type (a push's element)."""
        line = self._line()
        kind = line[:1]
        if kind in (b"$", b"!", b"="):  # blob string, blob error, verbatim string
            if (length := _count(line)) >= 0:
                self._skip(length + 2)
        elif kind in (b"*", b">", b"~", b"%", b"|"):  # array, push, set, map, attributes
            for _ in range(_count(line) * (2 if kind in (b"%", b"|") else 1)):
                self._drop_value()
        # any other kind is a simple value, whole in its line

    def _line(self) -> bytearray:
        """The next line, without its CRLF."""
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > MAX_LINE:
                raise InvalidResponse(f"reply line too long: {bytes(self._buf[:MAX_LINE])!r}")
            self._more(LINE_READ)
        line = self._buf[:end]
        del self._buf[:end + 2]
        return line

    def _peek(self, nbytes: int) -> bytes:
        """The next `nbytes` bytes, left to be read."""
        while len(self._buf) < nbytes:
            self._more(LINE_READ)
        return bytes(self._buf[:nbytes])

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
        scratch = memoryview(bytearray(min(nbytes, SKIP_BYTES)))
        while nbytes:
            part = scratch[:min(nbytes, len(scratch))]
            self._into(part)
            nbytes -= len(part)


def _count(line: bytearray) -> int:
    """The length or element count of an aggregate's or blob's first line.

    Raises:
        InvalidResponse: not a count.
    """
    try:
        return int(line[1:])
    except ValueError:
        raise InvalidResponse(f"bad count in reply line {bytes(line[:MAX_LINE])!r}") from None
