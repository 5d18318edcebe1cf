"""The node-local shared-memory tier: a `StashStore` in front of the Redis one that hands
micro-batch stashes between the worker processes of one host through tmpfs segments.

[Note: local tier index] A producer writes each layer of a micro-batch's stash as one
segment (`offload_store.segments`, one copy: a layer is the unit a consumer takes, and
a PipeFB forward rank's layers may go to several backward ranks) and then, in one
round trip as the Redis backend's write would take, sets each layer's index key
(`keys.segment_key`) to its segment's tier id, path and size, with the store's TTL. The
consumer's take is one pipeline of GETDEL of the layers' index keys, and a second one of
the ordinary value keys of the layers that have no index entry (spilled ones). An index
entry means the segment: it is checked and its tensors
view a private mapping of it (no copy; with ``zero_copy=False`` they are read into new
tensors, one copy), and its file becomes a spare for the producer's next write once
they are gone (delete on consume; [Note: spare segments], [Note: segment mappings]); no
entry means the layer went to Redis, and its
values come back as from the Redis backend. So a layer over the tier's cap (`write`
refuses it) spills to Redis exactly as without the tier, and nothing is ever evicted: a
segment leaves the tier only when it is taken, released, or its job cleared.

[Note: private index] A combined rank whose layers are the same forward and backward
(GPipe, 1F1B, PipeDream) takes back every stash it puts, whole, so nobody else looks its
segments up: its store (``private``) writes a micro-batch's whole stash as one segment
and keeps the index in a dict of its own instead of Redis, so a put and a take cost one
file each and no round trip to Redis. The segments are the same files in the job's directory, so the
tier's cap, the node's memory accounting and the leases below hold as for any segment;
a layer past the cap still spills to Redis and comes back from there.

[Note: tier ranks] A segment is only readable on its own host, so a job attempt uses the
tier only when all of its ranks share one: each rank's store adds ``{tier id}/{token}``
to the attempt's set (`keys.tier_ranks_key`) when it opens, and a producer writes
segments once the set names as many ranks as the job has, all with its own tier id
(until then, and for a job spread over hosts, every stash goes to Redis). The tier id is
the base directory's own (`segments.node_id`), so processes that share the directory
share the tier. A rank's store takes itself out of the set when it closes (when its
worker drops the job), and the set goes with the last one; a crashed rank's entry goes
with its job's clear or the TTL.

[Note: tier leases] A segment lives as long as its index key or its job: the store of a
job's next attempt removes the job's segments of earlier attempts on its host when it
opens (a crashed rank's leftovers), and clearing a job (`StashStore.clear_job`, and the
Redis admin's `clear_job`, which the coordinator calls at a job's end and in recovery,
where ``PIPEFB_LOCAL_TIER_DIR`` names the tier) removes its directories.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path

import torch
from redis.exceptions import RedisError

from offload_store import segments
from offload_store.api import LayerTensors, StashStore, StoreStats
from offload_store.keys import segment_key, tier_ranks_key
from offload_store.mapped import SegmentMaps
from offload_store.segments import SegmentError
from offload_store.store import OffloadStore, execute_once
from pipefb.errors import ConfigError

DIR_ENV = "PIPEFB_LOCAL_TIER_DIR"  # the tier's base directory (a tmpfs); empty: no tier
BYTES_ENV = "PIPEFB_LOCAL_TIER_BYTES"  # the tier's cap; unset or -1: `default_cap`
CAP_SHARE = 0.5  # the default cap: this share of the base directory's file system
TIER_OPTIONS = ("local_tier_dir", "local_tier_bytes", "local_tier_ranks",  # open_store's
                "local_tier_private")


def default_cap(base: Path) -> int:
    """`CAP_SHARE` of the size of the file system that holds `base`."""
    info = os.statvfs(base)
    return int(info.f_blocks * info.f_frsize * CAP_SHARE)


def check_tier(directory: str, cap_bytes: int) -> None:
    """Checks a worker's tier settings at its start (empty `directory`: no tier).

    Raises:
        ConfigError: a cap below -1, or a directory that cannot be made, is another
            user's or is open to others; names the value.
    """
    if cap_bytes < -1:
        raise ConfigError(f"--local-tier-bytes {cap_bytes} must be >= -1 (-1: the default)")
    if directory:
        try:
            segments.private_base(Path(directory).absolute())
        except OSError as error:
            raise ConfigError(f"--local-tier-dir {directory!r}: {error}") from None


class SharedTierStore:
    """One job attempt's stash in the node-local tier with Redis behind it; a
    `StashStore` ([Note: local tier index]). Safe to share between threads."""

    def __init__(self, inner: OffloadStore, base: Path, cap_bytes: int = -1,
                 ranks: int = 1, zero_copy: bool = True, private: bool = False) -> None:
        """Opens the tier at `base` for `inner`'s job attempt and adds this rank to the
        attempt's tier ranks ([Note: tier ranks]).

        Args:
            inner: the Redis stash of the same job attempt (index and spill).
            base: the tier's directory, created 0700 if missing.
            cap_bytes: bytes of segments the tier holds at most, all jobs; -1: `default_cap`.
            ranks: how many ranks the job attempt has.
            zero_copy: takes hand out tensors viewing the segments (`segments.lend`);
                False: copies (`segments.read`).
            private: this store takes back every stash it puts itself ([Note: private
                index]); its index stays in this process.

        Raises:
            ValueError: a cap below -1 or fewer than one rank.
            PermissionError: `base` is another user's or open to others.
        """
        if cap_bytes < -1 or ranks < 1:
            raise ValueError(f"local tier cap {cap_bytes} must be >= -1 and ranks {ranks} >= 1")
        self.inner, self.job, self.attempt = inner, inner.job, inner.attempt
        self.base = segments.private_base(base.absolute())
        self.cap_bytes = default_cap(self.base) if cap_bytes == -1 else cap_bytes
        self.node, self.ranks = segments.node_id(self.base), ranks
        self._maps = SegmentMaps()  # the tier files this rank touched ([Note: segment mappings])
        self._read = (functools.partial(segments.lend, maps=self._maps) if zero_copy
                      else segments.read)
        self._dir: Path | None = None
        self._shared: bool | None = None  # every rank of the attempt uses this tier (None:
        # not known yet, some ranks have not opened their stores)
        self._private = private
        # a private store's index: (step, micro-batch, version) -> its segment's entry
        self._own: dict[tuple[int, int, int], str] = {}
        self._stats = StoreStats()
        self._lock = threading.Lock()
        segments.clear_job(self.base, self.job, below_attempt=self.attempt)  # [Note: tier leases]
        self._member = f"{self.node}/{secrets.token_hex(8)}"
        pipe = inner.client.pipeline(transaction=False)
        pipe.sadd(tier_ranks_key(self.job, self.attempt), self._member)
        pipe.expire(tier_ranks_key(self.job, self.attempt), inner.ttl_seconds)
        pipe.execute()

    @property
    def stats(self) -> StoreStats:
        """The tier's counters plus the Redis store's."""
        with self._lock:
            own = dataclasses.replace(self._stats)
        inner = self.inner.stats
        return StoreStats(*(a + b for a, b in zip(dataclasses.astuple(own),
                                                  dataclasses.astuple(inner), strict=True)))

    def put(self, step: int, microbatch: int, version: int,
            tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int:
        """Writes each layer's tensors as a segment and sets their index keys in one
        round trip; to Redis the layers past the cap, and the whole stash while the
        job's ranks are not all on this tier (a private store: its own, [Note: private
        index])."""
        if self._private:
            return self._put_private(step, microbatch, version, tensors)
        if not self._all_ranks_here():
            return self.inner.put(step, microbatch, version, tensors)
        entries: dict[str, str] = {}
        spilled: dict[int, Mapping[str, torch.Tensor]] = {}
        try:
            for layer, named in tensors.items():
                written = (self._write(step, microbatch, layer, version, {layer: named})
                           if named else None)
                if written is None:
                    spilled[layer] = named
                else:
                    entries[segment_key(self.job, self.attempt, step, microbatch, layer,
                                        version)] = written
            nbytes = self._set_index(entries)
        except BaseException:
            self._unlink(entries.values())
            raise
        if spilled:  # past the cap: to Redis ([Note: local tier index])
            try:
                nbytes += self.inner.put(step, microbatch, version, spilled)
            except BaseException:
                self.release(step, microbatch, version, {i: [] for i in tensors})
                raise
        return nbytes

    def take(self, step: int, microbatch: int, version: int,
             names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes each layer from its segment, or from Redis where it spilled, in one
        round trip; see `StashStore.take`.

        Raises:
            SegmentError: a segment that fails its checks (see `offload_store.segments`).
        """
        wanted = [(layer, name) for layer, layer_names in names.items() for name in layer_names]
        if not wanted:
            return {}
        if self._private:
            return self._take_private(step, microbatch, version, names)
        if self._shared is False:  # the attempt never uses the tier: all of it is in Redis
            return self.inner.take(step, microbatch, version, names)
        layers = [layer for layer in names if names[layer]]
        index = dict(zip(layers, self._take_index(step, microbatch, version, layers),
                         strict=True))
        out: LayerTensors = {}
        for layer, entry in index.items():  # every segment is read (and freed) first
            if isinstance(entry, Exception):
                raise entry
            if entry is not None:
                path, size = self._segment(entry)
                self._count(bytes_taken=size, keys_taken=1)
                out.update(self._read(path, size, {layer: names[layer]}))
        spilled = {layer: names[layer] for layer in layers if layer not in out}
        if spilled:  # no index entry: the layer went to Redis (a second round trip)
            out.update(self.inner.take(step, microbatch, version, spilled))
        return out

    def prefetch(self, step: int, microbatch: int, version: int,
                 names: Mapping[int, Sequence[str]]) -> None:
        """Does nothing: the transport's prefetch thread runs the take itself."""

    def release(self, step: int, microbatch: int, version: int,
                names: Mapping[int, Sequence[str]]) -> int:
        """Frees the stash's segments and its Redis keys (chunks too), whichever it has."""
        keys = [name for layer_names in names.values() for name in layer_names]
        freed = self.inner.release(step, microbatch, version, names)
        if self._private:  # one segment holds the whole stash ([Note: private index])
            with self._lock:
                entry = self._own.pop((step, microbatch, version), None)
            found = [] if entry is None else [(entry, len(keys))]
        else:
            entries = self._take_index(step, microbatch, version, list(names))
            found = [(e, len(names[layer])) for layer, e in zip(names, entries, strict=True)
                     if e is not None]
        for entry, tensors in found:
            if isinstance(entry, Exception):
                raise entry
            path, size = self._segment(entry)
            path.unlink(missing_ok=True)
            self._count(bytes_taken=size, keys_taken=1)
            freed += tensors
        return freed

    def clear_job(self) -> int:
        """Deletes the job's Redis keys and its segments on this host, any attempt."""
        with self._lock:
            self._own.clear()
        return self.inner.clear_job() + segments.clear_job(self.base, self.job)

    def node_bytes(self) -> int:
        """Bytes of this store's own files in the tier: its segments no rank took yet and
        its spares (`StashStore.node_bytes`)."""
        with self._lock:
            folder = self._dir
        return 0 if folder is None else segments.own_bytes(folder)

    def close(self) -> None:
        """Takes this rank out of the attempt's tier ranks (the last one out deletes the
        set), removes its spare files and closes the Redis client; segments stay for
        their consumers."""
        with suppress(RedisError):
            self.inner.client.srem(tier_ranks_key(self.job, self.attempt), self._member)
        with self._lock:
            if self._dir is not None:  # its spares go; segments not yet taken stay
                segments.drop_spares(self._dir)
        self._maps.close()
        self.inner.close()

    def _put_private(self, step: int, microbatch: int, version: int,
                     tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int:
        """A private store's put: the whole stash as one segment, indexed in this process,
        or to Redis past the cap ([Note: private index])."""
        stored = {layer: named for layer, named in tensors.items() if named}
        entry = self._write(step, microbatch, min(stored), version, stored) if stored else None
        if entry is None:
            return self.inner.put(step, microbatch, version, tensors)
        with self._lock:
            self._own[(step, microbatch, version)] = entry
        size = int(json.loads(entry)["size"])
        self._count(bytes_put=size, keys_put=1)
        return size

    def _take_private(self, step: int, microbatch: int, version: int,
                      names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """A private store's take: the stash's one segment, or Redis where it spilled."""
        with self._lock:
            entry = self._own.pop((step, microbatch, version), None)
        if entry is None:
            return self.inner.take(step, microbatch, version, names)
        path, size = self._segment(entry)
        self._count(bytes_taken=size, keys_taken=1)
        return self._read(path, size, {layer: names[layer] for layer in names if names[layer]})

    def _all_ranks_here(self) -> bool:
        """Whether every rank of the attempt uses this tier ([Note: tier ranks]); asked of
        Redis until the set names every rank, then known for the attempt."""
        if self._shared is None:
            members = self.inner.client.smembers(tier_ranks_key(self.job, self.attempt))
            nodes = {(m.decode() if isinstance(m, bytes) else str(m)).partition("/")[0]
                     for m in members}
            if len(members) >= self.ranks:
                self._shared = nodes == {self.node}
            elif nodes - {self.node}:  # a rank on another tier already: never shared
                self._shared = False
        return bool(self._shared)

    def _write(self, step: int, microbatch: int, layer: int, version: int,
               tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> str | None:
        """Writes one segment of `tensors` (named after `layer`); returns its index entry,
        or None past the cap."""
        name = segments.segment_name(self.attempt, step, microbatch, layer, version)
        path = self._job_dir() / name
        try:
            size = segments.write(path, tensors, self.cap_bytes, self._maps)
        except FileNotFoundError:  # the job's directory was cleared: use a new one
            with self._lock:
                self._dir = None
            return None
        if size is None:
            return None
        return json.dumps({"node": self.node, "path": str(path), "size": size})

    def _set_index(self, entries: Mapping[str, str]) -> int:
        """Sets the index keys in one pipeline; returns the segments' bytes."""
        if not entries:
            return 0
        pipe = self.inner.client.pipeline(transaction=False)
        for key, entry in entries.items():
            pipe.set(key, entry, ex=self.inner.ttl_seconds)
        pipe.execute()
        sizes = [json.loads(entry)["size"] for entry in entries.values()]
        self._count(bytes_put=sum(sizes), keys_put=len(sizes))
        return int(sum(sizes))

    def _take_index(self, step: int, microbatch: int, version: int, layers: Sequence[int]
                    ) -> list[str | bytes | Exception | None]:
        """Gets and deletes the layers' index entries (None: the layer has none), in one
        round trip."""
        keys = [segment_key(self.job, self.attempt, step, microbatch, layer, version)
                for layer in layers]
        pipe = self.inner.client.pipeline(transaction=False)
        for key in keys:
            pipe.getdel(key)
        return list(execute_once(pipe))

    @staticmethod
    def _unlink(entries: Iterable[str]) -> None:
        """Removes the segments of index entries this store wrote."""
        for entry in entries:
            Path(json.loads(entry)["path"]).unlink(missing_ok=True)

    def _job_dir(self) -> Path:
        with self._lock:
            if self._dir is None or not self._dir.is_dir():
                self._dir = segments.job_dir(self.base, self.job)
            return self._dir

    def _segment(self, entry: str | bytes) -> tuple[Path, int]:
        """The path and size an index entry names, checked ([Note: segment layout]).

        Raises:
            SegmentError: an entry that does not parse, names another tier, or a path
                that is not one of this job's segments here.
        """
        try:
            parsed = json.loads(entry)
            node, path, size = parsed["node"], parsed["path"], parsed["size"]
        except (ValueError, TypeError, KeyError) as error:
            raise SegmentError(f"index entry {entry[:100]!r} does not parse: {error}") from None
        if node != self.node:
            raise SegmentError(f"segment {path!r} is in tier {node!r}, not this host's "
                               f"{self.node!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise SegmentError(f"index entry names a size of {size!r}")
        return segments.check_path(self.base, self.job, str(path)), size

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for field, delta in deltas.items():
                setattr(self._stats, field, getattr(self._stats, field) + delta)


def with_local_tier(store: StashStore, local_tier_dir: str = "", local_tier_bytes: int = -1,
                    local_tier_ranks: int = 1, local_tier_private: bool = False) -> StashStore:
    """`store` behind the local tier at `local_tier_dir` (empty: `store` itself).

    Raises:
        ValueError: a tier in front of a store other than Redis, or a bad cap or rank count.
        PermissionError: a base directory that is another user's or open to others.
    """
    if not local_tier_dir:
        return store
    if not isinstance(store, OffloadStore):
        raise ValueError(f"the local tier needs the Redis backend, not {type(store).__name__}")
    return SharedTierStore(store, Path(local_tier_dir), local_tier_bytes, local_tier_ranks,
                           private=local_tier_private)


def tier_used_bytes() -> int:
    """Bytes of segments in the tier ``$PIPEFB_LOCAL_TIER_DIR`` names (0: none)."""
    base = os.environ.get(DIR_ENV)
    return segments.used_bytes(Path(base)) if base and Path(base).is_dir() else 0


def clear_tier_job(job: str) -> int:
    """Removes `job`'s segments in the tier ``$PIPEFB_LOCAL_TIER_DIR`` names (if any)."""
    base = os.environ.get(DIR_ENV)
    if not base or not Path(base).is_dir():
        return 0
    with suppress(OSError):
        return segments.clear_job(Path(base).absolute(), job)
    return 0

