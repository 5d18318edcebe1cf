"""Partition enumeration: the per-layer times and boundary transfers that stages balance,
and the balanced plan of each kind, role split and policy (step 1 of [Note: search])."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pipefb.plan.partition import partitions
from pipefb.plan.plan import Plan, WorkerAssignment, plan_stale_microbatches
from pipefb.planner.candidates import SearchSpace
from pipefb.schedule import schedule_kind
from pipefb.sim.cluster import Cluster, Link, slowest_hop
from pipefb.sim.costs import Profile, kept_bytes


def pass_times(profile: Profile, store: Link, policy: Sequence[str], which: str
               ) -> list[float]:
    """Per-layer time of one pass (combined, forward or backward) that partitions balance
    (see [Note: search], step 1): compute, recompute, store traffic, and loading the
    micro-batch, which the forward of the first layer's and the loss layer's stages pays
    (as simulated; once when one stage holds both)."""
    out = []
    for i, x in enumerate(profile.layers):
        data = profile.load_seconds(range(i, i + 1)) if which != "backward" else 0.0
        recompute = x.forward_seconds if policy[i] == "recompute" else 0.0
        # inside a run of recomputed layers nothing moves (stage cuts, unknown here,
        # start a run too: one input per stage is left out)
        starts = i == 0 or policy[i - 1] != "recompute"
        moved = kept_bytes(x, policy[i], starts)
        if which == "combined":
            offload = 2 * store.seconds(moved) if policy[i] == "offload" else 0.0
            out.append(data + x.forward_seconds + x.backward_seconds + recompute + offload)
        elif which == "forward":
            out.append(data + x.forward_seconds + moved / store.bandwidth)
        else:
            out.append(x.backward_seconds + recompute + moved / store.bandwidth)
    return out


def boundary_bytes(profile: Profile, layers: Sequence[int]) -> int:
    """Bytes crossing the two boundaries of a stage of contiguous `layers` per micro-batch
    and pass: its input from the stage before and its output to the one after (an
    activation forward, its gradient backward)."""
    first, last = layers[0], layers[-1]
    return ((profile.layers[first - 1].output_bytes if first > 0 else 0)
            + (profile.layers[last].output_bytes if last < profile.n_layers - 1 else 0))


def bandwidth(cluster: Cluster, ranks: Sequence[int]) -> float:
    """Bytes per second of the slowest link between consecutive `ranks` (inf: one)."""
    return slowest_hop(cluster, itertools.pairwise(ranks)).bandwidth


class Balancer:
    """Builds balanced plans for one search; caches partitions per (pass times, boundary
    costs, stage speeds)."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.partitions: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}

    def layer_times(self, which: str, policy: Sequence[str], microbatch: int) -> list[float]:
        """`pass_times` of this search's profile at `microbatch` samples and its store."""
        return pass_times(self.space.profile.at(microbatch), self.space.cluster.store,
                          policy, which)

    def split_partition(self, times: list[float], ranks: Sequence[int], which: str
                        ) -> tuple[int, ...]:
        """Balanced stages of `times`, and of the `which` pass's boundary transfers, over
        the workers `ranks`; one dynamic program serves every stage count when the workers
        are equally fast."""
        speeds = [self.space.cluster.workers[r].speed for r in ranks]
        cuts = self.cut_seconds(which, ranks)
        uniform = len(set(speeds)) == 1
        key = (tuple(times), tuple(cuts), speeds[0] if uniform else tuple(speeds))
        if key not in self.partitions:
            n = min(len(times), self.space.cluster.size) if uniform else len(speeds)
            self.partitions[key] = partitions(times, n, speeds[:1] * n if uniform else speeds,
                                              cuts)
        return self.partitions[key][len(ranks) - 1]

    def cut_seconds(self, which: str, ranks: Sequence[int]) -> list[float]:
        """Per boundary before layer c (c = 0..n), the seconds a stage next to it spends per
        micro-batch (at the profile's size) moving what crosses it over the slowest link
        between consecutive `ranks`: the activation in the forward pass, its gradient in
        the backward, both on combined kinds; nothing crosses the model's ends."""
        per = 2 if which == "combined" else 1
        link = bandwidth(self.space.cluster, ranks)
        layers = self.space.profile.layers
        return [0.0, *(per * x.output_bytes / link for x in layers[:-1]), 0.0]

    def build(self, kind: str, mode: str, microbatches: int, n_fwd: int,
              policy: Sequence[str]) -> Plan:
        """A plan of `kind` with balanced partitions for the given policy (`n_fwd` forward
        workers when the kind splits the passes)."""
        n = self.space.cluster.size
        mb = self.space.batch_size // microbatches
        ref = self.space.profile.microbatch_size  # one partition table for every count
        spec = schedule_kind(kind)
        if spec.split:
            fwd_ranks, bwd_ranks = range(n_fwd), range(n_fwd, n)
            fwd = self.split_partition(self.layer_times("forward", policy, ref), fwd_ranks,
                                       "forward")
            bwd = self.split_partition(self.layer_times("backward", policy, ref), bwd_ranks,
                                       "backward")
            assignment = tuple(WorkerAssignment(r, "forward", r) for r in fwd_ranks) + tuple(
                WorkerAssignment(r, "backward", s) for s, r in enumerate(bwd_ranks))
        else:
            fwd = bwd = self.split_partition(self.layer_times("combined", policy, ref), range(n),
                                             "combined")
            assignment = tuple(WorkerAssignment(r, "combined", r) for r in range(n))
        staleness = spec.plan_staleness(mode, self.space.staleness)
        return Plan(schedule=kind, microbatches=microbatches, microbatch_size=mb,
                    forward_partition=fwd, backward_partition=bwd, policy=tuple(policy),
                    assignment=assignment, mode=mode, staleness=staleness,
                    stale_microbatches=plan_stale_microbatches(
                        staleness, self.space.stale_microbatches, microbatches))
