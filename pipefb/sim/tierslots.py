"""The node-local tier's slots: which of a private rank's stashes fit under the tier's cap."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pipefb.schedule import Action, Kind, Schedule
from pipefb.sim.costmodel import STORE_KINDS, Costs
from pipefb.sim.program import Op

FREE_SLOTS = 2  # = offload_store.ownslots.FREE_SLOTS: free slots a rank keeps of a size
Key = tuple[int, int]  # a stash's (step, micro-batch)

# [Note: tier cap]
# A private rank's store ([Note: tier copies] in pipefb.sim.costmodel) copies each
# micro-batch's whole stash into one slot file of the node-local tier and takes it back as
# views of that file ([Note: own slots] in offload_store/ownslots.py). The simulator keeps
# each such rank's slots by state, as `OwnSlots` does:
# - A put first frees the slots whose tensors went since (below), then reuses a free slot
#   of the stash's size where the rank keeps one (its room is counted already: no check);
#   else it makes a new slot if every slot file in the tier (each private rank's on the
#   host: slots holding stashes, slots that taken tensors still view, slots whose tensors
#   went, free slots) plus the new one stay within the cap, after dropping the rank's own
#   free slots where they would not. A stash that still does not fit is not written to
#   the tier: it goes to the store, and its take comes from there
#   (`SharedTierStore._put_private`, `_take_private` in offload_store/shm.py).
# - A take from a slot lends it to the taken tensors, and the slot holds its room until
#   they go: at the end of the B that uses them or, on a rank that runs weight-grad halves
#   later ([Note: early sends] in pipefb.sim.program), of the B that runs their halves
#   (`views_dropped`). The rank's next STASH or FETCH frees it (the put's claim, or the
#   memory count after the action): kept free for the next stash of its size, up to
#   `FREE_SLOTS` of a size, the rest removed (their room goes back to every writer).
# - The rank's `node_tier` memory, counted after each STASH and FETCH, is its slots that no
#   taken tensor views: those holding stashes and the free ones; a spilled stash is the
#   store's memory, not the tier's.
# A STASH or FETCH whose stash is in a slot costs `Cluster.local_tier`'s time, one whose
# stash spilled `Cluster.store`'s, on the compute lane either way (the rank has no I/O
# thread), with the store's CPU share beside it on a loopback host as every store
# transfer ([Note: shared hosts] in pipefb.sim.hosts). The private ranks of one host share
# its tier and its cap (`Cluster.local_tier_bytes`, the workers' --local-tier-bytes; a
# worker without a host has a tier of its own), so where a cap binds two of them their
# actions run in time order (`TierSlots.shared`); with several groups, a group's ranks
# share its part of a host's cap, as `group_view` shares out the host's cores. A slot's
# size is its stash's bytes (the runtime aligns each tensor to 64), and the tier holds
# this job's slots alone.


@dataclass(slots=True)
class RankSlots:
    """One private rank's slots by state, each as its size in bytes ([Note: tier cap]);
    the byte counts run along, so the planner's many simulations never re-add them."""

    filled: dict[Key, int] = field(default_factory=dict)  # stashes put and not taken
    lent: dict[Key, int] = field(default_factory=dict)  # taken, their tensors still here
    returned: list[int] = field(default_factory=list)  # their tensors gone, not yet freed
    free: Counter[int] = field(default_factory=Counter)  # size -> free slots kept
    files: int = 0  # bytes of the rank's slot files in the tier, in every state
    lent_bytes: int = 0  # bytes of the slots in `lent`

    def held(self) -> int:
        """Bytes of the slots no taken tensor views, once the returned ones are freed
        (`OwnSlots.held_bytes`: the rank's `node_tier` memory)."""
        self.drain()
        return self.files - self.lent_bytes

    def drain(self) -> None:
        """Frees the slots whose tensors went: kept free up to `FREE_SLOTS` of a size,
        removed beyond (`OwnSlots._drain_returns`)."""
        for size in self.returned:
            if self.free[size] < FREE_SLOTS:
                self.free[size] += 1
            else:
                self.files -= size
        self.returned.clear()

    def drop_free(self) -> None:
        """Removes every free slot (`OwnSlots._drop_free`): their room goes back to the
        tier."""
        self.files -= sum(size * n for size, n in self.free.items())
        self.free.clear()


