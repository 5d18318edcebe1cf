"""The images of the container test, built here without a registry: a Debian base from
the mirror apt uses, stand-ins for the two public images the Dockerfile and manifests
name, and pipefb's own image from the unmodified Dockerfile.

The stand-ins carry the public names (`python:3.11-slim-bookworm`, `redis:7.4.2`) in the
test's own podman storage, so the Dockerfile's `FROM` and the manifests' `image:` are the
ones a real cluster uses; they are made from Debian's packages (deploy/standins/).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from deploy.podman import Podman

ROOT = Path(__file__).resolve().parent.parent
BASE = "localhost/debian:bookworm"
STANDINS = {  # public name -> its Containerfile under deploy/standins/
    "docker.io/library/python:3.11-slim-bookworm": "python.Containerfile",
    "docker.io/library/redis:7.4.2": "redis.Containerfile",
}
IMAGE = "localhost/pipefb:cpu"  # the manifests' `pipefb:cpu`
DEBOOTSTRAP_TIMEOUT_S = 900.0
# what a container image does without: package caches and lists, docs, man pages, locales
SLIM = ("./var/cache/apt/archives/*.deb", "./var/cache/apt/*.bin", "./var/lib/apt/lists/*",
        "./usr/share/doc/*", "./usr/share/man/*", "./usr/share/locale/*")


def apt_mirror(sources: Path = Path("/etc/apt")) -> str:
    """The Debian mirror apt is configured with (deb822 `URIs:` or a one-line `deb`).

    Raises:
        RuntimeError: none found.
    """
    for path in [*sorted(sources.glob("sources.list.d/*")), sources / "sources.list"]:
        if not path.is_file():
            continue
        text = path.read_text()
        for pattern in (r"^URIs:\s*(\S+/debian)/?\s*$",
                        r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s"):
            found = re.search(pattern, text, re.MULTILINE)
            if found:
                return found[1]
    raise RuntimeError(f"no Debian mirror in {sources}/sources.list*: give --mirror URL")


def ensure_base(podman: Podman, mirror: str) -> bool:
    """Imports `BASE` from a minimal debootstrap of bookworm unless it exists; returns
    whether it was built."""
    if podman.image_exists(BASE):
        return False
    with tempfile.TemporaryDirectory(prefix="pipefb-rootfs-", dir=podman.home) as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror],
                       check=True, capture_output=True, timeout=DEBOOTSTRAP_TIMEOUT_S)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--wildcards",
                                *(f"--exclude={p}" for p in SLIM), "-c", "."],
                               stdout=subprocess.PIPE)
        imported = subprocess.run([*podman.base, "import", "-", BASE], stdin=tar.stdout,
                                  env=podman.env, capture_output=True, timeout=600)
        tar.wait()
        if imported.returncode or tar.returncode:
            raise RuntimeError(f"podman import of the rootfs failed: {imported.stderr!r}")
    return True


def ensure_standins(podman: Podman) -> list[str]:
    """Builds each stand-in image that is missing; returns the names built."""
    built = []
    with tempfile.TemporaryDirectory(prefix="pipefb-standin-") as empty:
        for name, containerfile in STANDINS.items():
            if podman.image_exists(name):
                continue
            podman("build", "--network", "host", "-f",
                   str(ROOT / "deploy" / "standins" / containerfile), "-t", name, empty)
            built.append(name)
    return built


def build_pipefb(podman: Podman, wheels: Path | None, ca_bundle: Path | None) -> None:
    """Builds `IMAGE` from the repository's Dockerfile, as docs/deploy.md tells an
    operator without a registry: the CPU torch wheel from `wheels` (PyPI for the rest)
    and the extra CA bundle as a build secret. Cached layers make a rebuild after a
    source change reinstall pipefb alone."""
    args = ["build", "--network", "host", "--build-arg", "TORCH=cpu", "-t", IMAGE]
    if wheels is not None:
        args += ["--build-context", f"wheels={wheels}",
                 "--build-arg", "TORCH_INDEX=https://pypi.org/simple"]
    if ca_bundle is not None:
        args += ["--secret", f"id=ca,src={ca_bundle}"]
    podman(*args, str(ROOT))


def image_size(podman: Podman, name: str = IMAGE) -> int:
    """The image's size in bytes, as `podman images` reports it."""
    [info] = podman.inspect("image", name)
    size = info["Size"]
    assert isinstance(size, int)
    return size


def torch_wheels() -> Path | None:
    """The directory of pip's `find-links` holding a CPU torch wheel, if pip has one."""
    done = subprocess.run(["pip", "config", "list"], capture_output=True, text=True,
                          check=False) if shutil.which("pip") else None
    for line in (done.stdout.splitlines() if done else []):
        if line.split("=", 1)[0].endswith(".find-links"):
            folder = Path(line.split("=", 1)[1].strip("'\""))
            if any(folder.glob("torch-*+cpu-*.whl")):
                return folder
    return None
