"""The cost model: each action's duration and bytes on its rank, from profile and cluster."""

from __future__ import annotations

from pipefb.errors import ScheduleError
from pipefb.plan.plan import Plan, recompute_runs
from pipefb.plan.stashpath import (
    copies_on_compute_thread,
    stash_partners,
    takes_back_own_stash_in,
)
from pipefb.schedule import Action, Kind, Topology
from pipefb.sim.cluster import Cluster, Link, group_view, ring_link
from pipefb.sim.costs import Profile, kept_bytes, ring_allreduce_seconds

# [Note: cost model]
# - F, B, OPT run on the worker's host ([Note: shared hosts] in pipefb.sim.hosts); their
#   time is the profiled layer time over the worker's speed: F sums the stage's forwards
#   (plus loading the micro-batch on the first stage and the loss's,
#   `Profile.data_seconds`), B its backwards plus the forwards of its recomputed layers,
#   OPT is the optimizer's fixed seconds plus its seconds per byte times the bytes it
#   updates (none without parameters), plus the copy of those bytes where it keeps a
#   weight version ([Note: weight versions] in pipefb.sim.program).
# - SEND_F, SEND_B, SEND_L and PUSH_W cost the sender only the action overhead; the bytes
#   then cross the link between the two workers, one transfer at a time per direction
#   (FIFO), arriving `latency + bytes / bandwidth` after they start.
# - STASH and FETCH move the stashed bytes through the rank's copy lane, beside its
#   compute, at its copy link's latency + bytes over bandwidth (the store's, or the
#   shared tier's: [Note: shared tier]; [Note: copy lane] in
#   pipefb.sim.copylane): a STASH holds the compute lane only while the bytes in flight
#   are at their cap (a cap of 0: for its whole write), a FETCH only for what is left of
#   its prefetched take. A STASH whose FETCH comes right after it moves nothing
#   ([Note: back-to-back stash] in pipefb.runtime.exchange). A rank that copies its
#   stashes on its compute thread keeps them off the lane: [Note: tier copies].
# - RECV_* and RECV_W wait for the arrival; a RECV_W then copies the pushed version into
#   the rank's forward layers ([Note: weight installs]); every action adds the cluster's
#   action overhead, every iteration its step overhead (and, on a loopback host, its Step call's
#   CPU beside it: [Note: step calls] in pipefb.sim.engine). On a loopback host a send
#   followed by compute starts later ([Note: busy senders] in pipefb.sim.engine).

# [Note: weight installs]
# A forward rank does not compute on the pushed tensors themselves: its RECV_W copies
# every parameter of its forward stage from them into its layers (`RankState.install`),
# on its compute thread, before the stage's first forward. The simulator prices that copy
# as the OPT's weight-version copy is priced: the profile's `weight_copy_seconds_per_byte`
# times the stage's parameter bytes, over the worker's speed (`Costs.install`).

# [Note: tier copies]
# On the CPU a rank that takes back its own stashes, in front of a node-local tier, puts
# and takes them on its compute thread, with no I/O thread and no prefetch
# (`pipefb.plan.stashpath.copies_on_compute_thread`, the workers' own rule; [Note: copies
# on the compute thread] in offload_store/writer.py): a put is one memcpy into a mapped
# segment, a take a view of it, no round trip. So for such a rank STASH and FETCH are
# compute-lane work of `Cluster.local_tier.seconds(bytes)` each (the calibration times a
# put and a take of the same tier, as it times the store's) while the stash fits under
# the tier's cap, and of `Cluster.store.seconds(bytes)` for a stash past it, which goes to
# the store ([Note: tier cap] in pipefb.sim.tierslots); nothing goes on its copy lane, no
# bytes are in flight (`stash_in_flight` 0) and no FETCH is prefetched. Every other rank
# (PipeFB's, one without the tier, one on CUDA) keeps the copy lane.