class TierSlots:
    """Every private rank's slots, by the tier they share ([Note: tier cap])."""

    def __init__(self, tier_of: Mapping[int, str], caps: Mapping[str, float],
                 frees: Mapping[int, Mapping[int, tuple[int, ...]]] | None = None) -> None:
        """Args:
            tier_of: each private rank's tier.
            caps: each tier's cap in bytes (inf: none).
            frees: per rank, the position of a B in its list -> the micro-batches whose
                taken tensors go at its end (`views_dropped`); a B not named: its own.
        """
        self.tier_of, self.caps, self.frees = dict(tier_of), dict(caps), frees or {}
        self.ranks = {r: RankSlots() for r in self.tier_of}
        self.on_tier: dict[str, list[int]] = {}
        for r, tier in self.tier_of.items():
            self.on_tier.setdefault(tier, []).append(r)
        #: whether a capped tier holds several ranks, whose puts then depend on each
        #: other's in time order
        self.shared = any(len(ranks) > 1 and math.isfinite(self.caps[tier])
                          for tier, ranks in self.on_tier.items())

    def used(self, tier: str) -> int:
        """Bytes of every slot file in `tier` (`segments.used_bytes`)."""
        return sum(self.ranks[r].files for r in self.on_tier[tier])

    def put(self, rank: int, key: Key, nbytes: int) -> bool:
        """Puts stash `key` of `nbytes` into a slot of `rank`'s; False: past the cap, it
        goes to the store (`OwnSlots._claim`, `_new`)."""
        slots, tier = self.ranks[rank], self.tier_of[rank]
        cap = self.caps[tier]
        slots.drain()
        if slots.free[nbytes]:
            slots.free[nbytes] -= 1
        else:
            if math.isfinite(cap) and self.used(tier) + nbytes > cap:
                slots.drop_free()  # its free slots of other sizes make room
                if self.used(tier) + nbytes > cap:
                    return False
            slots.files += nbytes
        slots.filled[key] = nbytes
        return True

    def take(self, rank: int, key: Key) -> bool:
        """Takes stash `key` from its slot, lent to the taken tensors; False: it is not in
        the tier (it spilled to the store)."""
        slots = self.ranks[rank]
        nbytes = slots.filled.pop(key, None)
        if nbytes is None:
            return False
        slots.lent[key] = nbytes
        slots.lent_bytes += nbytes
        return True

    def views_gone(self, rank: int, key: Key) -> None:
        """The tensors taken from stash `key`'s slot went (none: nothing)."""
        slots = self.ranks[rank]
        nbytes = slots.lent.pop(key, None)
        if nbytes is not None:
            slots.lent_bytes -= nbytes
            slots.returned.append(nbytes)

    def finished(self, rank: int, step: int, op: Op) -> int | None:
        """After `op` of training step `step` ends on `rank`: a B lets go of the slots its
        taken tensors viewed; a STASH or FETCH frees those let go of and gives the rank's
        `node_tier` bytes (None: any other action, or a rank that is not private)."""
        if rank not in self.ranks:
            return None
        kind = op.action.kind
        if kind is Kind.B:
            for m in self.frees.get(rank, {}).get(op.index, (op.microbatch,)):
                self.views_gone(rank, (step, m))
            return None
        return self.ranks[rank].held() if kind in STORE_KINDS else None


def tier_slots(costs: Costs, schedule: Schedule,
               halves: Mapping[int, Mapping[int, int] | None]) -> TierSlots:
    """The slots of `costs`' private ranks in front of the tier (`Costs.on_compute`): a
    worker's tier is its host's (its own without one), its cap the cluster's, shared out
    among the groups by their workers on the host; `halves` as `views_dropped`'s, per
    rank."""
    group, everyone = costs.cluster, costs.links
    on_host = Counter(w.host for w in everyone.workers)
    mine = Counter(w.host for w in group.workers)
    tier_of, caps = {}, {}
    for r in costs.on_compute:
        spec = group.workers[r]
        tier = tier_of[r] = spec.host or f"worker:{spec.name}"
        share = mine[spec.host] / on_host[spec.host] if spec.host else 1.0
        caps[tier] = group.local_tier_bytes * share
    frees = {r: views_dropped(schedule[r], halves.get(r)) for r in costs.on_compute}
    return TierSlots(tier_of, caps, frees)


def views_dropped(actions: list[Action], halves: Mapping[int, int] | None
                  ) -> dict[int, tuple[int, ...]]:
    """The position of each B in a rank's list -> the micro-batches whose taken tensors go
    at its end: its own, or where the rank runs weight-grad halves later (`halves`: how
    many each B runs, by micro-batch; [Note: early sends] in pipefb.sim.program) those
    whose halves it runs, the oldest waiting first (`StageRuntime._run_deferred`)."""
    out: dict[int, tuple[int, ...]] = {}
    waiting: deque[int] = deque()
    for i, a in enumerate(actions):
        if a.kind is not Kind.B or a.microbatch is None:
            continue
        if halves is None:
            out[i] = (a.microbatch,)
            continue
        waiting.append(a.microbatch)
        runs = min(halves.get(a.microbatch, 0), len(waiting))
        out[i] = tuple(waiting.popleft() for _ in range(runs))
    return out


__all__ = ["FREE_SLOTS", "RankSlots", "TierSlots", "tier_slots", "views_dropped"]
