"""The cluster description: workers (speed, memory, host), links, offload store, overheads.

A cluster is read from YAML (`Cluster.load`) or built in code; the planner and the
simulator take it as plain data. Sizes and rates accept units::

    workers:                       # a list, or {count: 8, speed: 1.0, memory: 80GiB}
      - {name: gpu0, speed: 1.0, memory: 80GiB, host: node0}
      - {name: gpu1, speed: 0.5, memory: 40GiB, host: node0}
    hosts:                         # optional: cores the workers of a host share
      - {name: node0, cores: 16}   # loopback: true -> transfers between its workers and
                                   # the store's traffic run on those cores too
                                   # (oversubscribed: 0.9 -> with twice as many busy
                                   # threads as cores they run at 0.9 of their speed;
                                   # default 1)
    network: {bandwidth: 25GB/s, latency: 5us}     # any two workers, unless `links` says
                                   # (cpu: 1.3 -> on a loopback host a transfer keeps 1.3
                                   # cores busy, sender and receiver together; default 1)
    links:
      - {between: [gpu0, gpu1], bandwidth: 300GB/s, latency: 2us}
    store: {bandwidth: 12GB/s, latency: 30us}      # the offload store, per worker
                                   # (in_flight: 256MiB -> each worker's stash bytes
                                   # handed to its copy lane and not yet written, at most,
                                   # the workers' --stash-in-flight-bytes; 0: stashes are
                                   # written on the compute lane; default 256MiB)
    local_tier: {bandwidth: 5GB/s, latency: 50us}  # optional: the workers' node-local
                                   # shared-memory tier (--local-tier-dir); a put or take
                                   # of a private rank's stash there ([Note: tier copies]
                                   # in pipefb.sim.costmodel)
                                   # (cap: 1GiB -> the bytes it holds at most, all ranks
                                   # of a host, the workers' --local-tier-bytes; a
                                   # private rank's stash past it goes through the store,
                                   # [Note: tier cap] in pipefb.sim.tierslots; default:
                                   # no cap, every stash fits)
    shared_tier: {bandwidth: 8GB/s, latency: 1ms}  # optional: a put or take of a stash
                                   # there by the worker's I/O thread and prefetch (its
                                   # segments plus index keys in the store), for a rank on
                                   # a loopback host whose stash partners share that host
                                   # ([Note: shared tier] in pipefb.sim.costmodel); unset:
                                   # such stashes are priced by `store`
    device: cpu                    # what the workers compute on (cpu or cuda; default cpu)
    overheads: {action: 20us, step: 1ms}           # per executed action; per step and worker
                                   # (step_cpu: 0.5ms -> on a loopback host each worker's
                                   # step also keeps a core busy that long: its Step call,
                                   # the coordinator's end and the worker's; default 0)
                                   # (busy_send: 0.5ms -> on a loopback host a transfer
                                   # whose sender computes right after sending it starts
                                   # that much later, at most when that compute ends;
                                   # default 0)

`speed` is relative to the device the profile was measured on (2.0: twice as fast);
`memory` caps the bytes the runtime accounts to the worker (parameters, gradients,
optimizer state, weight versions, activations, stashed tensors).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipefb.errors import ConfigError
from pipefb.job.config import DEVICES

_UNITS = {"": 1.0, "b": 1.0, "k": 1e3, "kb": 1e3, "kib": 2.0**10, "m": 1e6, "mb": 1e6,
          "mib": 2.0**20, "g": 1e9, "gb": 1e9, "gib": 2.0**30, "t": 1e12, "tb": 1e12,
          "tib": 2.0**40}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
MIN_OVERSUBSCRIBED = 0.5  # a host's `oversubscribed` speed may not say it loses more
STASH_IN_FLIGHT_BYTES = 256 << 20  # = offload_store.writer.STASH_IN_FLIGHT_BYTES
MAX_TRANSFER_CPU = 8.0  # cores one transfer may keep busy (a sanity bound on `Link.cpu`)
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)(/s)?\s*$")


def parse_quantity(value: Any, what: str, kind: str) -> float:
    """Reads `12GB/s`, `80GiB`, `5us` or a plain number (bytes, bytes/s, seconds).

    Args:
        value: a number or a string with a unit.
        what: the field, for the error message.
        kind: "bytes", "rate" (bytes per second) or "seconds".

    Raises:
        ConfigError: not a non-negative number with a unit of that kind.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} = {value!r} is not a number")
    if isinstance(value, int | float):
        number = float(value)
    else:
        match = _QUANTITY.match(str(value))
        if match is None:
            raise ConfigError(f"{what} = {value!r} is not a number with a unit")
        digits, unit, per_second = match.groups()
        unit = unit.lower()
        table = _TIMES if kind == "seconds" else _UNITS
        if unit not in table or bool(per_second) != (kind == "rate"):
            example = {"bytes": "80GiB", "rate": "12GB/s", "seconds": "5us"}[kind]
            raise ConfigError(f"{what} = {value!r} has the wrong unit (e.g. {example})")
        number = float(digits) * table[unit]
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{what} = {value!r} must be finite and >= 0")
    return number


