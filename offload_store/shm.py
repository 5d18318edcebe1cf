"""The node-local shared-memory tier: a `StashStore` in front of the Redis one that hands
micro-batch stashes between the worker processes of one host through tmpfs segments.

[Note: local tier index] A producer writes the layers of a micro-batch's stash that one
named consumer takes as one segment (`offload_store.segments`, one copy; a PipeFB
forward rank's layers may go to several backward ranks, and each takes all of its own in
one FETCH), and each layer without a named consumer as a segment of its own (whoever
takes it takes it alone); then, in one round trip as the Redis backend's write would
take, it sets one index key per segment, its first layer's (`keys.segment_key`), to the
segment's tier id, path, size and layers, with the store's TTL. A take reads a segment
once for all its layers, and refuses one that asks for only some of them (the segment is
consumed whole). The consumer's take is one pipeline of GETDEL: of the index keys of the
layers whose producer may be on this host (one per producer whose layers it takes, the
first of them, where it knows the producers: the worker names them from the same plan as
the producer's consumers, `pipefb.plan.stashpath`; else one per layer, which finds the
segments all the same), and of the ordinary value keys of those whose producer is known
to be on another ([Note: tier ranks]); a second one takes the value keys of the layers
that no index entry named (spilled ones). An index entry means the segment: it is
checked and its tensors
view a private mapping of it (no copy; with ``zero_copy=False`` they are read into new
tensors, one copy), and its file becomes a spare for the producer's next write once
they are gone (delete on consume; [Note: spare segments], [Note: segment mappings]); no
entry means the layer went to Redis, and its
values come back as from the Redis backend. So a layer over the tier's cap (`write`
refuses it) spills to Redis exactly as without the tier, and nothing is ever evicted: a
segment leaves the tier only when it is taken, released, or its job cleared.

[Note: private index] A combined rank whose layers are the same forward and backward
(GPipe, 1F1B, PipeDream) takes back every stash it puts, whole, so nobody else looks its
segments up: its store (``private``) copies a micro-batch's whole stash into one of its
own slot files, kept mapped and reused, and keeps where each tensor lies in this process
instead of Redis ([Note: own slots] in `offload_store.ownslots`), so a put costs the
copies, a take the views, and neither a round trip to Redis nor a system call. The slots
are files in the job's directory, so the tier's cap, the node's memory accounting and the
leases below hold as for any segment, but no other writer removes them to make room: a
store keeps at most two free slots of a size. A stash past the cap spills to Redis and
comes back from there.

Which layers go to the tier: those whose consumer's store uses the same tier, [Note: tier
ranks] in `offload_store.tierranks` (the others, and every layer until the consumer's
store has opened, go to Redis).

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
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from offload_store import segments
from offload_store.api import LayerTensors, StashStore, StoreStats
from offload_store.keys import segment_key
from offload_store.mapped import SegmentMaps
from offload_store.ownslots import OwnSlots
from offload_store.segments import SegmentError
from offload_store.store import OffloadStore, execute_once
from offload_store.tierranks import TierRanks
from pipefb.errors import ConfigError

DIR_ENV = "PIPEFB_LOCAL_TIER_DIR"  # the tier's base directory (a tmpfs); empty: no tier
BYTES_ENV = "PIPEFB_LOCAL_TIER_BYTES"  # the tier's cap; unset or -1: `default_cap`
CAP_SHARE = 0.5  # the default cap: this share of the base directory's file system
TIER_OPTIONS = ("local_tier_dir", "local_tier_bytes", "local_tier_ranks",  # open_store's
                "local_tier_private", "local_tier_rank", "local_tier_consumers",
                "local_tier_producers")


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
                 ranks: int = 1, zero_copy: bool = True, private: bool = False,
                 rank: int | None = None, consumers: Mapping[int, int] | None = None,
                 producers: Mapping[int, int] | None = None) -> None:
        """Opens the tier at `base` for `inner`'s job attempt and adds this rank to the
        attempt's tier ranks ([Note: tier ranks] in `offload_store.tierranks`).

        Args:
            inner: the Redis stash of the same job attempt (index and spill).
            base: the tier's directory, created 0700 if missing.
            cap_bytes: bytes of segments the tier holds at most, all jobs; -1: `default_cap`.
            ranks: how many ranks the job attempt has.
            zero_copy: takes hand out tensors viewing the segments (`segments.lend`);
                False: copies (`segments.read`).
            private: this store takes back every stash it puts itself ([Note: private
                index]); its index stays in this process.
            rank: this rank's index in the job attempt; None: not known.
            consumers: layer -> the rank that takes this rank's stash of it; a layer not
                named goes to the tier only when every rank is on it.
            producers: layer -> the rank whose stash of it this rank takes; a take asks
                Redis straight for a layer whose producer is on another tier ([Note: tier
                ranks]), and looks up the index first for the others.

        Raises:
            ValueError: a cap below -1, fewer than one rank, or a rank or layer out of
                range; names it.
            PermissionError: `base` is another user's or open to others.
        """
        if cap_bytes < -1 or ranks < 1:
            raise ValueError(f"local tier cap {cap_bytes} must be >= -1 and ranks {ranks} >= 1")
        if rank is not None and not 0 <= rank < ranks:
            raise ValueError(f"local tier rank {rank} is not one of the job's ranks "
                             f"0..{ranks - 1}")
        self.consumers = _check_layer_ranks("consumer", consumers or {}, ranks)
        self.producers = _check_layer_ranks("producer", producers or {}, ranks)
        self.inner, self.job, self.attempt = inner, inner.job, inner.attempt
        self.base = segments.private_base(base.absolute())
        self.cap_bytes = default_cap(self.base) if cap_bytes == -1 else cap_bytes
        self.node, self.ranks = segments.node_id(self.base), ranks
        self._maps = SegmentMaps()  # the tier files this rank touched ([Note: segment mappings])
        self._read = (functools.partial(segments.lend, maps=self._maps) if zero_copy
                      else segments.read)
        self._dir: Path | None = None
        self._stats = StoreStats()
        self._lock = threading.Lock()
        segments.clear_job(self.base, self.job, below_attempt=self.attempt)  # [Note: tier leases]
        # a private store's stashes ([Note: private index])
        self._own = OwnSlots(self.base, self.attempt, self.cap_bytes, self._job_dir
                             ) if private else None
        self._spilled: set[tuple[int, int, int]] = set()  # a private store's stashes in Redis
        self.tier_ranks = TierRanks(inner.client, self.job, self.attempt, self.node, ranks,
                                    rank, inner.ttl_seconds)

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
        """Writes as a segment each layer whose consumer uses this tier ([Note: tier
        ranks]) and sets their index keys in one round trip; to Redis the other layers
        and those past the cap (a private store: its own, [Note: private index])."""
        if self._own is not None:
            return self._put_private(step, microbatch, version, tensors)
        here = self._layers_here(tensors)
        if not here:
            return self.inner.put(step, microbatch, version, tensors)
        entries: dict[str, str] = {}
        spilled = {layer: named for layer, named in tensors.items()
                   if not named or layer not in here}
        try:
            for group in self._segment_groups([layer for layer in tensors
                                               if layer not in spilled]):
                written = self._write(step, microbatch, group[0], version,
                                      {layer: tensors[layer] for layer in group})
                if written is None:
                    spilled.update({layer: tensors[layer] for layer in group})
                else:  # one key, the first layer's, indexes the segment
                    entries[segment_key(self.job, self.attempt, step, microbatch, min(group),
                                        version)] = written
            nbytes = self._set_index(entries)
        except BaseException:
            self._unlink(entries.values())
            raise
        if spilled:  # elsewhere or past the cap: to Redis ([Note: local tier index])
            try:
                nbytes += self.inner.put(step, microbatch, version, spilled)
            except BaseException:
                self.release(step, microbatch, version, {i: [] for i in tensors})
                raise
        return nbytes

    def take(self, step: int, microbatch: int, version: int,
             names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """Takes each layer from its segment, or from Redis where its producer is on
        another tier or it spilled, in one round trip (two when a layer whose producer
        may be here spilled); see `StashStore.take` and [Note: local tier index].

        Raises:
            SegmentError: a segment that fails its checks (see `offload_store.segments`).
            KeyError, CodecError: as `OffloadStore.take`, for a layer taken from Redis.
        """
        wanted = [(layer, name) for layer, layer_names in names.items() for name in layer_names]
        if not wanted:
            return {}
        if self._own is not None:
            return self._take_private(step, microbatch, version, names)
        layers = [layer for layer in names if names[layer]]
        elsewhere, unseen = self._produced_elsewhere(layers)
        indexed = [layer for layer in layers if layer not in elsewhere]
        looked_up = self._index_layers(indexed)
        direct = [(layer, name) for layer, name in wanted if layer in elsewhere]
        keys = [self.inner.key(step, microbatch, layer, version, name) for layer, name in direct]
        taken = [*self._index_keys(step, microbatch, version, looked_up), *keys]
        if unseen:  # a producer not in the tier ranks yet: read them in the same round trip
            pipe = self.inner.client.pipeline(transaction=False)
            self.tier_ranks.read_in(pipe)
            for key in taken:
                pipe.getdel(key)
            replies = execute_once(pipe)
            self.tier_ranks.record(replies.pop(0))
        else:  # values received in place, as the Redis backend's take receives them
            replies = self.inner.getdel(taken)
        out = self._read_indexed(zip(looked_up, replies[:len(looked_up)], strict=True), names)
        out.update(self.inner.decode_taken(direct, keys, replies[len(looked_up):]))
        spilled = {layer: names[layer] for layer in indexed if layer not in out}
        if spilled:  # no index entry: the layer went to Redis (a second round trip)
            out.update(self.inner.take(step, microbatch, version, spilled))
        return out

    def prefetch(self, step: int, microbatch: int, version: int,
                 names: Mapping[int, Sequence[str]]) -> None:
        """Does nothing: the transport's prefetch thread runs the take itself."""

    def release(self, step: int, microbatch: int, version: int,
                names: Mapping[int, Sequence[str]]) -> int:
        """Frees the stash's segments and its Redis keys (chunks too), whichever it has."""
        if self._own is not None:  # one slot holds the whole stash, or Redis does
            with self._lock:
                self._spilled.discard((step, microbatch, version))
            released = self._own.release((step, microbatch, version))
            if released is None:
                return self.inner.release(step, microbatch, version, names)
            size, tensors = released
            self._count(bytes_taken=size, keys_taken=1)
            return tensors
        freed = self.inner.release(step, microbatch, version, names)
        looked_up = self._index_layers(list(names))
        for layer, entry in zip(looked_up, self._take_index(step, microbatch, version,
                                                            looked_up), strict=True):
            if isinstance(entry, Exception):
                raise entry
            if entry is None:
                continue
            path, size, held = self._segment(entry, layer)
            path.unlink(missing_ok=True)
            self._count(bytes_taken=size, keys_taken=1)
            freed += sum(len(names.get(i, ())) for i in held)
        return freed

    def clear_job(self) -> int:
        """Deletes the job's Redis keys and its segments on this host, any attempt."""
        if self._own is not None:
            self._own.close()
        return self.inner.clear_job() + segments.clear_job(self.base, self.job)

    def node_bytes(self) -> int:
        """Bytes of this store's own files in the tier: its segments no rank took yet and
        its spares (`StashStore.node_bytes`); a private store's slots that no taken tensor
        views."""
        if self._own is not None:
            return self._own.held_bytes()
        with self._lock:
            folder = self._dir
        return 0 if folder is None else segments.own_bytes(folder)

    def close(self) -> None:
        """Takes this rank out of the attempt's tier ranks (the last one out deletes the
        set), removes its spare files (a private store: its slots, stashes not taken
        too, as no one else takes them) and closes the Redis client; segments stay for
        their consumers."""
        self.tier_ranks.leave()
        with self._lock:
            if self._dir is not None:  # its spares go; segments not yet taken stay
                segments.drop_spares(self._dir)
        if self._own is not None:
            self._own.close()
        self._maps.close()
        self.inner.close()

    def _put_private(self, step: int, microbatch: int, version: int,
                     tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int:
        """A private store's put: the whole stash into one of its slots, or to Redis past
        the cap ([Note: private index])."""
        assert self._own is not None
        stored = {layer: named for layer, named in tensors.items() if named}
        size = None
        if stored:
            try:
                size = self._own.put((step, microbatch, version), stored)
            except FileNotFoundError:  # the job's directory was cleared: use a new one
                with self._lock:
                    self._dir = None
        key = (step, microbatch, version)
        if size is None:
            with self._lock:
                self._spilled.add(key)
            return self.inner.put(step, microbatch, version, tensors)
        with self._lock:
            respilled = key in self._spilled
            self._spilled.discard(key)
        if respilled:  # put again (a step run again): the first one's values go
            self.inner.release(step, microbatch, version,
                               {layer: list(named) for layer, named in tensors.items()})
        self._count(bytes_put=size, keys_put=1)
        return size

    def _take_private(self, step: int, microbatch: int, version: int,
                      names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """A private store's take: the stash's slot, or Redis where it spilled."""
        assert self._own is not None
        with self._lock:
            self._spilled.discard((step, microbatch, version))
        got = self._own.take((step, microbatch, version),
                             {layer: names[layer] for layer in names if names[layer]})
        if got is None:
            return self.inner.take(step, microbatch, version, names)
        tensors, size = got
        self._count(bytes_taken=size, keys_taken=1)
        return tensors

    def _produced_elsewhere(self, layers: Sequence[int]) -> tuple[set[int], bool]:
        """The layers of `layers` whose producer's store is known to use another tier
        ([Note: tier ranks]), and whether a named producer has not entered the tier ranks
        yet (its layers go by the index)."""
        named = {layer: self.producers[layer] for layer in layers if layer in self.producers}
        if not named:
            return set(), False
        other, unseen = self.tier_ranks.on_other_tiers(set(named.values()))
        return {layer for layer, rank in named.items() if rank in other}, unseen

    def _read_indexed(self, index: Iterable[tuple[int, Any]],
                      names: Mapping[int, Sequence[str]]) -> LayerTensors:
        """The tensors of the segments that index replies (looked-up layer, GETDEL reply)
        name, each read and freed in turn; a layer of `names` that no entry names is not in
        the result.

        Raises:
            RedisError: a reply that is an error.
            SegmentError: a segment that fails its checks, or holds a layer the take did not
                ask for ([Note: local tier index]: a segment goes whole).
        """
        out: LayerTensors = {}
        entries = list(index)
        for k, (layer, entry) in enumerate(entries):
            try:
                if isinstance(entry, Exception):
                    raise entry
                if entry is None:
                    continue
                path, size, held = self._segment(entry, layer)
                if not all(names.get(i) for i in held):  # its index key is gone: so is the file
                    path.unlink(missing_ok=True)
                    raise SegmentError(f"segment {path} holds layers {held}; a take asked "
                                       f"for {sorted(i for i in held if names.get(i))} of them")
                self._count(bytes_taken=size, keys_taken=1)
                out.update(self._read(path, size, {i: names[i] for i in held}))
            except BaseException:
                self._drop(entries[k + 1:])
                raise
        return out

    def _drop(self, index: Iterable[tuple[int, Any]]) -> None:
        """Removes the files of segments whose index keys a failed take already took:
        nothing could find them any more, and they would hold room until the job's end."""
        for layer, entry in index:
            if entry is None or isinstance(entry, Exception):
                continue
            with suppress(SegmentError, OSError):
                self._segment(entry, layer)[0].unlink(missing_ok=True)

    def _index_layers(self, layers: Sequence[int]) -> list[int]:
        """The layers whose index keys a take of `layers` looks up ([Note: local tier
        index]): the first of each producer's, where this store knows the producer, and
        every other layer."""
        first: dict[int, int] = {}
        alone: list[int] = []
        for layer in layers:
            producer = self.producers.get(layer)
            if producer is None:
                alone.append(layer)
            else:
                first[producer] = min(first.get(producer, layer), layer)
        return [*first.values(), *alone]

    def _segment_groups(self, layers: Sequence[int]) -> list[list[int]]:
        """The layers of one micro-batch's stash that share a segment ([Note: local tier
        index]): those of one named consumer together, every other layer alone."""
        groups: dict[int, list[int]] = {}
        alone: list[list[int]] = []
        for layer in layers:
            if layer in self.consumers:
                groups.setdefault(self.consumers[layer], []).append(layer)
            else:
                alone.append([layer])
        return [*groups.values(), *alone]

    def _layers_here(self, tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> set[int]:
        """The layers of `tensors` whose consumer uses this tier ([Note: tier ranks]): a
        named consumer's own entry decides; a layer with none needs every rank here."""
        named = {layer: self.consumers[layer] for layer in tensors if layer in self.consumers}
        here = self.tier_ranks.on_this_tier(set(named.values())) if named else set()
        out = {layer for layer, rank in named.items() if rank in here}
        if len(named) < len(tensors) and self.tier_ranks.all_here():
            out.update(layer for layer in tensors if layer not in named)
        return out

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
        return json.dumps({"node": self.node, "path": str(path), "size": size,
                           "layers": sorted(tensors)})

    def _set_index(self, entries: Mapping[str, str]) -> int:
        """Sets the index keys in one pipeline; returns the segments' bytes."""
        if not entries:
            return 0
        pipe = self.inner.client.pipeline(transaction=False)
        for key, entry in entries.items():
            pipe.set(key, entry, ex=self.inner.ttl_seconds)
        pipe.execute()
        sizes = {parsed["path"]: parsed["size"]  # a segment of several layers counts once
                 for parsed in map(json.loads, entries.values())}
        self._count(bytes_put=sum(sizes.values()), keys_put=len(sizes))
        return int(sum(sizes.values()))

    def _take_index(self, step: int, microbatch: int, version: int, layers: Sequence[int]
                    ) -> list[str | bytes | Exception | None]:
        """Gets and deletes the layers' index entries (None: the layer has none), in one
        round trip."""
        pipe = self.inner.client.pipeline(transaction=False)
        for key in self._index_keys(step, microbatch, version, layers):
            pipe.getdel(key)
        return list(execute_once(pipe))

    def _index_keys(self, step: int, microbatch: int, version: int, layers: Iterable[int]
                    ) -> list[str]:
        """The index keys of `layers` of one micro-batch's stash."""
        return [segment_key(self.job, self.attempt, step, microbatch, layer, version)
                for layer in layers]

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

    def _segment(self, entry: str | bytes, layer: int) -> tuple[Path, int, list[int]]:
        """The path, size and layers (sorted) that the index entry of `layer`'s key names,
        checked ([Note: segment layout]; an entry that names no layers holds `layer`).

        Raises:
            SegmentError: an entry that does not parse, names another tier, a path that is
                not one of this job's segments here, or layers that are not layer indices.
        """
        try:
            parsed = json.loads(entry)
            node, path, size = parsed["node"], parsed["path"], parsed["size"]
            held = parsed.get("layers", [layer])
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise SegmentError(f"index entry {entry[:100]!r} does not parse: {error}") from None
        if not (isinstance(held, list) and held and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in held)):
            raise SegmentError(f"index entry names layers {held!r}")
        if node != self.node:
            raise SegmentError(f"segment {path!r} is in tier {node!r}, not this host's "
                               f"{self.node!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise SegmentError(f"index entry names a size of {size!r}")
        return segments.check_path(self.base, self.job, str(path)), size, sorted(held)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for field, delta in deltas.items():
                setattr(self._stats, field, getattr(self._stats, field) + delta)


def with_local_tier(store: StashStore, local_tier_dir: str = "", local_tier_bytes: int = -1,
                    local_tier_ranks: int = 1, local_tier_private: bool = False,
                    local_tier_rank: int | None = None,
                    local_tier_consumers: Mapping[int, int] | None = None,
                    local_tier_producers: Mapping[int, int] | None = None) -> StashStore:
    """`store` behind the local tier at `local_tier_dir` (empty: `store` itself); the
    other options are `SharedTierStore`'s (``ranks``, ``private``, ``rank``, ``consumers``,
    ``producers``).

    Raises:
        ValueError: a tier in front of a store other than Redis, or a bad cap, rank count,
            rank, consumer or producer.
        PermissionError: a base directory that is another user's or open to others.
    """
    if not local_tier_dir:
        return store
    if not isinstance(store, OffloadStore):
        raise ValueError(f"the local tier needs the Redis backend, not {type(store).__name__}")
    return SharedTierStore(store, Path(local_tier_dir), local_tier_bytes, local_tier_ranks,
                           private=local_tier_private, rank=local_tier_rank,
                           consumers=local_tier_consumers, producers=local_tier_producers)


def _check_layer_ranks(what: str, by_layer: Mapping[int, int], ranks: int) -> dict[int, int]:
    """`by_layer` (layer -> the rank that is its `what`: consumer or producer) as a dict,
    checked against the job attempt's `ranks`.

    Raises:
        ValueError: a rank outside 0..ranks-1, or a negative layer; names the value.
    """
    for layer, rank in by_layer.items():
        if layer < 0 or not 0 <= rank < ranks:
            raise ValueError(f"local tier {what} of layer {layer}: rank {rank} (layers "
                             f"are >= 0, ranks 0..{ranks - 1})")
    return dict(by_layer)


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

