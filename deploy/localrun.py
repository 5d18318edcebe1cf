"""Runs an overlay's containers as local processes on 127.0.0.1: Kubernetes without a cluster.

Each container's command, args and env come from the built manifests; what Kubernetes would
resolve is resolved the same way (secretKeyRef, fieldRef, ``$(VAR)``), and what only exists
in a cluster is mapped onto this machine (`Localizer`): Service and pod DNS names become
127.0.0.1 addresses, fixed listen and metrics ports become 0 (any free port), mounted
volumes become directories, and ``python``, ``pipefb`` and ``redis-server`` the local
binaries. Nothing else is changed, so a wrong flag, env var or name in the manifests fails
here as it would in the cluster. Try it: ``python -m deploy.localrun cpu --steps 3``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import yaml

from deploy.manifests import Doc, build, find, main_container, pod_spec
from pipefb.secretfiles import verifier

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0  # one process's start-up, torch import included
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL
REDIS_READY = "Ready to accept connections"  # redis-server's log line (stdout)
SERVICE_READY = "ready "  # `python -m coordinator|worker` print `ready HOST:PORT`
METRICS_LINE = "metrics http://"  # printed after `ready` when metrics are served
FIELDS = ("metadata.name", "metadata.namespace")  # the fieldRefs resolved
_REF = re.compile(r"\$\$|\$\((\w+)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` is ``$``, other
    references stay as they are."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


def resolve_env(container: Doc, pod: str, namespace: str,
                secret_values: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """A container's env as the kubelet builds it, in order (later entries see earlier).

    Raises:
        KeyError: a secret key or field path that is not provided.
    """
    fields = dict(zip(FIELDS, (pod, namespace), strict=True))
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = secret_values[(ref["name"], ref["key"])]
        else:
            env[item["name"]] = fields[source["fieldRef"]["fieldPath"]]
    return env


def free_port() -> int:
    """A port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Localizer:
    """Rewrites cluster names, ports and paths into local ones."""

    namespace: str
    routes: dict[str, str] = field(default_factory=dict)  # cluster address -> local address

    def route_service(self, service: str, port: int, local: str) -> None:
        """``service:port`` in any of its DNS forms now means `local` (``127.0.0.1:P``)."""
        for host in (service, f"{service}.{self.namespace}.svc",
                     f"{service}.{self.namespace}.svc.cluster.local"):
            self.routes[f"{host}:{port}"] = local

    def route_host(self, host: str) -> None:
        """A pod's DNS name now means 127.0.0.1."""
        self.routes[host] = "127.0.0.1"

    def address(self, value: str) -> str:
        """A value with every routed name replaced, longest names first."""
        for name in sorted(self.routes, key=len, reverse=True):
            value = value.replace(name, self.routes[name])
        return value

    def env(self, env: Mapping[str, str], mounts: Mapping[str, Path],
            listen: str = "127.0.0.1:0", grpc_port: int | None = None) -> dict[str, str]:
        """Listen on `listen` (loopback, any free port by default) where the container
        listens on its gRPC port (`grpc_port`; None: any port), on a free loopback port
        where it listens on another (the coordinator's workers' port), metrics on any free
        port; mounted paths point at local dirs."""
        out = {}
        for name, value in env.items():
            if found := re.fullmatch(r"0\.0\.0\.0:(\d+)", value):
                value = listen if grpc_port in (None, int(found[1])) else "127.0.0.1:0"
            elif value == "0.0.0.0":
                value = "127.0.0.1"
            elif name.endswith("_PORT") and value.isdigit():
                value = "0"
            out[name] = self.args([self.address(value)], mounts)[0]
        return out

    def args(self, argv: list[str], mounts: Mapping[str, Path]) -> list[str]:
        """Arguments with routed names and mounted paths replaced."""
        out = []
        for arg in argv:
            arg = self.address(arg)
            for mount, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
                if arg == mount or arg.startswith(mount + "/"):
                    arg = str(local) + arg[len(mount):]
                    break
            out.append(arg)
        return out


def local_binary(name: str) -> str:
    """`python`, `pipefb` and `redis-server` of the image, as this machine has them."""
    if name == "python":
        return sys.executable
    if name == "redis-server":
        from offload_store.server import find_redis_server

        return find_redis_server()
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name) or name


