"""The calibration cache: one YAML file per host, in the `Cluster.to_dict` form under a
comment header saying when, where and with which probes it was measured.

The files live in `$PIPEFB_CACHE_DIR` (default `~/.cache/pipefb/`); the links are reused
for any worker count. A cache whose header lacks this code's `probe version` was measured
by older probes and is measured again.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import socket
from pathlib import Path

import grpc
import torch
import yaml

from calibration.settings import HOST, Measured
from pipefb.errors import ConfigError
from pipefb.sim.cluster import Cluster

PROBE_VERSION = 13  # bumped when a probe measures differently: older caches are re-measured


def cache_path(cache_dir: Path | None = None) -> Path:
    """The cache file of this host: `cluster-HOSTNAME.yaml` in `cache_dir`, else in
    `$PIPEFB_CACHE_DIR`, else in `~/.cache/pipefb/`."""
    folder = cache_dir or Path(os.environ.get("PIPEFB_CACHE_DIR")
                               or Path.home() / ".cache" / "pipefb")
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return folder / f"cluster-{host}.yaml"


def current(head: str) -> bool:
    """Whether a cache header names this code's probe version."""
    return f"probe version {PROBE_VERSION}\n" in head


def header() -> str:
    """Comment lines saying when, where and with what a calibration was made."""
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return (f"# pipefb local cluster, measured {when} on {socket.gethostname()}\n"
            f"# python {platform.python_version()}, torch {torch.__version__}, "
            f"grpc {grpc.__version__}, probe version {PROBE_VERSION}\n"
            f"# re-measure: python -m calibration --refresh\n")


def render(cluster: Cluster, head: str) -> str:
    """The YAML text of a cluster under its comment header."""
    return head + str(yaml.safe_dump(cluster.to_dict(), sort_keys=False))


def read_cache(path: Path) -> tuple[Measured, str]:
    """The measurements and header of a cache file.

    Raises:
        ConfigError: unreadable, not YAML, or not a complete cluster description.
    """
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        first = (str(error).splitlines() or [""])[0]
        raise ConfigError(f"{type(error).__name__}: {first}") from None
    # every part a calibration writes that the cluster cannot do without (`hosts` comes
    # last: a file cut short lacks it)
    missing = ({"network", "store", "overheads", "hosts"}
               - set(data if isinstance(data, dict) else ()))
    if missing:
        raise ConfigError(f"missing {sorted(missing)}")
    try:
        cluster = Cluster.from_dict(data, str(path))
    except TypeError as error:  # e.g. keys of mixed types that cannot be sorted
        raise ConfigError(f"TypeError: {error}") from None
    head = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    return Measured(cluster.network, cluster.store, cluster.action_overhead,
                    cluster.step_overhead, cluster.step_cpu,
                    cluster.oversubscribed_of(HOST), cluster.busy_send,
                    cluster.local_tier, cluster.shared_tier), head


def write_cache(path: Path, text: str) -> None:
    """Writes the cache file atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
