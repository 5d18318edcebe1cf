"""The node-local shared-memory tier: a `StashStore` in front of the Redis one that hands
micro-batch stashes between the worker processes of one host through tmpfs segments.

[Note: local tier index] A producer writes a micro-batch's stash as one segment
(`offload_store.segments`, one copy) and, in the same round trip as the Redis backend's
write would take, sets the stash's index key (`keys.segment_key`) to the segment's tier
id, path and size, with the store's TTL. The consumer's take is one pipeline: GETDEL of
the index key and of the stash's ordinary value keys. An index entry means the segment:
it is checked, mapped (zero copies: the tensors are views of a private mapping) and
unlinked (delete on consume); no entry means the stash went to Redis, and the values
come back as from the Redis backend. So a stash over the tier's cap (`write` refuses
it) spills to Redis exactly as without the tier, and nothing is ever evicted: a segment
leaves the tier only when its stash is taken, released, or its job cleared.

[Note: tier ranks] A segment is only readable on its own host, so a job attempt uses the
tier only when all of its ranks share one: each rank's store adds ``{tier id}/{token}``
to the attempt's set (`keys.tier_ranks_key`) when it opens, and a producer writes
segments once the set names as many ranks as the job has, all with its own tier id
(until then, and for a job spread over hosts, every stash goes to Redis). The tier id is
the base directory's own (`segments.node_id`), so processes that share the directory
share the tier.

[Note: tier leases] A segment lives as long as its index key or its job: the store of a
job's next attempt removes the job's segments of earlier attempts on its host when it
opens (a crashed rank's leftovers), and clearing a job (`StashStore.clear_job`, and the
Redis admin's `clear_job`, which the coordinator calls at a job's end and in recovery,
where ``PIPEFB_LOCAL_TIER_DIR`` names the tier) removes its directories.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path

import torch

from offload_store import segments
from offload_store.api import LayerTensors, StashStore, StoreStats
from offload_store.keys import segment_key, tier_ranks_key
from offload_store.segments import SegmentError
from offload_store.store import OffloadStore, execute_once

DIR_ENV = "PIPEFB_LOCAL_TIER_DIR"  # the tier's base directory (a tmpfs); empty: no tier
BYTES_ENV = "PIPEFB_LOCAL_TIER_BYTES"  # the tier's cap; unset or -1: `default_cap`
CAP_SHARE = 0.5  # the default cap: this share of the base directory's file system
TIER_OPTIONS = ("local_tier_dir", "local_tier_bytes", "local_tier_ranks")  # open_store's


def default_cap(base: Path) -> int:
    """`CAP_SHARE` of the size of the file system that holds `base`."""
    info = os.statvfs(base)
    return int(info.f_blocks * info.f_frsize * CAP_SHARE)


class SharedTierStore:
    """One job attempt's stash in the node-local tier with Redis behind it; a
    `StashStore` ([Note: local tier index]). Safe to share between threads."""

    def __init__(self, inner: OffloadStore, base: Path, cap_bytes: int = -1,
                 ranks: int = 1) -> None:
        """Opens the tier at `base` for `inner`'s job attempt and adds this rank to the
        attempt's tier ranks ([Note: tier ranks]).

        Args:
            inner: the Redis stash of the same job attempt (index and spill).
            base: the tier's directory, created 0700 if missing.
            cap_bytes: bytes of segments the tier holds at most, all jobs; -1: `default_cap`.
            ranks: how many ranks the job attempt has.

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
        self._dir: Path | None = None
        self._shared = False  # every rank of the attempt uses this tier (cached once true)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        segments.clear_job(self.base, self.job, below_attempt=self.attempt)  # [Note: tier leases]
        pipe = inner.client.pipeline(transaction=False)
        pipe.sadd(tier_ranks_key(self.job, self.attempt), f"{self.node}/{secrets.token_hex(8)}")
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
        """Writes the stash as a segment and its index entry; to Redis when the job's
        ranks are not all on this tier or the segment would pass the cap."""
        if not any(tensors.values()) or not self._all_ranks_here():
            return self.inner.put(step, microbatch, version, tensors)
        path = self._job_dir() / segments.segment_name(self.attempt, step, microbatch, version)
        try:
            size = segments.write(path, tensors, self.cap_bytes)
        except FileNotFoundError:  # the job's directory was cleared: use a new one
            self._dir = None
            return self.inner.put(step, microbatch, version, tensors)
        if size is None:  # over the cap: spill ([Note: local tier index])
            return self.inner.put(step, microbatch, version, tensors)
        entry = json.dumps({"node": self.node, "path": str(path), "size": size})
        try:
            self.inner.client.set(segment_key(self.job, self.attempt, step, microbatch,
                                              version), entry, ex=self.inner.ttl_seconds)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self._count(bytes_put=size, keys_put=1)
        return size

    def take(self, step: int, microbatch: int, version: int,
             names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes the stash from its segment, or from Redis where it spilled: one round
        trip either way; see `StashStore.take`.

        Raises:
            SegmentError: the segment fails its checks (see `offload_store.segments`).
        """
        wanted = [(layer, name) for layer, layer_names in names.items() for name in layer_names]
        if not wanted:
            return {}
        keys = [self.inner.key(step, microbatch, layer, version, name) for layer, name in wanted]
        pipe = self.inner.client.pipeline(transaction=False)
        pipe.getdel(segment_key(self.job, self.attempt, step, microbatch, version))
        for key in keys:
            pipe.getdel(key)
        entry, *values = execute_once(pipe)
        if isinstance(entry, Exception):
            raise entry
        if entry is None:
            return self.inner.decode_taken(wanted, keys, values)
        path, size = self._segment(entry)
        self._count(bytes_taken=size, keys_taken=1)
        return segments.read(path, size, names)

    def prefetch(self, step: int, microbatch: int, version: int,
                 names: Mapping[int, Sequence[str]]) -> None:
        """Does nothing: a take maps the segment without copying it."""

    def release(self, step: int, microbatch: int, version: int,
                names: Mapping[int, Sequence[str]]) -> int:
        """Frees the stash's segment or its Redis keys, whichever it has."""
        pipe = self.inner.client.pipeline(transaction=False)
        pipe.getdel(segment_key(self.job, self.attempt, step, microbatch, version))
        keys = [self.inner.key(step, microbatch, layer, version, name)
                for layer, layer_names in names.items() for name in layer_names]
        if keys:
            pipe.unlink(*keys)
        entry, *deleted = pipe.execute()
        freed = int(deleted[0]) if deleted else 0
        if entry is not None:
            path, size = self._segment(entry)
            path.unlink(missing_ok=True)
            self._count(bytes_taken=size, keys_taken=1)
            freed += sum(map(len, names.values()))
        return freed

    def clear_job(self) -> int:
        """Deletes the job's Redis keys and its segments on this host, any attempt."""
        return self.inner.clear_job() + segments.clear_job(self.base, self.job)

    def close(self) -> None:
        """Closes the Redis client (segments stay for their consumers)."""
        self.inner.close()

    def _all_ranks_here(self) -> bool:
        """Whether every rank of the attempt uses this tier ([Note: tier ranks])."""
        if not self._shared:
            members = self.inner.client.smembers(tier_ranks_key(self.job, self.attempt))
            nodes = {bytes(m).decode().partition("/")[0] for m in members}
            self._shared = len(members) >= self.ranks and nodes == {self.node}
        return self._shared

    def _job_dir(self) -> Path:
        with self._lock:
            if self._dir is None or not self._dir.is_dir():
                self._dir = segments.job_dir(self.base, self.job)
            return self._dir

    def _segment(self, entry: bytes) -> tuple[Path, int]:
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
                    local_tier_ranks: int = 1) -> StashStore:
    """`store` behind the local tier at `local_tier_dir` (empty: `store` itself).

    Raises:
        ValueError: a tier in front of a store other than Redis, or a bad cap or rank count.
        PermissionError: a base directory that is another user's or open to others.
    """
    if not local_tier_dir:
        return store
    if not isinstance(store, OffloadStore):
        raise ValueError(f"the local tier needs the Redis backend, not {type(store).__name__}")
    return SharedTierStore(store, Path(local_tier_dir), local_tier_bytes, local_tier_ranks)


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

