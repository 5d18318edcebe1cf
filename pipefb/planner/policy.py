"""Activation policy choice: a candidate's first per-layer policy, and the change that brings
a worker over its memory cap down most cheaply (step 2 of [Note: search])."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pipefb.plan.plan import Plan, recompute_runs
from pipefb.planner.candidates import SearchSpace
from pipefb.schedule import Topology, schedule_kind
from pipefb.sim.cluster import Link
from pipefb.sim.costmodel import tier_copies
from pipefb.sim.costs import Profile, kept_bytes

#: (bytes freed per second of extra time, the layers changed, their new policy)
_Option = tuple[float, tuple[int, ...], str]
#: an offload that lengthens the simulated step by at most this share is nearly free
NEARLY_FREE = 0.02


def initial_policy(space: SearchSpace, kind: str, microbatches: int) -> list[str]:
    """keep where the kind allows it (combined kinds: nothing moves); else (PipeFB)
    offload, or recompute where re-running the forward is cheaper than moving what it
    frees through the store (alone, joining the run before it, or starting a run with
    the layer before: a loss whose saved tensor is its input is only worth recomputing
    together with the head that makes it)."""
    if schedule_kind(kind).keep_allowed:
        return ["keep"] * space.profile.n_layers
    layers = space.profile.at(space.batch_size // microbatches).layers
    bandwidth = space.cluster.store.bandwidth
    out: list[str] = []
    for i, x in enumerate(layers):
        joins = bool(out) and out[-1] == "recompute"
        if x.forward_seconds < (x.saved_bytes - kept_bytes(x, "recompute", not joins)
                                ) / bandwidth:
            out.append("recompute")
            continue
        prev = layers[i - 1] if i else None
        if prev is not None and out[-1] == "offload" and (
                prev.forward_seconds + x.forward_seconds
                < (prev.saved_bytes - prev.input_bytes + x.saved_bytes) / bandwidth):
            out[-1] = "recompute"
            out.append("recompute")
            continue
        out.append("offload")
    return out


def relieve(space: SearchSpace, plan: Plan, over: dict[int, int],
            nearly_free: Callable[[list[str], int], bool] | None = None
            ) -> list[str] | None:
    """The policy with one more change per over-cap worker (the ranks of `over`): the
    worker's kept layer with the largest stash offloaded if `nearly_free` says the
    simulation hides its copies behind compute ([Note: copy lane] in
    pipefb.sim.copylane); else a kept layer offloaded, or a layer recomputed (alone or
    with the layer before it, as one run), whichever frees the most bytes per second of
    extra time (an offload priced as a put and a take on the compute lane: through the
    store, or the node-local tier where the rank copies there, [Note: tier copies] in
    pipefb.sim.costmodel); None if no change frees anything.

    Args:
        nearly_free: whether under a policy the simulated step is at most `NEARLY_FREE`
            longer than the plan's and the given rank's peak lower; None: rank every
            change by its analytic cost.
    """
    prof = space.profile.at(plan.microbatch_size)
    policy, changed = list(plan.policy), False
    topology = plan.topology()
    for r in over:
        free = _free_offload(policy, r, _layers_of_rank(topology, r), prof, nearly_free)
        if free is not None:
            policy[free], changed = "offload", True
            continue
        copies = tier_copies(topology, space.cluster, r) or space.cluster.store
        options = _options(plan, policy, _layers_of_rank(topology, r), prof, copies)
        if options:
            _, best, new = max(options)
            for j in best:
                policy[j] = new
            changed = True
    return policy if changed else None


def _free_offload(policy: list[str], rank: int, layers: list[int], prof: Profile,
                  nearly_free: Callable[[list[str], int], bool] | None) -> int | None:
    """The kept layer of `layers` (those of `rank`) with the largest stash if offloading
    it is nearly free and lowers the rank's peak (one simulation), else None."""
    kept = [i for i in layers if policy[i] == "keep" and prof.layers[i].saved_bytes > 0]
    if nearly_free is None or not kept:
        return None
    i = max(kept, key=lambda j: prof.layers[j].saved_bytes)
    trial = [("offload" if j == i else p) for j, p in enumerate(policy)]
    return i if nearly_free(trial, rank) else None


def _options(plan: Plan, policy: list[str], layers: list[int], prof: Profile, copies: Link
             ) -> list[_Option]:
    """Every single change to `policy` that frees memory on a rank holding `layers`, an
    offload costing a put and a take over `copies`."""
    held = _held_bytes(plan, policy, layers, prof)
    options: list[_Option] = []
    for i in layers:
        x = prof.layers[i]
        if policy[i] == "keep" and x.saved_bytes > 0:
            options.append((x.saved_bytes / max(2 * copies.seconds(x.saved_bytes), 1e-12),
                            (i,), "offload"))
        for run in ((i,), (i - 1, i)):
            if run[0] not in layers or all(policy[j] == "recompute" for j in run):
                continue
            trial = [("recompute" if j in run else p) for j, p in enumerate(policy)]
            freed = held - _held_bytes(plan, trial, layers, prof)
            extra = sum(prof.layers[j].forward_seconds for j in run
                        if policy[j] != "recompute")
            if freed > 0:
                options.append((freed / max(extra, 1e-12), run, "recompute"))
    return options


def _held_bytes(plan: Plan, policy: list[str], layers: list[int], prof: Profile) -> int:
    """Bytes `layers` hold per micro-batch for their backward under `policy`."""
    runs = recompute_runs(replace(plan, policy=tuple(policy)))
    return sum(kept_bytes(prof.layers[i], policy[i], runs.get(i) == i) for i in layers)


def _layers_of_rank(topology: Topology, rank: int) -> list[int]:
    """The layers `rank` runs a pass of, ascending."""
    out: set[int] = set()
    if rank in topology.forward_workers:
        out |= set(topology.layers_of_forward(topology.forward_workers.index(rank)))
    if rank in topology.backward_workers:
        out |= set(topology.layers_of_backward(topology.backward_workers.index(rank)))
    return sorted(out)
