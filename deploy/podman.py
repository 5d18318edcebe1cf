"""The podman CLI on storage of its own, recording everything it creates so that all of it
is removed by id at the end, also after a failure.

[Note: podman here] Root on this machine cannot raise resource limits and its cgroups are
hybrid: crun refuses them, so the runtime is runc with the cgroupfs manager, and every
container's `nofile` and `nproc` limits stay within the host's hard limits (set in a
containers.conf of our own). Images, containers and their state live under one directory
(`--root`, `--runroot`), never in the machine's default storage, so nothing here touches
or depends on other podman users; the directory is kept between runs as a build cache.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

CLI_TIMEOUT_S = 900.0  # the longest single podman command (an image build, cold)
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


class PodmanError(RuntimeError):
    """A podman command failed; the message names it and ends with its stderr."""


def _hard_limit(kind: int, most: int) -> int:
    """The smaller of `most` and the host's hard limit of `kind` (unlimited: `most`)."""
    hard = resource.getrlimit(kind)[1]
    return most if hard == resource.RLIM_INFINITY else min(hard, most)


class Podman:
    """podman on storage under `home` ([Note: podman here]); a context manager whose exit
    removes every container, pod, network, secret and volume it created, by id."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        conf = home / "containers.conf"
        conf.write_text(CONTAINERS_CONF.format(
            nofile=_hard_limit(resource.RLIMIT_NOFILE, 20000),
            nproc=_hard_limit(resource.RLIMIT_NPROC, 4096)))
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.base = ["podman", "--root", str(home / "storage"), "--runroot", str(home / "run")]
        self.created: list[tuple[str, str]] = []  # (kind, id) in creation order

    def __enter__(self) -> Podman:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()

    def __call__(self, *args: str, check: bool = True, timeout: float = CLI_TIMEOUT_S,
                 stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Runs `podman ARGS` and returns what it printed.

        Raises:
            PodmanError: it exited non-zero (with `check`), naming the command.
        """
        done = subprocess.run([*self.base, *args], env=self.env, capture_output=True,
                              timeout=timeout, input=stdin.decode() if stdin else None,
                              text=True)
        if check and done.returncode:
            raise PodmanError(f"podman {' '.join(args[:3])} ... exited {done.returncode}: "
                              f"{done.stderr.strip()[-2000:]}")
        return done

    def image_exists(self, name: str) -> bool:
        return self("image", "exists", name, check=False).returncode == 0

    def run_detached(self, *args: str) -> str:
        """`podman run -d ARGS`; returns the container's id, recorded for clean-up."""
        cid = self("run", "-d", *args).stdout.strip()
        self.created.append(("container", cid))
        return cid

    def run_once(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """`podman run --rm ARGS` to completion (not checked: the caller reads the result)."""
        return self("run", "--rm", *args, check=False, timeout=timeout)

    def network(self, name: str, subnet: str) -> str:
        """Creates an `--internal` network (no route out of it), recorded for clean-up."""
        self("network", "rm", "-f", name, check=False)  # a leftover of a killed run
        self("network", "create", "--internal", "--subnet", subnet, name)
        self.created.append(("network", name))
        return name

    def secret(self, name: str, values: dict[str, str]) -> None:
        """A secret holding a flat JSON object, the form `kube play` reads `secretKeyRef`
        from; each value base64-encoded, as in a Secret's `data` (kube play decodes it);
        recorded for clean-up."""
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
        self("secret", "rm", name, check=False)
        self("secret", "create", name, "-", stdin=json.dumps(encoded).encode())
        self.created.append(("secret", name))

    def play(self, path: Path, pods: Sequence[str], *args: str) -> None:
        """`podman kube play ARGS PATH`, whose YAML defines `pods` (kind Pod, so podman
        keeps their names), recorded for clean-up before podman starts them."""
        self.created.extend(("pod", pod) for pod in pods)
        self("kube", "play", *args, str(path))

    def inspect(self, kind: str, name: str) -> list[dict[str, object]]:
        out: list[dict[str, object]] = json.loads(self(kind, "inspect", name).stdout)
        return out

    def cleanup(self, ids: Sequence[tuple[str, str]] | None = None) -> list[str]:
        """Removes what was created, newest first; returns one line per failure (cleanup
        goes on past each, so one stuck container does not leak the rest)."""
        failures = []
        for kind, ident in reversed(list(ids if ids is not None else self.created)):
            args = {"container": ("rm", "-f", "-t", "5", ident),
                    "pod": ("pod", "rm", "-f", "-t", "5", ident),
                    "network": ("network", "rm", "-f", ident),
                    "secret": ("secret", "rm", ident),
                    "volume": ("volume", "rm", "-f", ident)}[kind]
            done = self(*args, check=False, timeout=120.0)
            if done.returncode and "no such" not in done.stderr.lower():
                failures.append(f"{kind} {ident}: {done.stderr.strip()[-300:]}")
        if ids is None:
            self.created.clear()
        return failures
