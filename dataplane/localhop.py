"""Same-host hops: transfers to a peer on this host over a unix socket, no gRPC threads.

[Note: local hops]
A gRPC hop hands each transfer from thread to thread: the compute thread queues it, a
gRPC thread encodes and sends it, the receiver's poller wakes a handler thread that
decodes it into the inbox, and the compute thread there wakes. Each hand-off waits for
the GIL, so a small tensor takes a few hundred microseconds where the socket under it
takes a few. Between ranks on one host a transfer instead goes over a unix socket:

- the sender's compute thread writes a small transfer itself (one `sendmsg` of a header
  frame and the tensors' own bytes, no copy in Python) and goes on; a transfer of more
  than `INLINE_BYTES` goes to the connection's writer thread, in order, so the compute
  thread does not wait while the kernel copies it or the receiver drains it. `check`
  (the transport's flush) waits until the writer wrote everything; until then the sent
  tensors must stay as they are ([Note: send buffers] in dataplane/grpc_transport.py). A
  transfer that must wait for something first (a PipeFB forward rank's, for its earlier
  stashes' writes: [Note: background stash] in offload_store/writer.py) goes to the
  writer thread too, which waits there, off the compute thread, then writes it;
- one reader thread per connection on the receiver validates the header frame, allocates
  each tensor only then (`protos.wire.check_tensor_header`, the gRPC path's checks),
  fills it and hands the transfer to the worker's delivery check (job, attempt, receive
  window, expected shapes), which puts it into the inbox. Each read takes whatever has
  arrived, up to 256 KiB, so a small transfer costs the reader one read and one GIL
  hand-back; a small tensor is a view of its own copy of those bytes (one torch call,
  as each torch call after a wake-up costs microseconds), a large one is allocated and
  its rest read straight into it.

A frame is a little-endian u32 length and a `TensorChunk` holding the `Transfer` and
every tensor's header with no data; the tensors' bytes follow in header order. A
connection starts with the sender's service credential (a u32 length and the token),
checked as the gRPC interceptor checks it ([Note: access] in protos/security.py), and the
receiver's one-byte answer. A refused transfer ends the connection after an error frame
(`CODE message`), which the sender raises as WorkerFailed at its next send or flush.

Where: a worker serving gRPC on port P listens on `hop-P.sock` in `hop_dir()`, a folder
only its user may enter, so only that user's processes can reach it or plant a socket
there. A sender uses it for a peer whose address is on loopback (so on this host) and
falls back to the gRPC stream when there is no such socket (a peer without local hops).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import stat
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from pipefb import codec
from pipefb.errors import CodecError, ConfigError, WorkerFailed
from protos import security, server, tensor_pb2, wire

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 20  # largest header frame: a transfer's headers, never its data
# the sender's socket buffer (the kernel caps it at net.core.wmem_max): a transfer that
# fits is written at once, and the compute thread goes on while the receiver's reader
# waits for its GIL
SEND_BUFFER_BYTES = 4 << 20
# a transfer of at most this many data bytes is written on the caller's thread (its write
# takes less than a hand-over to another thread); a larger one goes to the connection's
# writer thread, so the compute thread goes on while the kernel copies it
INLINE_BYTES = 64 << 10
RECV_PIECE_BYTES = 1 << 20  # the reader takes a large tensor's bytes in pieces of this size
READ_AHEAD_BYTES = 256 << 10  # what one read may take beyond what it needs (then copied)
HOP_DIR_ENV = "PIPEFB_HOP_DIR"  # where workers put their hop sockets (default: see hop_dir)
OK, REFUSED = b"\x01", b"\x00"  # the receiver's answer to the credential
METHOD = "/pipefb.v1.StageWorker/Activations"  # whom `POLICY` lets feed a rank
#: delivers one validated transfer (raises to refuse it)
Deliver = Callable[[tensor_pb2.Transfer, dict[str, torch.Tensor]], None]
Limit = Callable[[], int]  # the largest tensor the receiver takes now, bytes


def hop_dir() -> Path:
    """`$PIPEFB_HOP_DIR`, else `pipefb-hops-UID` in `$XDG_RUNTIME_DIR` or the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(os.environ.get(HOP_DIR_ENV) or Path(base) / f"pipefb-hops-{os.getuid()}")


