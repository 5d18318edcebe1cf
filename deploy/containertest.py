"""The container test: pipefb's image and manifests built and run for real with podman.

Phases (one line each, with its time):
  images    a Debian base from apt's mirror, stand-ins for python:3.11-slim-bookworm and
            redis:7.4.2 (deploy/images.py), pipefb's image from the unmodified Dockerfile
            (the CPU torch wheel from pip's find-links, the host's CA bundle as a secret);
  host      Redis, the coordinator and 4 workers as containers on the host's 127.0.0.1;
            `pipefb submit --follow` (from the image) trains a pipefb job whose losses
            must equal the same job's `single` run in the image; /metrics of the
            coordinator and a worker scraped;
  kube      `kubectl kustomize k8s/overlays/cpu`, adapted (deploy/kubeplay.py), played
            pod by pod on an `--internal` network: mTLS, the bearer token and the Redis
            ACL across pods; the submit pod must succeed; every probe is run; a worker's
            user, read-only root, capabilities and seccomp are checked inside it;
  teardown  everything removed by id (also after a failure), nothing of it left running.
Nothing listens outside 127.0.0.1 or the internal network. Run: scripts/test_container.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import secrets
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from deploy import images
from deploy.kubeplay import Adapter, PlayPod, secrets_by_name, write_pod
from deploy.manifests import build
from deploy.podman import Podman
from pipefb.secretfiles import verifier

ROOT = Path(__file__).resolve().parent.parent
HOME = Path("/var/tmp/pipefb-container")  # podman storage and the build cache, kept
MAX_IMAGE_BYTES = 1_500_000_000
STEPS = 3  # of each job trained
WORKERS = 4
SUBNET = "10.89.77.0/24"  # the internal network of the kube phase
NETWORK = "pipefb-kube-test"
READY_TIMEOUT_S = 240.0
JOB_TIMEOUT_S = 420.0
STEP_LINE = re.compile(r"step (\d+) loss (\S+) ")
JOB = ["--model", "gpt", "--dataset", "text", "--schedule", "pipefb", "--workers",
       str(WORKERS), "--batch-size", "8", "--microbatches", "4", "--steps", str(STEPS),
       "--optimizer", "adamw", "--lr", "0.003", "--seed", "0"]


class Phases:
    """Prints one line per phase: its name, seconds and what it found."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[list[str]]:
        began, notes = time.monotonic(), list[str]()
        try:
            yield notes
        except BaseException:
            print(f"{name:<9} FAILED after {time.monotonic() - began:6.1f} s", flush=True)
            raise
        print(f"{name:<9} ok {time.monotonic() - began:6.1f} s  {'; '.join(notes)}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], bool], timeout: float, every: float = 1.0) -> None:
    """Polls `check` until it is true.

    Raises:
        TimeoutError: naming `what`.
    """
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def losses(output: str) -> list[str]:
    """The loss of each `step N loss X ...` line, as printed, in step order."""
    found = [(int(m[1]), m[2]) for m in STEP_LINE.finditer(output)]
    if [s for s, _ in found] != list(range(STEPS)):
        raise AssertionError(f"steps {[s for s, _ in found]} in:\n{output[-3000:]}")
    return [x for _, x in found]


def scrape(url: str) -> str:
    text: str = urllib.request.urlopen(url, timeout=10).read().decode()
    return text


def host_phase(podman: Podman, notes: list[str], work: Path) -> None:
    """Redis, the coordinator and 4 workers as containers with host networking."""
    password = secrets.token_hex(16)
    acl, auth, boss_dir = work / "acl", work / "auth", work / "coordinator"
    for folder in (acl, auth, boss_dir):
        folder.mkdir()
        shutil.chown(folder, 10001, 10001)
    boss = secrets.token_urlsafe(32)  # the coordinator's credential; workers get its hash
    # the admin's token, the service credential, the coordinator's and its verifier
    # (the coordinator's in a folder of its own, mounted into the coordinator only)
    for path, text in ((auth / "token", secrets.token_urlsafe(32)),
                       (auth / "service-token", secrets.token_urlsafe(32)),
                       (boss_dir / "token", boss),
                       (auth / "coordinator-verifier", verifier(boss))):
        path.write_text(text)
        shutil.chown(path, 10001, 10001)
        path.chmod(0o400)
    common = ["--network", "host", "--read-only", "--cap-drop", "ALL",
              "--security-opt", "no-new-privileges", "--tmpfs", "/tmp"]
    made = podman.run_once(*common, "-e", f"PIPEFB_STORE_PASSWORD={password}",
                           "-v", f"{acl}:/acl", images.IMAGE,
                           "python", "-m", "offload_store", "--write-acl", "/acl/users.acl")
    assert made.returncode == 0, made.stderr
    shutil.chown(acl / "users.acl", 999, 999)  # Redis's user reads it
    redis_port, grpc, metrics = free_port(), free_port(), free_port()
    podman.run_detached(*common, "--user", "999:999", "-v", f"{acl}:/acl:ro",
                        "docker.io/library/redis:7.4.2", "redis-server", "--bind", "127.0.0.1",
                        "--port", str(redis_port), "--aclfile", "/acl/users.acl",
                        "--save", "", "--appendonly", "no", "--dir", "/tmp")
    # [Note: access]: the admin's token for the coordinator and the client, the service
    # credential for the coordinator and the workers, the coordinator's own for it and its
    # verifier for the workers, the store password for the coordinator only
    base = ["-e", "PIPEFB_THREADS=1", "-v", f"{auth}:/auth:ro"]
    user = ["-e", "PIPEFB_TOKEN_FILE=/auth/token"]
    service = ["-e", "PIPEFB_SERVICE_TOKEN_FILE=/auth/service-token"]
    boss_only = ["-v", f"{boss_dir}:/coordinator:ro",
                 "-e", "PIPEFB_COORDINATOR_TOKEN_FILE=/coordinator/token"]
    check = ["-e", "PIPEFB_COORDINATOR_VERIFIER_FILE=/auth/coordinator-verifier"]
    store = ["-e", "PIPEFB_STORE_USER=pipefb", "-e", f"PIPEFB_STORE_PASSWORD={password}"]
    coordinator = f"127.0.0.1:{grpc}"
    podman.run_detached(*common, *base, *user, *service, *boss_only, *store, images.IMAGE,
                        "python", "-m", "coordinator",
                        "--listen", coordinator, "--store", f"127.0.0.1:{redis_port}",
                        "--metrics-port", str(metrics))
    worker_metrics = free_port()
    for i in range(WORKERS):
        podman.run_detached(*common, *base, *service, *check, images.IMAGE, "python", "-m",
                            "worker", "--name", f"worker-{i}",
                            "--listen", f"127.0.0.1:{free_port()}",
                            "--coordinator", coordinator, "--store", f"127.0.0.1:{redis_port}",
                            "--metrics-port", str(worker_metrics) if i == 0 else "")
    submitted = podman.run_once(*common, *base, *user, images.IMAGE, "pipefb", "submit",
                                "--coordinator", coordinator, "--follow", *JOB,
                                timeout=JOB_TIMEOUT_S)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-3000:]
    pipeline = losses(submitted.stdout)
    out = work / "single"
    out.mkdir()
    shutil.chown(out, 10001, 10001)
    single = podman.run_once("--network", "none", "--read-only", "--tmpfs", "/tmp",
                             "-v", f"{out}:/out", images.IMAGE, "pipefb", "local", "train",
                             *JOB, "--schedule", "single", "--out", "/out",
                             timeout=JOB_TIMEOUT_S)
    assert single.returncode == 0, single.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    reference = [f"{step['loss']:.4f}" for step in report["steps"]]
    assert pipeline == reference, (pipeline, reference)
    assert all(math.isfinite(float(x)) for x in pipeline)
    notes.append(f"losses {' '.join(pipeline)} = single")
    for name, port, series in (("coordinator", metrics, "pipefb_job"),
                               ("worker-0", worker_metrics, "pipefb_worker")):
        text = scrape(f"http://127.0.0.1:{port}/metrics")
        assert series in text, f"{name}: no {series}* series"
    notes.append("metrics of the coordinator and worker-0 scraped")