class LineProcess:
    """A child process whose stdout lines are kept; stderr goes to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        self.lines: list[str] = []
        self._changed = threading.Condition()
        with self.log.open("w") as log:
            self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                          stdin=subprocess.DEVNULL, text=True)
        assert self.popen.stdout is not None
        threading.Thread(target=self._read, args=(self.popen.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, marker: str, timeout: float = START_TIMEOUT_S) -> str | None:
        """The first stdout line containing `marker`; None if the process exits or `timeout`
        passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                hit = next((line for line in self.lines if marker in line), None)
                remaining = deadline - time.monotonic()
                if hit is not None or remaining <= 0 or self.popen.poll() is not None:
                    return hit
                self._changed.wait(min(remaining, 0.2))

    def ready(self, marker: str) -> str:
        """Waits for `marker`; RuntimeError with the log tail if it does not come."""
        line = self.wait_for(marker)
        if line is None:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} did not print {marker!r} "
                               f"(exit {self.popen.poll()}):\n{tail}")
        return line

    def reap(self, deadline: float) -> None:
        """Waits for the process until `deadline` (time.monotonic), then SIGKILLs it."""
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class LocalDeployment:
    """The overlay's Redis, coordinator and workers as local processes (a context manager).

    Args:
        docs: the built overlay (`deploy.manifests.build`).
        workdir: logs and the pods' volumes go here.
        secret_values: (secret name, key) -> value, for every secretKeyRef.
        env_overrides: container env entries to replace, e.g. fewer torch threads.
    """

    def __init__(self, docs: list[Doc], workdir: Path,
                 secret_values: Mapping[tuple[str, str], str],
                 env_overrides: Mapping[str, str] | None = None) -> None:
        self.docs, self.workdir, self.secrets = docs, workdir, secret_values
        self.namespace = find(docs, "Deployment", "pipefb-coordinator")["metadata"]["namespace"]
        self.local = Localizer(self.namespace)
        self.overrides = dict(env_overrides or {})
        self.processes: dict[str, LineProcess] = {}

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Redis first; then the coordinator and every worker replica at once (workers
        retry registering until the coordinator serves); waits until all serve."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_redis()
        coordinator = self._start_coordinator()
        workers = find(self.docs, "StatefulSet", "pipefb-worker")
        names = [f"pipefb-worker-{i}" for i in range(workers["spec"]["replicas"])]
        for name in names:
            self.local.route_host(f"{name}.{workers['spec']['serviceName']}.{self.namespace}.svc")
        for proc in [coordinator, *(self._spawn(workers, name) for name in names)]:
            proc.ready(SERVICE_READY)

    def stop(self) -> None:
        """SIGTERM to every process at once; SIGKILL to those still running after one
        shared grace period; reaps all."""
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.processes.values():
            if proc.popen.poll() is None:
                proc.popen.terminate()
        for proc in self.processes.values():
            proc.reap(deadline)
        self.processes.clear()

    def metrics_urls(self, wait_s: float = 5.0) -> dict[str, str]:
        """Service process name -> the /metrics URL it printed, waiting up to `wait_s` in all."""
        deadline, urls = time.monotonic() + wait_s, {}
        for name, proc in self.processes.items():
            if name == "pipefb-redis":
                continue
            line = proc.wait_for(METRICS_LINE, max(0.0, deadline - time.monotonic()))
            if line:
                urls[name] = line.split()[-1]
        return urls

    def submit(self, job_changes: Mapping[str, object] | None = None,
               timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Runs the pipefb-submit Job's container to completion, its job file changed by
        `job_changes` (e.g. fewer steps)."""
        job = find(self.docs, "Job", "pipefb-submit")
        pod = f"pipefb-submit-{secrets.token_hex(3)}"
        argv, env = self._container(job, pod, job_changes or {})
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def _start_redis(self) -> None:
        deployment = find(self.docs, "Deployment", "pipefb-redis")
        for init in pod_spec(deployment).get("initContainers", []):  # the ACL file
            argv, env = self._container(deployment, "pipefb-redis", {}, container=init)
            subprocess.run(argv, env=env, check=True, capture_output=True,
                           timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL)
        port = free_port()
        proc = self._spawn(deployment, "pipefb-redis", ["--bind", "127.0.0.1", "--port", str(port)])
        proc.ready(REDIS_READY)
        service = find(self.docs, "Service", "pipefb-redis")
        self.local.route_service("pipefb-redis", service["spec"]["ports"][0]["port"],
                                 f"127.0.0.1:{port}")

    def _start_coordinator(self) -> LineProcess:
        """Starts the coordinator on a free port picked in advance, routed before it serves."""
        address = f"127.0.0.1:{free_port()}"
        service = find(self.docs, "Service", "pipefb-coordinator")
        self.local.route_service("pipefb-coordinator", service["spec"]["ports"][0]["port"],
                                 address)
        deployment = find(self.docs, "Deployment", "pipefb-coordinator")
        return self._spawn(deployment, "pipefb-coordinator", listen=address)

    def _spawn(self, workload: Doc, pod: str, extra_args: list[str] | None = None,
               listen: str = "127.0.0.1:0") -> LineProcess:
        argv, env = self._container(workload, pod, {}, listen)
        proc = LineProcess(pod, argv + (extra_args or []), env, self.workdir)
        self.processes[pod] = proc
        return proc

    def _container(self, workload: Doc, pod: str, job_changes: Mapping[str, object],
                   listen: str = "127.0.0.1:0", container: Doc | None = None
                   ) -> tuple[list[str], dict[str, str]]:
        """The local command line and environment of a workload's container in pod `pod`
        (its main container unless `container` names another, e.g. an init container)."""
        container = container or main_container(workload)
        mounts = self._volumes(workload, pod, job_changes, container)
        env = resolve_env(container, pod, self.namespace, self.secrets)
        env.update({k: v for k, v in self.overrides.items() if k in env})
        argv = [expand(a, env) for a in [*container.get("command", []),
                                         *container.get("args", [])]]
        argv = [local_binary(argv[0]), *self.local.args(argv[1:], mounts)]
        base = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
        grpc = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == "grpc"]
        return argv, {**base, **self.local.env(env, mounts, listen, (grpc or [None])[0])}

    def _volumes(self, workload: Doc, pod: str, job_changes: Mapping[str, object],
                 container: Doc) -> dict[str, Path]:
        """mountPath -> a local directory, one per volume of the pod (so its containers
        share them): emptyDirs fresh, ConfigMaps and Secrets written out; a hostPath one
        directory every pod shares (they all run on this one node)."""
        spec, mounts = pod_spec(workload), {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            source = volumes[mount["name"]]
            local = self.workdir / ("node" if "hostPath" in source else pod) / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in source:
                self._write_configmap(source["configMap"]["name"], local, job_changes)
            elif "secret" in source:
                self._write_secret(source["secret"]["secretName"], local)
            mounts[mount["mountPath"]] = local
        return mounts

    def _write_secret(self, name: str, folder: Path) -> None:
        keys = {key: value for (secret, key), value in self.secrets.items() if secret == name}
        if not keys:
            raise KeyError(f"no values for the Secret {name!r}")
        for key, value in keys.items():
            (folder / key).write_text(value)
            (folder / key).chmod(0o400)

    def client_env(self) -> dict[str, str]:
        """The environment a client on this machine needs to reach the deployment's gRPC
        services: the submit Job's TLS and token settings, its Secrets written to local files."""
        job = find(self.docs, "Job", "pipefb-submit")
        _, env = self._container(job, "client", {})
        return {k: v for k, v in env.items() if k.startswith(("PIPEFB_TLS", "PIPEFB_MTLS",
                                                              "PIPEFB_TOKEN"))}

    def _write_configmap(self, name: str, folder: Path, changes: Mapping[str, object]) -> None:
        data = find(self.docs, "ConfigMap", name)["data"]
        for key, text in data.items():
            if changes and key.endswith((".yaml", ".yml")):
                text = yaml.safe_dump({**yaml.safe_load(text), **changes}, sort_keys=False)
            (folder / key).write_text(text)


def local_secrets(folder: Path) -> dict[tuple[str, str], str]:
    """Fresh values of the Secrets the manifests name: the Redis password, the admin's
    token, the service credential, the coordinator's and its verifier, and a test CA's
    certificate (`deploy.pki`), what an
    operator creates in a cluster."""
    from deploy.pki import tls_secret

    boss = secrets.token_urlsafe(32)  # the coordinator's credential; workers get its hash
    values = {("pipefb-redis", "password"): secrets.token_hex(16),
              ("pipefb-auth", "token"): secrets.token_urlsafe(32),
              ("pipefb-service", "token"): secrets.token_urlsafe(32),
              ("pipefb-coordinator", "token"): boss,
              ("pipefb-coordinator-verifier", "verifier"): verifier(boss)}
    values.update({("pipefb-tls", key): v for key, v in tls_secret(folder).items()})
    return values


def main(argv: list[str] | None = None) -> int:
    """Starts an overlay locally, submits its job with --steps, prints the Job's output."""
    p = argparse.ArgumentParser(prog="python -m deploy.localrun", description=__doc__)
    p.add_argument("overlay", help="a directory name under k8s/overlays (cpu)")
    p.add_argument("--steps", type=int, default=3, help="steps of the submitted job")
    p.add_argument("--threads", default="1", help="PIPEFB_THREADS of each worker here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pipefb-localrun-") as tmp, \
            contextlib.ExitStack() as stack:
        run = stack.enter_context(LocalDeployment(
            build(args.overlay), Path(tmp), local_secrets(Path(tmp) / "pki"),
            {"PIPEFB_THREADS": args.threads}))
        done = run.submit({"steps": args.steps})
        print(done.stdout, end="")
        print(done.stderr, end="", file=sys.stderr)
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