def _private(folder: Path) -> bool:
    """Whether `folder` is a directory of this user that no one else may enter."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o077)


def socket_path(address: str) -> Path | None:
    """The hop socket of the worker serving gRPC at `address`, if that is on loopback and
    the hop folder is private; else None (the peer is reached over gRPC)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not security.is_loopback(host.strip("[]")):
        return None
    folder = hop_dir()
    return folder / f"hop-{port}.sock" if _private(folder) else None


def _send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Writes every buffer, in order, with as few system calls as the socket allows."""
    while buffers:
        sent = sock.sendmsg(buffers)
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    """Fills `view` from the socket; returns how many bytes came before the peer closed."""
    got = 0
    while got < len(view):  # whole pieces: a GIL hand-back per piece, not per socket read,
        # and the sender's copy of the next piece overlaps this one's
        n = sock.recv_into(view[got:got + RECV_PIECE_BYTES], 0, socket.MSG_WAITALL)
        if n == 0:
            break
        got += n
    return got


class _Incoming:
    """A connection's bytes, read in as few calls as possible: each read takes whatever
    has arrived (a small transfer's frame and tensors at once, so the reader thread takes
    the GIL back once, not once per piece), and a large tensor's rest goes straight into
    the tensor."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(READ_AHEAD_BYTES)
        self._start = self._end = 0

    def read_into(self, view: memoryview) -> bool:
        """Fills `view`; False if the peer closed before its first byte.

        Raises:
            ConnectionError: the peer closed part-way.
        """
        got = 0
        while got < len(view):
            if self._start == self._end:
                if len(view) - got >= READ_AHEAD_BYTES:  # large: no detour through the buffer
                    got += _recv_into(self.sock, view[got:])
                    break
                self._start, self._end = 0, self.sock.recv_into(self._buf)
                if self._end == 0:
                    break
            n = min(len(view) - got, self._end - self._start)
            view[got:got + n] = self._buf[self._start:self._start + n]
            got, self._start = got + n, self._start + n
        if got == len(view):
            return True
        if got == 0:
            return False
        raise ConnectionError(f"the peer closed after {got} of {len(view)} bytes")

    def take(self, size: int) -> bytearray | None:
        """The next `size` bytes as a buffer of their own (a slice of what one read took,
        where it holds them); None if the peer closed before the first of them.

        Raises:
            ConnectionError: the peer closed part-way.
        """
        if self._end - self._start >= size:
            out = self._buf[self._start:self._start + size]
            self._start += size
            return out
        out = bytearray(size)
        return out if self.read_into(memoryview(out)) else None

    def frame(self) -> bytearray | None:
        """One length-prefixed frame; None at a clean end of the connection.

        Raises:
            CodecError: a frame over `MAX_FRAME_BYTES`.
            ConnectionError: the peer closed inside the frame.
        """
        head = self.take(_LEN.size)
        if head is None:
            return None
        (size,) = _LEN.unpack(head)
        if size > MAX_FRAME_BYTES:
            raise CodecError(f"header frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
        body = self.take(size)
        if body is None and size:
            raise ConnectionError("the peer closed before the frame's body")
        return body or bytearray()


def _read_tensor(incoming: _Incoming, header: tensor_pb2.TensorHeader, limit: int
                 ) -> torch.Tensor:
    """The tensor `header` announces, with its bytes read from `incoming`; allocated only
    once the header is validated. A small one views its own copy of the bytes one read
    took (one torch call); a large one is allocated and its bytes read straight into it.

    Raises:
        CodecError: a header `wire.check_tensor_header` refuses.
        ConnectionError: the peer closed before the tensor's last byte.
    """
    dtype, shape, nbytes = wire.check_tensor_header(header, limit)
    if nbytes < READ_AHEAD_BYTES:
        data = incoming.take(nbytes)
        if data is not None:
            return wire.tensor_on(data, dtype, shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
        if incoming.read_into(wire.byte_view(tensor)):
            return tensor
    raise ConnectionError(f"the peer closed before tensor {header.name!r}")


def refusal(error: BaseException) -> str:
    """What the sender is told of a refused transfer: its status code and message, as the
    gRPC path's status (`protos.server.STATUS_OF`)."""
    return f"{server.status_of(error).name} {type(error).__name__}: {error}"


def _frame(data: bytes) -> memoryview:
    return memoryview(_LEN.pack(len(data)) + data)


class HopSender:
    """The sending end of one same-host connection: `send` writes a small transfer on the
    caller's thread and hands a large one to the connection's writer thread, which keeps
    the order ([Note: local hops])."""

    def __init__(self, path: Path, peer: str, token: str, timeout: float) -> None:
        self.peer, self._timeout = peer, timeout
        self._cond = threading.Condition()
        # transfers the writer has to write, each with what it waits for first
        self._queue: deque[tuple[list[memoryview], Callable[[], None] | None]] = deque()
        self._failed: str | None = None  # why the writer stopped
        self._writer: threading.Thread | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)  # a peer that takes no data has failed
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._sock.connect(str(path))
            _send_all(self._sock, [_frame(token.encode())])
            answer = self._sock.recv(1)
        except BaseException:
            self._sock.close()
            raise
        if answer != OK:
            self._sock.close()
            raise WorkerFailed(f"{peer} refused this worker's service credential")

    @classmethod
    def connect(cls, address: str, peer: str, timeout: float) -> HopSender | None:
        """A connection to the hop socket of the worker at `address`; None where it has
        none (not on this host, or a peer without local hops)."""
        path = socket_path(address)
        if path is None or not path.exists():
            return None
        token = security.client_settings(address).client_token
        try:
            return cls(path, peer, token, timeout)
        except (ConnectionRefusedError, FileNotFoundError):  # a stale socket file
            return None

    def send(self, transfer: tensor_pb2.Transfer, tensors: Mapping[str, torch.Tensor],
             after: Callable[[], None] | None = None) -> None:
        """Writes one transfer, or queues it for the writer thread if it is large, the
        writer is still busy, or it must wait for `after` to return first. The caller must
        not modify a sent tensor until `check` returns ([Note: send buffers] in
        dataplane/grpc_transport.py).

        Raises:
            WorkerFailed: the peer refused an earlier transfer, went away, or took no
                data within the timeout.
        """
        transfer.tensor_count = len(tensors)
        msg = tensor_pb2.TensorChunk(transfer=transfer)
        views, size = [], 0
        for name, tensor in tensors.items():
            dtype, shape, view = codec.raw_view(tensor)
            msg.headers.add(name=name, dtype=wire.dtype_enum(dtype), shape=shape,
                            nbytes=len(view))
            views.append(view)
            size += len(view)
        buffers = [_frame(msg.SerializeToString()), *views]
        with self._cond:
            self._check_refusal()
            if size > INLINE_BYTES or self._queue or after is not None:
                self._queue.append((buffers, after))
                self._start_writer()
                return
            try:
                _send_all(self._sock, buffers)
            except OSError as error:
                self._check_refusal()
                raise WorkerFailed(f"{self.peer} failed to receive: {error}") from None

    def _start_writer(self) -> None:
        """Wakes the writer thread (starting it on the first large transfer); holds
        `_cond`."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="hop-write", daemon=True)
            self._writer.start()
        self._cond.notify_all()

    def _write(self) -> None:
        """The writer thread: writes queued transfers in order until the connection closes
        or a write fails (then `check` and `send` raise)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._sock.fileno() < 0)
                if self._sock.fileno() < 0:
                    return
                buffers, after = self._queue[0]  # stays queued until written: `check` waits
            try:
                if after is not None:
                    after()
                _send_all(self._sock, buffers)
            except OSError as error:
                with self._cond:
                    self._failed = str(error)
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def check(self) -> None:
        """Waits until the writer thread wrote every queued transfer; raises WorkerFailed
        if the peer refused a transfer (its error frame waits), a write failed, or the
        peer took no data within the timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._queue, self._timeout):
                self._end()
                raise WorkerFailed(f"{self.peer} took no data for {self._timeout:.0f} s")
            self._check_refusal()

    def _check_refusal(self) -> None:
        if self._sock.fileno() < 0:
            raise WorkerFailed(f"{self.peer}: the hop connection is closed")
        readable, _, _ = select.select([self._sock], [], [], 0)
        if not readable and self._failed is None:
            return
        try:
            frame = _Incoming(self._sock).frame() if readable else None
        except (OSError, CodecError):
            frame = None
        detail = (frame.decode(errors="replace") if frame
                  else self._failed or "connection closed")
        self._end()
        raise WorkerFailed(f"{self.peer} failed to receive: {detail}")

    def close(self) -> None:
        """Ends the connection (the reader sees a clean end after what was written; a
        transfer still queued after a failed step is dropped)."""
        with self._cond:
            self._end()

    def _end(self) -> None:
        """Closes the socket and wakes the writer; holds `_cond`."""
        if self._queue:  # the writer may be blocked in a write: wake it
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
        self._cond.notify_all()


class HopListener:
    """The receiving end: accepts same-host connections and reads each on its own
    thread, delivering every validated transfer through `deliver`."""

    def __init__(self, path: Path, deliver: Deliver, limit: Limit) -> None:
        self.path, self._deliver, self._limit = path, deliver, limit
        self._settings = security.from_env()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)  # a crashed worker's socket on the same port
        self._sock.bind(str(path))
        self._sock.listen(64)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="hop-accept", daemon=True).start()

    @classmethod
    def serve(cls, port: int, deliver: Deliver, limit: Limit) -> HopListener:
        """Listens on the hop socket of the worker serving gRPC on `port`.

        Raises:
            ConfigError: the hop folder exists but is not private to this user.
        """
        folder = hop_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder):
            raise ConfigError(f"hop folder {folder} must be a directory of this user that "
                              f"only it may enter (chmod 700), or set {HOP_DIR_ENV}")
        return cls(folder / f"hop-{port}.sock", deliver, limit)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="hop-read",
                             daemon=True).start()

    def _admit(self, conn: socket.socket, incoming: _Incoming) -> bool:
        """Checks the connection's credential ([Note: access]); answers either way."""
        frame = incoming.frame()
        token = frame.decode(errors="replace") if frame is not None else ""
        who = security.identify(self._settings, [("authorization", f"Bearer {token}")])
        ok = not self._settings.identities or (
            who is not None and security.allowed(METHOD, who))
        conn.sendall(OK if ok else REFUSED)
        if not ok:
            log.warning("refused a hop connection: missing or wrong service credential")
        return ok

    def _serve(self, conn: socket.socket) -> None:
        """Reads transfers until the sender ends the connection or one is refused."""
        with conn:
            try:
                incoming = _Incoming(conn)
                if not self._admit(conn, incoming):
                    return
                while self._read_transfer(incoming):
                    pass
            except Exception as error:  # refused: tell the sender why, then hang up
                log.warning("refused a hop transfer: %s", error)
                try:
                    conn.sendall(_frame(refusal(error).encode()))
                except OSError:
                    pass

    def _read_transfer(self, incoming: _Incoming) -> bool:
        """Reads, validates and delivers one transfer; False at the connection's end."""
        frame = incoming.frame()
        if frame is None:
            return False
        msg = tensor_pb2.TensorChunk.FromString(frame)
        if not msg.HasField("transfer") or msg.data:
            raise CodecError("a hop frame carries a transfer header and no data")
        count = msg.transfer.tensor_count
        if count != len(msg.headers) or not 0 <= count <= wire.MAX_TENSORS:
            raise CodecError(f"tensor_count {count} for {len(msg.headers)} headers "
                             f"(at most {wire.MAX_TENSORS})")
        limit, tensors = self._limit(), {}
        for header in msg.headers:
            tensor = _read_tensor(incoming, header, limit)
            if header.name in tensors:
                raise CodecError(f"tensor {header.name!r} sent twice")
            tensors[header.name] = tensor
        self._deliver(msg.transfer, tensors)
        return True

    def close(self) -> None:
        """Stops accepting and removes the socket file (open connections end with their
        senders)."""
        self._closed.set()
        self._sock.close()
        self.path.unlink(missing_ok=True)