def play(podman: Podman, pods: list[PlayPod], folder: Path) -> None:
    """Plays each pod on the internal network at its address, in order."""
    for pod in pods:
        podman.play(write_pod(pod, folder), [pod.name], "--network", NETWORK,
                    "--ip", pod.address, "--start")


def probe(podman: Podman, pod: PlayPod, kinds: tuple[str, ...]) -> list[str]:
    """Runs the pod's probes of `kinds` through podman exec; returns the failures."""
    failed = []
    for container, found in pod.probes.items():
        for kind, command in found:
            if kind in kinds:
                done = podman("exec", f"{pod.name}-{container}", *command, check=False,
                              timeout=30.0)
                if done.returncode:
                    failed.append(f"{pod.name}/{container} {kind}: {done.stderr.strip()[-200:]}")
    return failed


def ready(podman: Podman, pod: PlayPod) -> bool:
    """Whether the pod's startup and readiness probes pass."""
    return not probe(podman, pod, ("startupProbe", "readinessProbe"))


def container_state(podman: Podman, name: str) -> tuple[str, int]:
    [info] = podman.inspect("container", name)
    state = info["State"]
    assert isinstance(state, dict)
    return str(state["Status"]), int(state["ExitCode"])


def security_of(podman: Podman, container: str) -> dict[str, str]:
    """A container's uid, gid, effective capabilities, seccomp mode, no_new_privs and
    whether its root filesystem refused a write, from inside it."""
    script = ("id -u; id -g; grep -E '^(CapEff|Seccomp|NoNewPrivs):' /proc/self/status; "
              "touch /written 2>/dev/null && echo root-writable || echo root-read-only")
    lines = podman("exec", container, "sh", "-c", script).stdout.splitlines()
    status = dict(line.split(":\t", 1) for line in lines[2:-1])
    return {"uid": lines[0], "gid": lines[1], **status, "root": lines[-1]}


