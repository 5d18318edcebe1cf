"""Child processes of a local cluster: start `python -m MODULE`, wait for its `ready` line,
stop or kill it; children die with their parent (PR_SET_PDEATHSIG on Linux)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from pipefb.cpus import allowed

READY_TIMEOUT_SECONDS = 120.0  # start-up of one process, torch import included
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Asks for SIGTERM when this process's parent dies (PR_SET_PDEATHSIG, Linux;
    elsewhere a no-op): called first thing in a child, or as its `preexec_fn` where the
    parent holds no gRPC state (the offload store's redis-server)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# Runs a `python -m MODULE ARGS` child after asking for SIGTERM on the parent's death,
# in the child itself: a preexec_fn would make Python fork (not vfork), and a parent that
# holds gRPC channels (the CLI, a supervisor relaunching) can then abort in the child.
# SIGUSR1 makes it write every thread's Python stack to its log (a stuck child explains itself).
_BOOT = ("import sys, signal, faulthandler; faulthandler.register(signal.SIGUSR1); "
         "from pipefb.processes import die_with_parent; die_with_parent(); "
         "import runpy; module = sys.argv[1]; sys.argv = [module, *sys.argv[2:]]; "
         "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def project_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with this checkout's root first on
    PYTHONPATH, so a child's `python -m worker` (or any other module) runs this code."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), out.get("PYTHONPATH", ""))
        if p)
    return out


class StopSignal:
    """SIGTERM and SIGINT, caught for a main loop that polls `received`.

    The handler only appends to a list: Python runs a signal handler in the main thread
    between two bytecodes, possibly while that thread holds a lock (inside
    `threading.Event.wait`, say), so a handler that takes a lock (`Event.set`) can
    deadlock the process that it was meant to stop.
    """

    POLL_S = 0.05  # how long `wait` sleeps between looks at the list

    def __init__(self) -> None:
        self._got: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self._got.append(signum))

    @property
    def received(self) -> bool:
        """Whether a stop signal has come."""
        return bool(self._got)

    def wait(self, timeout: float | None = None) -> bool:
        """Sleeps until a stop signal has come (True) or `timeout` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._got:
            left = self.POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.POLL_S, left))
        return True


def python_argv(args: list[str]) -> list[str]:
    """The command line of a `python -m MODULE ARGS` child that dies with this process
    (other arguments run as they are, without that guard)."""
    if len(args) >= 2 and args[0] == "-m":
        return [sys.executable, "-c", _BOOT, *args[1:]]
    return [sys.executable, *args]


def _read_ready(stream: IO[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)
    lines.put("")


def default_threads(workers: int) -> int:
    """Torch threads per worker: the cores this process may run on shared out (at least
    one; a container's cpuset, not the host's cores).

    Oversubscribed threads make every stage slower; and results are bit-identical to
    `--schedule single` only when both use the same thread count, because multi-threaded
    reductions sum in another order.
    """
    return max(1, len(allowed()) // max(1, workers))


class Process:
    """One child process that prints `ready ADDRESS` once it serves (and then
    `metrics URL` when it serves metrics)."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str],
                 metrics: bool = False) -> None:
        self.name, self.metrics, self.args, self.env = name, metrics, args, env
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("a") as log:
            self.popen = subprocess.Popen(
                python_argv(args), stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                stdin=subprocess.DEVNULL)
        self._lines: queue.Queue[str] = queue.Queue()
        assert self.popen.stdout is not None
        threading.Thread(target=_read_ready, args=(self.popen.stdout, self._lines),
                         daemon=True).start()
        self.address = self.metrics_url = ""

    @property
    def pid(self) -> int:
        """The child's pid."""
        return self.popen.pid

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> str:
        """Waits for the `ready ADDRESS` line (and the `metrics URL` line if the process
        serves metrics); raises RuntimeError with the log tail."""
        deadline = time.monotonic() + timeout
        self.address = self._wait_for("ready", deadline)
        if self.metrics:
            self.metrics_url = self._wait_for("metrics", deadline)
        return self.address

    def _wait_for(self, word: str, deadline: float) -> str:
        """The value of the next stdout line `WORD VALUE`."""
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line.startswith(f"{word} "):
                return line.split()[1]
            if line == "":
                break
        raise RuntimeError(f"{self.name} did not start (exit {self.popen.poll()}): "
                           f"{self.log_tail()}")

    def manifest(self) -> dict[str, int | str]:
        """Its entry in cluster.json: pid, address, log (and metrics, its /metrics URL)."""
        entry: dict[str, int | str] = {"pid": self.pid, "address": self.address,
                                       "log": str(self.log_path)}
        if self.metrics_url:
            entry["metrics"] = self.metrics_url
        return entry

    def log_tail(self, lines: int = 5) -> str:
        """Last lines of the process's log, joined."""
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-lines:])
        except OSError:
            return ""

    def relaunched(self, args: list[str]) -> Process:
        """The same process started again with `args` (its log continues)."""
        return Process(self.name, args, self.log_path.parent, self.env, self.metrics)

    def kill(self, wait: float = 5.0) -> bool:
        """SIGKILL, reaped within `wait` seconds; whether it was still running."""
        running = self.popen.poll() is None
        if running:
            self.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(wait)
        return running

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always reaps."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
