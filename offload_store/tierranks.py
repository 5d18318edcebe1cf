"""Which ranks of a job attempt share a node-local tier: the attempt's set of tier ranks
in Redis, as one rank's store joins it, reads it and leaves it.

[Note: tier ranks] A segment is only readable on its own host, so a producer writes a
layer's stash to the tier only when the rank that takes it uses the same tier; each
rank's store adds ``{tier id}/{rank}/{token}`` to the attempt's set
(`keys.tier_ranks_key`) when it opens. The tier id is the base directory's own
(`segments.node_id`), so processes that share the directory share the tier; the rank is
the worker's rank in the job attempt (empty for a store opened without one). A producer
that knows which rank takes each of its layers (``local_tier_consumers``: the backward
rank holding the layer in PipeFB, itself on a combined rank;
`pipefb.plan.stashpath.stash_consumers`) writes a layer to the tier once that rank's entry
names its own tier id, and to Redis while the rank has not opened its store yet or when
it names another tier: so a job spread over hosts uses the tier for every pair of ranks
that share one. A layer with no known consumer may be taken by any rank, so it goes to
the tier only once the set names as many ranks as the job has, all on this tier. A
consumer that knows which rank stashed each layer it takes (``local_tier_producers``: the
forward rank that runs the layer in PipeFB, itself on a combined rank;
`pipefb.plan.stashpath.stash_producers`) takes a layer whose producer's entry names
another tier straight from Redis, without an index lookup: that producer can only have
written it there. Every other layer (its producer on this tier, not named, or not in the
set yet) is looked up in the index: an entry means a segment of this host, none means
Redis ([Note: local tier index] in `offload_store.shm`); so no take depends on when its
producer joined. A store reads the set as it joins, in the round trip that adds its
entry, and a take that meets a named producer not seen yet reads it again in its own
pipeline, so learning the set costs no round trip of its own.
A rank's store takes itself out of the set when it closes (when its worker drops the
job), and the set goes with the last one; a crashed rank's entry goes with its job's
clear or the TTL.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Collection
from contextlib import suppress

import redis
from redis.client import Pipeline
from redis.exceptions import RedisError

from offload_store.keys import tier_ranks_key


class TierRanks:
    """One rank's view of its job attempt's tier ranks ([Note: tier ranks]): joins the set
    at construction, learns the other ranks' tier ids from it. Safe to share between
    threads."""

    def __init__(self, client: redis.Redis, job: str, attempt: int, node: str, ranks: int,
                 rank: int | None, ttl_seconds: int) -> None:
        """Adds this rank to the attempt's set and reads the ranks already in it, in one
        round trip.

        Args:
            client: the Redis client of the job attempt's store.
            job: job id.
            attempt: the job attempt.
            node: this rank's tier id.
            ranks: how many ranks the job attempt has.
            rank: this rank's index in the job attempt; None: not known (the rank can then
                be no layer's known consumer or producer).
            ttl_seconds: the set's lifetime, as a stash key's.
        """
        self.client, self.key = client, tier_ranks_key(job, attempt)
        self.node, self.ranks, self.rank = node, ranks, rank
        self.member = f"{node}/{'' if rank is None else rank}/{secrets.token_hex(8)}"
        self._tiers: dict[int, str] = {} if rank is None else {rank: node}  # rank -> tier id
        self._all_here: bool | None = None  # every rank on this tier; None: not known yet
        self._lock = threading.Lock()
        pipe = client.pipeline(transaction=False)
        pipe.sadd(self.key, self.member)
        pipe.expire(self.key, ttl_seconds)
        pipe.smembers(self.key)
        self._record(pipe.execute()[-1])

    def on_this_tier(self, ranks: Collection[int]) -> set[int]:
        """Those of `ranks` whose store uses this tier; asks Redis (once) only when one of
        them has not been seen in the set yet, and counts those still missing as elsewhere."""
        with self._lock:
            if any(r not in self._tiers for r in ranks):
                self._read()
            return {r for r in ranks if self._tiers.get(r) == self.node}

    def on_other_tiers(self, ranks: Collection[int]) -> tuple[set[int], bool]:
        """Those of `ranks` seen using another tier, and whether one of `ranks` has not been
        seen yet: a take counts that one as possibly here and reads the set again in its
        own pipeline (`read_in`, `record`), so this asks Redis nothing."""
        with self._lock:
            seen = {r: self._tiers[r] for r in ranks if r in self._tiers}
        return {r for r, node in seen.items() if node != self.node}, len(seen) < len(ranks)

    def read_in(self, pipe: Pipeline) -> None:
        """Queues a read of the set on `pipe`; its reply goes to `record`."""
        pipe.smembers(self.key)

    def record(self, reply: object) -> None:
        """Records the entries a `read_in` returned (an error reply records nothing)."""
        if isinstance(reply, set):
            with self._lock:
                self._record(reply)

    def all_here(self) -> bool:
        """Whether every rank of the attempt uses this tier; asked of Redis until the set
        names every rank or one on another tier, then known for the attempt."""
        with self._lock:
            if self._all_here is None:
                nodes, count = self._read()
                if count >= self.ranks:
                    self._all_here = nodes == {self.node}
                elif nodes - {self.node}:  # a rank on another tier already: never all here
                    self._all_here = False
            return bool(self._all_here)

    def leave(self) -> None:
        """Takes this rank out of the set (the last one out deletes it); a store that no
        longer answers keeps the entry until the job's clear or the TTL."""
        with suppress(RedisError):
            self.client.srem(self.key, self.member)

    def _read(self) -> tuple[set[str], int]:
        """Reads the set (hold the lock); see `_record`."""
        return self._record(self.client.smembers(self.key))

    def _record(self, members: Collection[bytes | str]) -> tuple[set[str], int]:
        """Records each entry's rank and tier id (hold the lock, or be the constructor);
        returns the tier ids named and the number of entries."""
        nodes: set[str] = set()
        for member in members:
            text = member.decode() if isinstance(member, bytes) else str(member)
            node, _, rest = text.partition("/")
            rank = rest.partition("/")[0]
            nodes.add(node)
            if rank.isdigit():
                self._tiers[int(rank)] = node
        return nodes, len(members)