def kube_phase(podman: Podman, notes: list[str], work: Path) -> None:
    """The cpu overlay, adapted and played; the submit pod trains; probes and security."""
    from deploy.localrun import local_secrets

    values = local_secrets(work / "pki")
    adapter = Adapter(build("cpu"), SUBNET, work / "volumes", values, {"steps": STEPS})
    pods = adapter.pods()
    for name, keys in secrets_by_name(values).items():
        podman.secret(name, keys)
    podman.network(NETWORK, SUBNET)
    services = [p for p in pods if p.kind != "Job"]
    play(podman, services, work)
    for pod in services:
        wait_for(f"{pod.name} ready", partial(ready, podman, pod), READY_TIMEOUT_S, every=2.0)
    [submit] = [p for p in pods if p.kind == "Job"]
    play(podman, [submit], work)
    [job] = submit.containers()

    def finished() -> bool:
        return container_state(podman, job)[0] == "exited"

    wait_for("the submit pod", finished, JOB_TIMEOUT_S, every=2.0)
    logs = podman("logs", job).stdout
    code = container_state(podman, job)[1]
    assert code == 0, f"submit pod exited {code}:\n{logs[-3000:]}"
    trained = losses(logs)
    assert all(math.isfinite(float(x)) for x in trained)
    notes.append(f"{len(pods)} pods; submit trained {STEPS} steps (loss {trained[-1]})")
    failures = [f for p in services for f in probe(podman, p, ("startupProbe",
                                                              "readinessProbe",
                                                              "livenessProbe"))]
    assert not failures, failures
    notes.append(f"{sum(len(k) for p in services for k in p.probes.values())} probes passed")
    worker = next(p for p in pods if p.kind == "StatefulSet").containers()[0]
    found = security_of(podman, worker)
    want = {"uid": "10001", "gid": "10001", "CapEff": "0000000000000000", "Seccomp": "2",
            "NoNewPrivs": "1", "root": "root-read-only"}
    assert found == want, (found, want)
    notes.append("worker: uid 10001, read-only root, no capabilities, seccomp filter")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.containertest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", type=Path, default=HOME, help="podman storage and build cache")
    p.add_argument("--mirror", default="", help="Debian mirror (default: apt's)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="directory with the CPU torch wheel (default: pip's find-links)")
    p.add_argument("--ca-bundle", type=Path, default=Path("/etc/ssl/certs/ca-certificates.crt"),
                   help="CA bundle pip in the build trusts (a TLS-inspecting proxy's)")
    p.add_argument("--skip", action="append", choices=("host", "kube"), default=[],
                   help="leave out a phase (repeatable); images and teardown always run")
    args = p.parse_args(argv)
    phases = Phases()
    with Podman(args.home) as podman, \
            tempfile.TemporaryDirectory(prefix="pipefb-container-", dir=args.home) as tmp:
        work = Path(tmp)
        try:
            with phases.phase("images") as notes:
                if images.ensure_base(podman, args.mirror or images.apt_mirror()):
                    notes.append("base imported")
                notes.extend(f"{n} built" for n in images.ensure_standins(podman))
                images.build_pipefb(podman, args.wheels or images.torch_wheels(),
                                    args.ca_bundle if args.ca_bundle.is_file() else None)
                size = images.image_size(podman)
                notes.append(f"{images.IMAGE} {size / 1e9:.2f} GB")
                assert size <= MAX_IMAGE_BYTES, f"image {size} bytes > {MAX_IMAGE_BYTES}"
            if "host" not in args.skip:
                (work / "host").mkdir()
                with phases.phase("host") as notes:
                    host_phase(podman, notes, work / "host")
                podman.cleanup()
            if "kube" not in args.skip:
                with phases.phase("kube") as notes:
                    kube_phase(podman, notes, work)
        finally:
            with phases.phase("teardown") as notes:
                failures = podman.cleanup()
                left = podman("ps", "-aq", check=False).stdout.split()
                assert not failures and not left, (failures, left)
                notes.append("every container, pod, network and secret removed")
    print(f"container test passed in {time.monotonic() - phases.start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
