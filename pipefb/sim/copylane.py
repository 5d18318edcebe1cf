"""The copy lane: each rank's stash writes and fetches, beside its compute lane."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipefb.sim.cluster import Link

# [Note: copy lane]
# A worker hands each stash to an I/O thread (`offload_store.writer`; on CUDA first a
# copy stream into pinned buffers) and takes each fetch on a prefetch thread from its
# action list (`dataplane.grpc_transport`), so the simulator gives every rank a copy lane
# beside its compute lane, with two directions (writes out, takes in), each FIFO like a
# link's, at its copy link's latency and bandwidth: the store's, or the node-local
# tier's where the rank shares it with its stash partners ([Note: shared tier] in
# pipefb.sim.costmodel; the calibration's store and shared-tier probes time the same put
# and take, the shared tier's through a writer and a prefetch thread as here:
# `calibration/store.py`).
# - STASH hands its bytes to the out direction and holds the compute lane only for the
#   action overhead, plus a wait while the bytes in flight (handed over, not yet
#   written) and its own would pass `Cluster.stash_in_flight_bytes` (the workers'
#   --stash-in-flight-bytes): until enough earlier writes end, or until none is left in
#   flight (a stash over the cap alone never waits forever). A consumer on another rank
#   may take the stash when its write ends. With a cap of 0 the stash is written on the
#   compute lane, as the worker then does.
# - FETCH's take runs on the in direction from when it is issued, and not before the
#   stash was written: the runtime prefetches the next FETCH of the iteration when a
#   FETCH ends, on a backward rank once the receive just before that FETCH arrived (then
#   the stash is in the store, [Note: transport ordering]); an iteration's first FETCH,
#   or one after something else on a backward rank, is issued when the rank reaches it.
#   The FETCH waits only for what is left of its take. A combined rank takes back its own
#   stash at once while its write has not ended (`StashWriter.take_pending`).
# - A forward rank's transfers leave only after its stashes handed over before them are
#   written (the runtime fences them so), and an iteration's end waits for every write of
#   the step (the flush drains the writer): [Note: flush] in pipefb.sim.engine.
# - Bytes in flight count as `stash_in_flight` memory until their write ends.
# - On a loopback host a copy is CPU work (the I/O thread and Redis): a job of the copy
#   link's `cpu` times its seconds runs on the host's cores from its start, slowing the
#   computes beside it (so there a prefetch's take is issued as soon as its inputs are
#   in, not when the rank reaches its FETCH); the lane's own times are not stretched by
#   that sharing.


@dataclass(slots=True)
class CopyLane:
    """One rank's copy lane ([Note: copy lane]): when each direction is next free, and
    the writes still in flight as (end, bytes), in order of their ends."""

    link: Link  # the store's, or the shared tier's ([Note: shared tier])
    cap: int  # bytes in flight at most; 0: writes run on the compute lane
    out_free: float = 0.0
    in_free: float = 0.0
    writes: deque[tuple[float, int]] = field(default_factory=deque)

    def in_flight(self, t: float) -> int:
        """Bytes handed over and not yet written at time `t`."""
        while self.writes and self.writes[0][0] <= t:
            self.writes.popleft()
        return sum(n for _, n in self.writes)

    def room(self, t: float, nbytes: int) -> float:
        """When a stash of `nbytes` reached at `t` may be handed over: `t`, or when enough
        earlier writes end that it fits under the cap (or none is left in flight)."""
        held = self.in_flight(t)
        while self.writes and held + nbytes > self.cap:
            end, n = self.writes.popleft()
            t, held = max(t, end), held - n
        return t

    def write(self, t: float, nbytes: int) -> tuple[float, float]:
        """Queues a write handed over at `t`; returns its (start, end)."""
        start = max(t, self.out_free)
        self.out_free = end = start + self.link.seconds(nbytes)
        self.writes.append((end, nbytes))
        return start, end

    def take(self, t: float, nbytes: int) -> tuple[float, float]:
        """Queues a take issued (and its stash written) by `t`; returns its (start, end)."""
        start = max(t, self.in_free)
        self.in_free = end = start + self.link.seconds(nbytes)
        return start, end


__all__ = ["CopyLane"]
