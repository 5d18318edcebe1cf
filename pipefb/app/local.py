"""A local cluster of real processes on 127.0.0.1: Redis, a coordinator and N workers.

With `metrics`, the coordinator and the workers serve Prometheus /metrics on free ports
(their `--metrics-port 0`); their `metrics URL` lines give the URLs.

Each worker runs on cores of its own where the machine has one for each of every
worker's torch threads ([Note: pinned workers] in pipefb/cpus.py); `pin_cpus=False`
leaves every process to the kernel.

With `restart`, a process that dies is relaunched, as Kubernetes restarts a pod: Redis
and the coordinator on the address they had (Redis comes back empty), a worker under
its name on a new port (it registers again). Jobs with `max_restarts` then replay.

Authentication is always on ([Note: access] in protos/security.py): each cluster makes
its own service credential (the coordinator's and workers') and, unless the environment
names one in PIPEFB_TOKEN_FILE, its own user token, both in files only this user may
read; the user token is also left where clients of the coordinator's address find it
(`pipefb.secretfiles.token_path`) until the cluster stops. Workers get neither the user
token nor a store password: their stash runs as each job's own store user.

Only subprocesses: the core stays free of grpc and redis. Every process is stopped on
exit, on Ctrl-C and on failure; children also get SIGTERM if this process dies
(PR_SET_PDEATHSIG on Linux). `kill_running` is the last resort of an interrupted CLI
whose clean-up hangs (see `pipefb.app.cli`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from pipefb.cpus import ENV as CPUS_ENV
from pipefb.cpus import format_cpu_list, share_out
from pipefb.job.dataroots import ENV as DATA_ROOT_ENV
from pipefb.job.dataroots import local_default
from pipefb.processes import Process, default_threads, project_env
from pipefb.secretfiles import token_path, verifier, write_private

SUPERVISE_SECONDS = 0.2  # with restart: how often dead processes are looked for
STORE_USER = "pipefb"  # = offload_store.acl.SERVICE_USER (the core imports no redis code)
# what the workers' environment leaves out: the user's credentials and the store's password
NOT_FOR_WORKERS = ("PIPEFB_TOKEN_FILE", "PIPEFB_USERS_FILE", "PIPEFB_STORE_USER",
                   "PIPEFB_STORE_PASSWORD", "PIPEFB_COORDINATOR_TOKEN_FILE")
# the workers' node-local shared-memory tier ([Note: local tier index] in
# offload_store/shm.py): a private directory made in SHM_ROOT (the system's temporary
# directory where there is none) unless the environment names one; "" turns it off
TIER_ENV = "PIPEFB_LOCAL_TIER_DIR"
TIER_PREFIX = "pipefb-tier-"
OWNER_FILE = "owner"  # the pid of the process whose cluster made the tier directory
SOCKET_ENV = "PIPEFB_STORE_SOCKET"  # = offload_store.store.SOCKET_ENV: Redis's unix socket
SHM_ROOT = Path("/dev/shm")
_RUNNING: weakref.WeakSet[LocalServices] = weakref.WeakSet()  # started, not yet stopped


class LocalServices:
    """Context manager: the offload store, a coordinator and `workers` workers, all local;
    with `metrics`, the coordinator and workers serve /metrics (Redis has no exporter)."""

    def __init__(self, workers: int, log_dir: Path, *, store_maxmemory: str = "2gb",
                 threads: int = 0, extra_env: dict[str, str] | None = None,
                 cluster_file: Path | None = None, metrics: bool = False,
                 restart: bool = False, pin_cpus: bool = True) -> None:
        self.n_workers, self.log_dir, self.metrics = workers, log_dir, metrics
        self.restart = restart  # relaunch processes that die (see the module docstring)
        self.relaunches: dict[str, int] = {}  # process name -> times relaunched
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards `processes` against the supervisor
        self.cluster_file = cluster_file  # the coordinator's --cluster (plan "auto")
        self.store_maxmemory = store_maxmemory
        threads = threads or default_threads(workers)
        # cores of its own for each worker where there are enough ([Note: pinned workers])
        self.worker_cpus = (share_out(workers, threads) or []) if pin_cpus else []
        self.env = project_env({**os.environ, "PIPEFB_THREADS": str(threads),
                                DATA_ROOT_ENV: local_default(), **(extra_env or {})})
        # the store's service user ([Note: store ACL] in offload_store/acl.py): every
        # process of the cluster authenticates as it; the default user is off
        self.store_user, self.store_password = STORE_USER, secrets.token_hex(16)
        self.env.update(PIPEFB_STORE_USER=self.store_user,
                        PIPEFB_STORE_PASSWORD=self.store_password)
        # the cluster's credentials ([Note: access]): written at start, under log_dir
        self.secrets = log_dir / "secrets"
        self.own_token = not self.env.get("PIPEFB_TOKEN_FILE")  # else the given one
        self.token_file = Path(self.env.get("PIPEFB_TOKEN_FILE") or self.secrets / "token")
        self.service_token_file = Path(self.env.get("PIPEFB_SERVICE_TOKEN_FILE")
                                       or self.secrets / "service-token")
        # the coordinator's own credential for worker RPCs, and its SHA-256 the workers
        # check it against ([Note: access]): a worker's files do not let one pose as it
        self.coordinator_token_file = Path(self.env.get("PIPEFB_COORDINATOR_TOKEN_FILE")
                                           or self.secrets / "coordinator-token")
        self.verifier_file = Path(self.env.get("PIPEFB_COORDINATOR_VERIFIER_FILE")
                                  or self.secrets / "coordinator-verifier")
        self.env.update(PIPEFB_TOKEN_FILE=str(self.token_file),
                        PIPEFB_SERVICE_TOKEN_FILE=str(self.service_token_file),
                        PIPEFB_COORDINATOR_TOKEN_FILE=str(self.coordinator_token_file),
                        PIPEFB_COORDINATOR_VERIFIER_FILE=str(self.verifier_file))
        # a worker's cores are its `--cpus` alone: none from this process's environment
        self.worker_env = {k: v for k, v in self.env.items()
                           if k not in NOT_FOR_WORKERS and k != CPUS_ENV}
        self.processes: list[Process] = []
        self.store = self.coordinator = ""
        self.tier_dir: Path | None = None  # the tier directory this cluster made (removed at stop)
        self.socket_dir: Path | None = None  # the directory of Redis's unix socket (the same)

    def __enter__(self) -> LocalServices:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str], *, service: bool = False,
               env: dict[str, str] | None = None) -> Process:
        """Starts a process (with `env`, default the cluster's); a service (coordinator,
        worker) gets `--metrics-port` 0 with metrics, else empty, which overrides a
        PIPEFB_METRICS_PORT in the environment."""
        if service:
            args = [*args, "--metrics-port", "0" if self.metrics else ""]
        proc = Process(name, args, self.log_dir, env or self.env,
                       metrics=service and self.metrics)
        with self._lock:
            self.processes.append(proc)
        return proc

    def start(self) -> None:
        """Starts every process and waits until each serves."""
        _RUNNING.add(self)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._write_secrets()
        self._make_tier()
        # Redis listens on a unix socket too, which every process of the cluster uses
        self.socket_dir = Path(tempfile.mkdtemp(prefix="pipefb-redis-"))  # (a short path)
        socket = self.socket_dir / "redis.sock"
        self.env[SOCKET_ENV] = self.worker_env[SOCKET_ENV] = str(socket)
        self.store = self._spawn("redis", ["-m", "offload_store", "--port", "0", "--acl",
                                           "--maxmemory", self.store_maxmemory,
                                           "--unix-socket", str(socket)]).wait_ready()
        extra = ["--cluster", str(self.cluster_file)] if self.cluster_file else []
        self.coordinator = self._spawn("coordinator", [
            "-m", "coordinator", "--listen", "127.0.0.1:0", "--store", self.store,
            "--journal", str(self.log_dir / "journal"), *extra],
            service=True).wait_ready()
        if self.own_token:  # clients of this address find it ([Note: access])
            write_private(token_path(self.coordinator), self.token)
        workers = [self.add_worker(i) for i in range(self.n_workers)]
        for proc in workers:
            proc.wait_ready()
        self.write_manifest()
        if self.restart:
            threading.Thread(target=self._supervise, name="local-supervisor",
                             daemon=True).start()

    def _make_tier(self) -> None:
        """Makes the cluster's own tier directory (0700), unless the environment names
        one; the coordinator clears a job's segments there, the workers share it."""
        if TIER_ENV in self.env:
            return
        root = SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())
        _sweep_dead_tiers(root)
        self.tier_dir = Path(tempfile.mkdtemp(prefix=TIER_PREFIX, dir=root))
        (self.tier_dir / OWNER_FILE).write_text(str(os.getpid()))
        self.env[TIER_ENV] = self.worker_env[TIER_ENV] = str(self.tier_dir)

    def _write_secrets(self) -> None:
        """Writes the cluster's fresh credentials, each readable by this user only."""
        if self.own_token:
            write_private(self.token_file, secrets.token_hex(32))
        if not self.service_token_file.exists():
            write_private(self.service_token_file, secrets.token_hex(32))
        if not self.coordinator_token_file.exists():
            write_private(self.coordinator_token_file, secrets.token_hex(32))
        if not self.verifier_file.exists():
            write_private(self.verifier_file,
                          verifier(self.coordinator_token_file.read_text().strip()))

    @property
    def token(self) -> str:
        """The user token clients of this cluster send (the coordinator's admin)."""
        return self.token_file.read_text().strip()

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

    def add_worker(self, index: int, flags: Sequence[str] = ()) -> Process:
        """Starts one more worker registering with the coordinator (not waited for), with
        `flags` added to its command line (``--local-tier-dir D``: a tier of its own, as
        a worker on another host has). Worker `index` of the cluster's first `workers`
        runs on its share of the cores where the cluster pins them."""
        if index < len(self.worker_cpus):
            flags = ["--cpus", format_cpu_list(self.worker_cpus[index]), *flags]
        return self._spawn(f"worker-{index}", [
            "-m", "worker", "--listen", "127.0.0.1:0", "--coordinator", self.coordinator,
            "--store", self.store, "--name", f"worker-{index}", *flags], service=True,
            env=self.worker_env)

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
        self._forget_token()
        self._remove_dirs()
        _RUNNING.discard(self)

    def _forget_token(self) -> None:
        """Removes the user token this cluster left for clients of its address."""
        if self.own_token and self.coordinator:
            token_path(self.coordinator).unlink(missing_ok=True)

    def kill(self) -> int:
        """SIGKILLs every process still running, and reaps it (Redis's server follows
        its parent: PR_SET_PDEATHSIG); returns how many there were."""
        self._stopping.set()
        with self._lock:
            procs = list(self.processes)
        self._forget_token()
        killed = sum(proc.kill() for proc in procs)
        self._remove_dirs()
        return killed

    def _remove_dirs(self) -> None:
        """Removes the tier and socket directories this cluster made."""
        for folder in (self.tier_dir, self.socket_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _sweep_dead_tiers(root: Path) -> None:
    """Removes the tier directories in `root` that this user's local clusters made and
    whose process is gone (a SIGKILLed CLI cleans up nothing): their tmpfs pages are
    memory."""
    for folder in root.glob(f"{TIER_PREFIX}*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            pid = int((folder / OWNER_FILE).read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (OSError, ValueError):  # being made now, or not ours to judge
            continue


def kill_running() -> int:
    """SIGKILLs the processes of every local cluster this process started and has not
    stopped (what an interrupted CLI does when its clean-up hangs); returns how many."""
    return sum(cluster.kill() for cluster in list(_RUNNING))