@dataclass(frozen=True)
class Link:
    """A one-way channel: `seconds(n)` is the latency plus n bytes at the bandwidth."""

    bandwidth: float  # bytes per second, > 0
    latency: float = 0.0  # seconds
    #: cores a transfer keeps busy for its `seconds` on a loopback host, both ends together
    #: (sender and receiver, or worker and Redis; [Note: shared hosts] in pipefb.sim.hosts)
    cpu: float = 1.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ConfigError(f"link bandwidth {self.bandwidth!r} must be > 0 bytes/s")
        if not 1.0 <= self.cpu <= MAX_TRANSFER_CPU:
            raise ConfigError(f"link cpu {self.cpu!r} must be a number of cores in "
                              f"1..{MAX_TRANSFER_CPU:g}")

    def seconds(self, nbytes: float) -> float:
        """Time to move `nbytes` bytes, first byte sent to last byte received."""
        return self.latency + nbytes / self.bandwidth

    @staticmethod
    def parse(data: Any, what: str) -> Link:
        """A link from `{bandwidth, latency, cpu}`; ConfigError names the bad field."""
        fields_ = _mapping(data, what, {"bandwidth", "latency", "cpu", "between"})
        if "bandwidth" not in fields_:
            raise ConfigError(f"{what} needs a bandwidth (e.g. 12GB/s)")
        cpu = fields_.get("cpu", 1.0)
        if isinstance(cpu, bool) or not isinstance(cpu, int | float):
            raise ConfigError(f"{what}.cpu = {cpu!r} is not a number")
        bandwidth = parse_quantity(fields_["bandwidth"], f"{what}.bandwidth", "rate")
        latency = parse_quantity(fields_.get("latency", 0), f"{what}.latency", "seconds")
        try:
            return Link(bandwidth, latency, float(cpu))
        except ConfigError as error:
            raise ConfigError(f"{what}: {error}") from None


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of the cluster."""

    name: str
    speed: float = 1.0  # compute speed relative to the profiled device
    memory: float = math.inf  # bytes the worker may hold; inf: no cap
    host: str = ""  # workers of one host share its cores; "": a host of its own

    def __post_init__(self) -> None:
        if not self.speed > 0 or not math.isfinite(self.speed):
            raise ConfigError(f"worker {self.name!r}: speed {self.speed!r} must be > 0")
        if not self.memory > 0:
            raise ConfigError(f"worker {self.name!r}: memory {self.memory!r} must be > 0")


@dataclass(frozen=True)
class Cluster:
    """Workers, the links between them, the offload store and runtime overheads."""

    workers: tuple[WorkerSpec, ...]
    network: Link = Link(bandwidth=1e9, latency=1e-4)
    store: Link = Link(bandwidth=1e9, latency=1e-4)
    links: Mapping[frozenset[str], Link] = field(default_factory=dict)
    host_cores: Mapping[str, int] = field(default_factory=dict)
    #: hosts whose workers talk over loopback (gRPC, a local store): moving bytes between
    #: them is CPU work that shares the host's cores with computes (one machine, no NICs)
    loopback_hosts: frozenset[str] = frozenset()
    #: per host, the cores' speed with twice as many busy threads as cores, relative to
    #: one per core (context switches and refilled caches); 1.0 where not given
    host_oversubscribed: Mapping[str, float] = field(default_factory=dict)
    action_overhead: float = 0.0  # seconds the runtime spends per action, beyond its work
    step_overhead: float = 0.0  # seconds per step and worker (the step call's round trip)
    #: CPU seconds per step and worker outside its actions: its Step call, the
    #: coordinator's end and the worker's; a job on a loopback host's cores
    step_cpu: float = 0.0
    #: on a loopback host, how much later a transfer starts when its sender computes right
    #: after the send, at most until that compute ends ([Note: busy senders] in
    #: pipefb.sim.engine)
    busy_send: float = 0.0
    #: the most stash bytes a worker hands to its copy lane and has not yet written; 0:
    #: stashes are written on the compute lane ([Note: copy lane] in pipefb.sim.copylane)
    stash_in_flight_bytes: int = STASH_IN_FLIGHT_BYTES
    #: what the workers compute on (`JobConfig.device`); a job's cluster takes its job's
    #: (`pipefb.planner.job.job_cluster`)
    device: str = "cpu"
    #: the workers' node-local shared-memory tier (worker --local-tier-dir), None: none;
    #: a put or a take of a private rank's stash there costs its `seconds` ([Note: tier
    #: copies] in pipefb.sim.costmodel)
    local_tier: Link | None = None
    #: bytes the node-local tier of a host holds at most, all its ranks (worker
    #: --local-tier-bytes); inf: no cap, every stash fits ([Note: tier cap] in
    #: pipefb.sim.tierslots)
    local_tier_bytes: float = math.inf
    #: a put or a take of a stash in the node-local tier through the worker's I/O thread
    #: and prefetch, for a rank that shares it with its stash partners on a loopback host;
    #: None: `store` ([Note: shared tier] in pipefb.sim.costmodel)
    shared_tier: Link | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"cluster device {self.device!r} is not one of {DEVICES}")
        if not self.workers:
            raise ConfigError("a cluster needs at least one worker")
        names = [w.name for w in self.workers]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ConfigError(f"worker name {duplicate!r} appears twice")
        for pair in self.links:
            unknown = sorted(set(pair) - set(names))
            if unknown or len(pair) != 2:
                raise ConfigError(f"link between {sorted(pair)} names unknown worker(s) "
                                  f"{unknown}" if unknown else f"link {sorted(pair)} "
                                  "must join two different workers")
        for host, cores in self.host_cores.items():
            if cores < 1:
                raise ConfigError(f"host {host!r}: cores {cores!r} must be >= 1")
        unknown = sorted(self.loopback_hosts - set(self.host_cores))
        if unknown:
            raise ConfigError(f"loopback host(s) {unknown} need an entry with cores in `hosts`")
        for host, speed in self.host_oversubscribed.items():
            if host not in self.host_cores:
                raise ConfigError(f"host {host!r} has an oversubscribed speed but no entry "
                                  "with cores in `hosts`")
            if not MIN_OVERSUBSCRIBED <= speed <= 1.0:
                raise ConfigError(f"host {host!r}: oversubscribed {speed!r} must be in "
                                  f"{MIN_OVERSUBSCRIBED}..1")
        if self.stash_in_flight_bytes < 0:
            raise ConfigError(f"store in_flight {self.stash_in_flight_bytes!r} must be >= 0 "
                              "bytes")
        if not self.local_tier_bytes >= 0:
            raise ConfigError(f"local tier cap {self.local_tier_bytes!r} must be >= 0 bytes")

    @property
    def size(self) -> int:
        """Number of workers."""
        return len(self.workers)

    def link(self, a: int, b: int) -> Link:
        """The link from worker index `a` to worker index `b`."""
        pair = frozenset((self.workers[a].name, self.workers[b].name))
        return self.links.get(pair, self.network)

    def oversubscribed_of(self, host: str) -> float:
        """The host's `oversubscribed` speed (1.0: none lost, or not a described host)."""
        return self.host_oversubscribed.get(host, 1.0)

    def cores_of(self, worker: int) -> tuple[str, int]:
        """(host key, cores) the worker's compute shares; a host of its own by default."""
        spec = self.workers[worker]
        if spec.host and spec.host in self.host_cores:
            return spec.host, self.host_cores[spec.host]
        return f"worker:{spec.name}", 1

    def on_loopback(self, a: int, b: int) -> bool:
        """Whether workers `a` and `b` share a loopback host (see `loopback_hosts`)."""
        host = self.workers[a].host
        return bool(host) and host == self.workers[b].host and host in self.loopback_hosts

    def with_memory(self, memory: float) -> Cluster:
        """The same cluster with every worker's memory cap set to `memory` bytes."""
        workers = tuple(WorkerSpec(w.name, w.speed, memory, w.host) for w in self.workers)
        return replace(self, workers=workers)

    @staticmethod
    def uniform(n: int, *, speed: float = 1.0, memory: float = math.inf,
                network: Link | None = None, store: Link | None = None) -> Cluster:
        """`n` identical workers w0..w{n-1}, each on a host of its own."""
        if n < 1:
            raise ConfigError(f"a cluster needs at least one worker, got {n}")
        return Cluster(tuple(WorkerSpec(f"w{i}", speed, memory) for i in range(n)),
                       network or Link(1e9, 1e-4), store or Link(1e9, 1e-4))

    @staticmethod
    def from_dict(data: Any, source: str = "cluster") -> Cluster:
        """Reads the YAML form (see the module docstring); ConfigError names the bad field."""
        top = _mapping(data, source, {"workers", "hosts", "network", "links", "store",
                                      "overheads", "device", "local_tier", "shared_tier"})
        if "workers" not in top:
            raise ConfigError(f"{source} needs `workers`")
        workers = _workers(top["workers"], f"{source}.workers")
        hosts, loopback, oversubscribed = _hosts(top.get("hosts") or [], f"{source}.hosts")
        links = {}
        for i, item in enumerate(top.get("links") or []):
            what = f"{source}.links[{i}]"
            between = _mapping(item, what, {"between", "bandwidth", "latency", "cpu"}
                               ).get("between")
            if not isinstance(between, list) or len(between) != 2:
                raise ConfigError(f"{what}.between must list two worker names")
            links[frozenset(str(n) for n in between)] = Link.parse(item, what)
        over = _mapping(top.get("overheads") or {}, f"{source}.overheads",
                        {"action", "step", "step_cpu", "busy_send"})
        kwargs: dict[str, Any] = {}
        if "network" in top:
            kwargs["network"] = Link.parse(top["network"], f"{source}.network")
        if "store" in top:
            kwargs["store"], in_flight = _link_and(top["store"], f"{source}.store",
                                                   "in_flight")
            if in_flight is not None:
                kwargs["stash_in_flight_bytes"] = int(in_flight)
        if "local_tier" in top:
            kwargs["local_tier"], cap = _link_and(top["local_tier"], f"{source}.local_tier",
                                                  "cap")
            if cap is not None:
                kwargs["local_tier_bytes"] = cap
        if "shared_tier" in top:
            kwargs["shared_tier"] = Link.parse(top["shared_tier"], f"{source}.shared_tier")
        if "device" in top:
            kwargs["device"] = str(top["device"])
        return Cluster(
            workers, links=links, host_cores=hosts, loopback_hosts=frozenset(loopback),
            host_oversubscribed=oversubscribed,
            action_overhead=parse_quantity(over.get("action", 0), f"{source}.overheads.action",
                                           "seconds"),
            step_overhead=parse_quantity(over.get("step", 0), f"{source}.overheads.step",
                                         "seconds"),
            step_cpu=parse_quantity(over.get("step_cpu", 0), f"{source}.overheads.step_cpu",
                                    "seconds"),
            busy_send=parse_quantity(over.get("busy_send", 0),
                                     f"{source}.overheads.busy_send", "seconds"),
            **kwargs)

    @staticmethod
    def load(path: Path) -> Cluster:
        """Reads a cluster YAML file.

        Raises:
            ConfigError: unreadable file, bad YAML or a bad field (named).
        """
        import yaml

        try:
            text = path.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read cluster file {str(path)!r}: {error.strerror}"
                              ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"cluster file {str(path)!r} is not valid YAML: "
                              f"{str(error).splitlines()[0]}") from None
        return Cluster.from_dict(data, f"cluster file {str(path)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The YAML form with plain numbers (bytes, bytes/s, seconds); `from_dict` reads it."""
        def link(x: Link) -> dict[str, float]:
            return {"bandwidth": x.bandwidth, "latency": x.latency,
                    **({"cpu": x.cpu} if x.cpu != 1.0 else {})}

        out: dict[str, Any] = {
            "workers": [{"name": w.name, "speed": w.speed, "host": w.host,
                         **({"memory": w.memory} if math.isfinite(w.memory) else {})}
                        for w in self.workers],
            "network": link(self.network),
            "store": {**link(self.store),
                      **({"in_flight": self.stash_in_flight_bytes}
                         if self.stash_in_flight_bytes != STASH_IN_FLIGHT_BYTES else {})},
            "overheads": {"action": self.action_overhead, "step": self.step_overhead,
                          **({"step_cpu": self.step_cpu} if self.step_cpu else {}),
                          **({"busy_send": self.busy_send} if self.busy_send else {})},
        }
        if self.local_tier is not None:
            out["local_tier"] = {**link(self.local_tier),
                                 **({"cap": self.local_tier_bytes}
                                    if math.isfinite(self.local_tier_bytes) else {})}
        if self.shared_tier is not None:
            out["shared_tier"] = link(self.shared_tier)
        if self.device != "cpu":
            out["device"] = self.device
        if self.host_cores:
            out["hosts"] = [{"name": h, "cores": c,
                             **({"loopback": True} if h in self.loopback_hosts else {}),
                             **({"oversubscribed": self.host_oversubscribed[h]}
                                if h in self.host_oversubscribed else {})}
                            for h, c in self.host_cores.items()]
        if self.links:
            out["links"] = [{"between": sorted(p), **link(x)} for p, x in self.links.items()]
        return out


def _mapping(data: Any, what: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{what} has unknown key {unknown[0]!r}; known: {sorted(known)}")
    return data


def _link_and(data: Any, what: str, extra: str) -> tuple[Link, float | None]:
    """A link's mapping with one more field of bytes beside the link's own (the store's
    `in_flight`, the local tier's `cap`): the link, and that field (None: not given)."""
    fields_ = dict(_mapping(data, what, {"bandwidth", "latency", "cpu", extra}))
    value = (parse_quantity(fields_.pop(extra), f"{what}.{extra}", "bytes")
             if extra in fields_ else None)
    return Link.parse(fields_, what), value


def _worker(item: Any, what: str, name: str) -> WorkerSpec:
    spec = _mapping(item, what, {"name", "speed", "memory", "host", "count"})
    speed = spec.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float):
        raise ConfigError(f"{what}.speed = {speed!r} is not a number")
    memory = (parse_quantity(spec["memory"], f"{what}.memory", "bytes")
              if "memory" in spec else math.inf)
    return WorkerSpec(str(spec.get("name", name)), float(speed), memory,
                      str(spec.get("host", "")))


def _workers(data: Any, what: str) -> tuple[WorkerSpec, ...]:
    if isinstance(data, dict):  # {count: N, ...}: N identical workers w0..w{N-1}
        count = data.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{what}.count = {count!r} must be an integer >= 1")
        template = {k: v for k, v in data.items() if k not in ("count", "name")}
        return tuple(_worker(template, what, f"w{i}") for i in range(count))
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{what} must be a non-empty list or {{count: N, ...}}")
    return tuple(_worker(item, f"{what}[{i}]", f"w{i}") for i, item in enumerate(data))


def group_view(cluster: Cluster, groups: int) -> Cluster:
    """What one of `groups` equal pipeline groups runs on: the first size/groups workers,
    the links between them, and of each host's cores the share its workers in this group
    hold (one host of 8 GPUs split between 2 groups gives each 4; a group owning whole
    hosts keeps all their cores)."""
    if groups == 1:
        return cluster
    width = cluster.size // groups
    mine = cluster.workers[:width]
    names = {w.name for w in mine}
    on_host = Counter(w.host for w in cluster.workers)
    cores = {host: max(1, n * sum(w.host == host for w in mine) // on_host[host])
             for host, n in cluster.host_cores.items() if any(w.host == host for w in mine)}
    links = {pair: x for pair, x in cluster.links.items() if pair <= names}
    return replace(cluster, workers=mine, host_cores=cores, links=links,
                   loopback_hosts=cluster.loopback_hosts & set(cores))


def slowest_hop(cluster: Cluster, hops: Iterable[tuple[int, int]]) -> Link:
    """The lowest bandwidth and highest latency over the links of `hops` (rank pairs): the
    pace of traffic that crosses all of them; no hops: an infinitely fast link."""
    links = [cluster.link(a, b) for a, b in hops]
    if not links:
        return Link(math.inf)
    return Link(min(x.bandwidth for x in links), max(x.latency for x in links),
                max(x.cpu for x in links))


def ring_link(cluster: Cluster, rank: int, groups: int) -> Link:
    """The slowest hop of the all-reduce ring through `rank` and the same stage's rank in
    every other group (ranks rank, rank + width, ...): a ring moves at its slowest hop's
    pace, so a ring that leaves a host pays the network even if some hops stay inside."""
    width = cluster.size // groups
    ring = [rank % width + g * width for g in range(groups)]
    return slowest_hop(cluster, zip(ring, ring[1:] + ring[:1], strict=True))


def _hosts(items: Any, source: str) -> tuple[dict[str, int], set[str], dict[str, float]]:
    """The `hosts` list: cores by host, the loopback hosts, and `oversubscribed` speeds."""
    if not isinstance(items, list):
        raise ConfigError(f"{source} must be a list of hosts")
    cores_of, loopback, oversubscribed = {}, set(), {}
    for i, item in enumerate(items):
        what = f"{source}[{i}]"
        host = _mapping(item, what, {"name", "cores", "loopback", "oversubscribed"})
        cores, name = host.get("cores", 1), str(host.get("name", ""))
        if isinstance(cores, bool) or not isinstance(cores, int):
            raise ConfigError(f"{what}.cores = {cores!r} is not an integer")
        if not isinstance(host.get("loopback", False), bool):
            raise ConfigError(f"{what}.loopback = {host['loopback']!r} is not true or false")
        cores_of[name] = cores
        if host.get("loopback", False):
            loopback.add(name)
        if "oversubscribed" in host:
            speed = host["oversubscribed"]
            if isinstance(speed, bool) or not isinstance(speed, int | float):
                raise ConfigError(f"{what}.oversubscribed = {speed!r} is not a number")
            oversubscribed[name] = float(speed)
    return cores_of, loopback, oversubscribed
