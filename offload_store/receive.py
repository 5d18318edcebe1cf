"""GETDEL replies received straight from a pooled connection's socket into the caller's
buffers: the chunks of chunked values ([Note: chunked values] in offload_store.chunks)
arrive in their value's buffer with no bytes object and no copy between."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable

from redis._parsers.base import BaseParser
from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

LINE_READ = 4096  # bytes asked of the socket while reading a reply's first line
MAX_LINE = 64  # a longer reply line than this is not a GETDEL reply
SKIP_BYTES = 1 << 20  # the scratch buffer a value of the wrong length is read into

Received = int | None | ResponseError  # a value's byte count, None: missing, or an error


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
        length = int(rest)
        if length == len(view):
            self._into(view)
        else:
            self._skip(length)
        end = memoryview(bytearray(2))
        self._into(end)
        if end != b"\r\n":
            raise InvalidResponse(f"a bulk string followed by {bytes(end)!r}, not CRLF")
        return length

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