# [Note: shared tier]
# A rank that exchanges stashes with other ranks (`pipefb.plan.stashpath.stash_partners`:
# the consumers of a forward rank's stashes, the producers of a backward rank's fetches,
# the lists its worker gives its store) writes a layer to the node-local tier when the
# rank that takes it uses the same tier, and takes a layer from there when its producer
# does, else from Redis ([Note: tier ranks] in offload_store/tierranks.py). The simulator
# takes a host for a tier: where `Cluster.shared_tier` is set and every stash partner of
# a rank that is not private ([Note: tier copies]) shares its loopback host, its copy lane
# moves its stashes at the shared tier's latency and bandwidth (a put is a copy into a
# mapped segment plus its index keys in Redis, a take the segment's bytes back), and on
# that host its copies keep `shared_tier.cpu` cores busy; every other rank's copy lane
# (a partner on another host, no shared tier described) uses `Cluster.store`.

COMPUTE = frozenset({Kind.F, Kind.B, Kind.OPT})
SENDS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.SEND_L})
STORE_KINDS = frozenset({Kind.STASH, Kind.FETCH})
LOSS_BYTES = 4  # a float32 scalar


class Costs:
    """Durations and byte counts of each action of a plan (see [Note: cost model])."""

    def __init__(self, plan: Plan, profile: Profile, cluster: Cluster) -> None:
        if profile.n_layers != plan.forward_partition[-1]:
            raise ScheduleError(f"profile has {profile.n_layers} layers, plan "
                                f"{plan.forward_partition[-1]}")
        if len(plan.assignment) > cluster.size:
            raise ScheduleError(f"plan needs {len(plan.assignment)} workers, cluster has "
                                f"{cluster.size}")
        self.plan, self.cluster = plan, group_view(cluster, plan.groups)
        self.links = cluster  # all groups' workers: the all-reduce crosses them
        self.profile = profile.at(plan.microbatch_size)
        self.topology = plan.topology()
        self.runs = recompute_runs(plan)
        self.split = self.topology.is_split
        self._compute: dict[tuple[int, Kind, int], float] = {}
        self._stash: dict[tuple[Kind, int], int] = {}
        self.on_compute = frozenset(r for r in self.topology.workers()  # [Note: tier copies]
                                    if tier_copies(self.topology, cluster, r) is not None)
        self.copy_links = {r: copy_link(plan, self.cluster, r)  # [Note: shared tier]
                           for r in self.topology.workers()}

    def boundary_bytes(self, layer: int) -> int:
        """Bytes of the tensor entering `layer` from the layer before (0 for the data)."""
        return self.profile.layers[layer - 1].output_bytes if layer > 0 else 0

    def kept_bytes(self, layer: int) -> int:
        """What layer `layer` saves per micro-batch for its backward under its policy."""
        return kept_bytes(self.profile.layers[layer], self.plan.policy[layer],
                          self.runs.get(layer) == layer)

    def stashed_layers(self, layers: range) -> list[int]:
        """Layers of a stage whose saved tensors go through the store."""
        return [i for i in layers
                if self.split or self.plan.policy[i] == "offload"]

    def compute(self, rank: int, a: Action) -> float:
        """Seconds of an F, B or OPT on `rank`, overhead excluded; with several groups an
        OPT first sums the stage's gradients across them (a ring all-reduce)."""
        key = (rank, a.kind, a.stage)
        if key not in self._compute:
            seconds = self._compute_seconds(rank, a) / self.cluster.workers[rank].speed
            if a.kind is Kind.OPT and self.plan.groups > 1:
                seconds += self.allreduce_seconds(rank, a.stage)
            self._compute[key] = seconds
        return self._compute[key]

    def allreduce_seconds(self, rank: int, stage: int) -> float:
        """The ring all-reduce of backward stage `stage`'s gradients over the groups, at
        the pace of the ring's slowest hop (`cluster.ring_link`)."""
        owned = self.profile.param_bytes(self.topology.layers_of_backward(stage))
        link = ring_link(self.links, rank, self.plan.groups)
        return ring_allreduce_seconds(owned, self.plan.groups, link)

    def _compute_seconds(self, rank: int, a: Action) -> float:
        t = self.topology
        if a.kind is Kind.F:
            layers = t.layers_of_forward(a.stage)
            return self.profile.forward_seconds(layers) + self.profile.load_seconds(layers)
        if a.kind is Kind.B:
            layers = t.layers_of_backward(a.stage)
            recomputed = [i for i in layers if self.plan.policy[i] == "recompute"]
            return (self.profile.backward_seconds(layers)
                    + self.profile.forward_seconds(recomputed))
        owned = self.profile.param_bytes(t.layers_of_backward(a.stage))
        return self.profile.optimizer_seconds(owned)

    def weight_copy(self, rank: int, stage: int) -> float:
        """Seconds on `rank` to keep a copy of backward stage `stage`'s parameters."""
        owned = self.profile.param_bytes(self.topology.layers_of_backward(stage))
        return self.profile.weight_copy_seconds(owned) / self.cluster.workers[rank].speed

    def install(self, rank: int, stage: int) -> float:
        """Seconds on `rank` to copy a pushed weight version into forward stage `stage`'s
        layers ([Note: weight installs])."""
        held = self.profile.param_bytes(self.topology.layers_of_forward(stage))
        return self.profile.weight_copy_seconds(held) / self.cluster.workers[rank].speed

    def stash_bytes(self, a: Action) -> int:
        """Bytes a STASH puts into (a FETCH takes from) the store per micro-batch."""
        key = (a.kind, a.stage)
        if key not in self._stash:
            self._stash[key] = self._stash_bytes(a)
        return self._stash[key]

    def _stash_bytes(self, a: Action) -> int:
        layers = (self.topology.layers_of_forward(a.stage) if a.kind is Kind.STASH
                  else self.topology.layers_of_backward(a.stage))
        return sum(self.kept_bytes(i) for i in self.stashed_layers(layers))

    def tier_seconds(self, a: Action) -> float:
        """Compute-lane seconds of a STASH or FETCH on a rank that copies its stashes on
        its compute thread, its stash in the tier ([Note: tier copies])."""
        assert self.cluster.local_tier is not None
        return self.cluster.local_tier.seconds(self.stash_bytes(a))

    def send_bytes(self, a: Action) -> int:
        """Bytes a SEND_F, SEND_B or SEND_L moves per micro-batch."""
        t = self.topology
        if a.kind is Kind.SEND_F:
            return self.boundary_bytes(t.forward_partition[a.stage + 1])
        if a.kind is Kind.SEND_B:
            return self.boundary_bytes(t.backward_partition[a.stage])
        return LOSS_BYTES

    def push_bytes(self, bwd_stage: int, fwd_stage: int) -> int:
        """Parameter bytes a PUSH_W of `bwd_stage` sends to forward stage `fwd_stage`."""
        t = self.topology
        layers = set(t.layers_of_backward(bwd_stage)) & set(t.layers_of_forward(fwd_stage))
        return self.profile.param_bytes(sorted(layers))


def tier_copies(topology: Topology, cluster: Cluster, rank: int) -> Link | None:
    """The node-local tier that `rank` of `topology` puts and takes its stashes in on its
    compute lane, or None where they go through its copy lane ([Note: tier copies])."""
    tier = cluster.local_tier
    private = takes_back_own_stash_in(topology, rank)
    return tier if copies_on_compute_thread(private, tier is not None, cluster.device) else None


def copy_link(plan: Plan, cluster: Cluster, rank: int) -> Link:
    """The link rank `rank`'s copy lane moves its stashes over: the shared tier where its
    stash partners share its loopback host, else the store ([Note: shared tier])."""
    tier = cluster.shared_tier
    partners = stash_partners(plan, rank)
    if tier is not None and partners and all(cluster.on_loopback(rank, p) for p in partners):
        return tier
    return cluster.store


def stage_of(workers: tuple[int, ...], rank: int) -> int | None:
    """The stage `rank` runs among a role's `workers` (None: it has none there)."""
    return workers.index(rank) if rank in workers else None


__all__ = ["COMPUTE", "LOSS_BYTES", "SENDS", "STORE_KINDS", "Costs", "copy_link", "stage_of",
           "tier_copies"]
