"""A local cluster of real processes on 127.0.0.1: Redis, a coordinator and N workers.

With `metrics`, the coordinator and the workers serve Prometheus /metrics on free ports
(their `--metrics-port 0`); their `metrics URL` lines give the URLs.

With `restart`, a process that dies is relaunched, as Kubernetes restarts a pod: Redis
and the coordinator on the address they had (Redis comes back empty), a worker under
its name on a new port (it registers again). Jobs with `max_restarts` then replay.

Only subprocesses: the core stays free of grpc and redis. Every process is stopped on
exit, on Ctrl-C and on failure; children also get SIGTERM if this process dies
(PR_SET_PDEATHSIG on Linux). `kill_running` is the last resort of an interrupted CLI
whose clean-up hangs (see `pipefb.cli`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO

READY_TIMEOUT_SECONDS = 120.0  # start-up of one process, torch import included
SUPERVISE_SECONDS = 0.2  # with restart: how often dead processes are looked for
STORE_USER = "pipefb"  # = offload_store.acl.SERVICE_USER (the core imports no redis code)
_PR_SET_PDEATHSIG = 1
_RUNNING: weakref.WeakSet[LocalCluster] = weakref.WeakSet()  # started, not yet stopped


def die_with_parent() -> None:
    """Asks for SIGTERM when this process's parent dies (PR_SET_PDEATHSIG, Linux;
    elsewhere a no-op): called first thing in a child, or as its `preexec_fn` where the
    parent holds no gRPC state (the offload store's redis-server)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# Runs a `python -m MODULE ARGS` child after asking for SIGTERM on the parent's death,
# in the child itself: a preexec_fn would make Python fork (not vfork), and a parent that
# holds gRPC channels (the CLI, a supervisor relaunching) can then abort in the child.
_BOOT = ("import sys; from pipefb.local import die_with_parent; die_with_parent(); "
         "import runpy; module = sys.argv[1]; sys.argv = [module, *sys.argv[2:]]; "
         "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def project_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with this checkout's root first on
    PYTHONPATH, so a child's `python -m worker` (or any module here) runs this code."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), out.get("PYTHONPATH", ""))
        if p)
    return out


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
    """Torch threads per worker: the machine's cores shared out (at least one).

    Oversubscribed threads make every stage slower; and results are bit-identical to
    `--schedule single` only when both use the same thread count, because multi-threaded
    reductions sum in another order.
    """
    return max(1, (os.cpu_count() or 1) // max(1, workers))


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


class LocalCluster:
    """Context manager: the offload store, a coordinator and `workers` workers, all local;
    with `metrics`, the coordinator and workers serve /metrics (Redis has no exporter)."""

    def __init__(self, workers: int, log_dir: Path, *, store_maxmemory: str = "2gb",
                 threads: int = 0, extra_env: dict[str, str] | None = None,
                 cluster_file: Path | None = None, metrics: bool = False,
                 restart: bool = False) -> None:
        self.n_workers, self.log_dir, self.metrics = workers, log_dir, metrics
        self.restart = restart  # relaunch processes that die (see the module docstring)
        self.relaunches: dict[str, int] = {}  # process name -> times relaunched
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards `processes` against the supervisor
        self.cluster_file = cluster_file  # the coordinator's --cluster (plan "auto")
        self.store_maxmemory = store_maxmemory
        threads = threads or default_threads(workers)
        self.env = project_env({**os.environ, "PIPEFB_THREADS": str(threads),
                                **(extra_env or {})})
        # the store's service user ([Note: store ACL] in offload_store/acl.py): every
        # process here authenticates as it; the default user is off
        self.store_user, self.store_password = STORE_USER, secrets.token_hex(16)
        self.env.update(PIPEFB_STORE_USER=self.store_user,
                        PIPEFB_STORE_PASSWORD=self.store_password)
        self.processes: list[Process] = []
        self.store = self.coordinator = ""

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str], *, service: bool = False) -> Process:
        """Starts a process; a service (coordinator, worker) gets `--metrics-port` 0 with
        metrics, else empty, which overrides a PIPEFB_METRICS_PORT in the environment."""
        if service:
            args = [*args, "--metrics-port", "0" if self.metrics else ""]
        proc = Process(name, args, self.log_dir, self.env, metrics=service and self.metrics)
        with self._lock:
            self.processes.append(proc)
        return proc

    def start(self) -> None:
        """Starts every process and waits until each serves."""
        _RUNNING.add(self)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.store = self._spawn("redis", ["-m", "offload_store", "--port", "0", "--acl",
                                           "--maxmemory", self.store_maxmemory]).wait_ready()
        extra = ["--cluster", str(self.cluster_file)] if self.cluster_file else []
        self.coordinator = self._spawn("coordinator", [
            "-m", "coordinator", "--listen", "127.0.0.1:0", "--store", self.store,
            "--journal", str(self.log_dir / "journal"), *extra],
            service=True).wait_ready()
        workers = [self.add_worker(i) for i in range(self.n_workers)]
        for proc in workers:
            proc.wait_ready()
        self.write_manifest()
        if self.restart:
            threading.Thread(target=self._supervise, name="local-supervisor",
                             daemon=True).start()

    def _supervise(self) -> None:
        """Relaunches every process that exits, until `stop`."""
        while not self._stopping.wait(SUPERVISE_SECONDS):
            with self._lock:
                dead = [p for p in self.processes if p.popen.poll() is not None]
            for proc in dead:
                if self._stopping.is_set():
                    return
                self._relaunch(proc)

    def _relaunch(self, proc: Process) -> None:
        """Starts `proc` again in its place: Redis and the coordinator on their address."""
        args = list(proc.args)
        if proc.name in ("redis", "coordinator"):
            flag = "--port" if proc.name == "redis" else "--listen"
            value = proc.address.rsplit(":", 1)[1] if proc.name == "redis" else proc.address
            args[args.index(flag) + 1] = value
        with self._lock:
            if self._stopping.is_set():
                return
            new = proc.relaunched(args)
            self.processes[self.processes.index(proc)] = new
            self.relaunches[proc.name] = self.relaunches.get(proc.name, 0) + 1
        try:
            new.wait_ready()
        except RuntimeError as error:  # it died starting: the next round relaunches it
            if not self._stopping.is_set():
                print(f"pipefb: {error}", file=sys.stderr)
            return
        self.write_manifest()

    def process(self, name: str) -> Process:
        """The current process named `name` (relaunches replace it)."""
        with self._lock:
            return next(p for p in self.processes if p.name == name)

    def write_manifest(self) -> Path:
        """Writes `cluster.json` (name -> pid, address, log, and the /metrics URL of each
        process that serves one) beside the logs."""
        path = self.log_dir / "cluster.json"
        with self._lock:
            text = json.dumps({p.name: p.manifest() for p in self.processes}, indent=2)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
        return path

    def metrics_urls(self) -> dict[str, str]:
        """Process name -> /metrics URL of every process that serves one."""
        return {p.name: p.metrics_url for p in self.processes if p.metrics_url}

    def add_worker(self, index: int) -> Process:
        """Starts one more worker registering with the coordinator (not waited for)."""
        return self._spawn(f"worker-{index}", [
            "-m", "worker", "--listen", "127.0.0.1:0", "--coordinator", self.coordinator,
            "--name", f"worker-{index}"], service=True)

    def workers(self) -> list[Process]:
        """The worker processes, in start order."""
        return [p for p in self.processes if p.name.startswith("worker-")]

    def stop(self) -> None:
        """Stops workers, then the coordinator, then Redis (no more relaunches)."""
        self._stopping.set()
        with self._lock:
            procs = list(self.processes)
        for proc in reversed(procs):
            proc.stop()
        with self._lock:  # listed until stopped, so that `kill` still finds them
            self.processes = []
        _RUNNING.discard(self)

    def kill(self) -> int:
        """SIGKILLs every process still running, and reaps it (Redis's server follows
        its parent: PR_SET_PDEATHSIG); returns how many there were."""
        self._stopping.set()
        with self._lock:
            procs = list(self.processes)
        return sum(proc.kill() for proc in procs)


def kill_running() -> int:
    """SIGKILLs the processes of every local cluster this process started and has not
    stopped (what an interrupted CLI does when its clean-up hangs); returns how many."""
    return sum(cluster.kill() for cluster in list(_RUNNING))
