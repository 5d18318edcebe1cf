"""The analytic step time that ranks candidates before any is simulated (step 3 of
[Note: search])."""

from __future__ import annotations

from pipefb.plan.plan import Plan
from pipefb.planner.balance import bandwidth, boundary_bytes
from pipefb.planner.candidates import SearchSpace
from pipefb.sim.costs import kept_bytes


def estimate(space: SearchSpace, plan: Plan) -> float:
    """Analytic step time: fill and drain plus the bottleneck per micro-batch (async: the
    bottleneck per micro-batch alone, the pipeline never drains), and the step overhead.
    Ignores memory caps."""
    prof = space.profile.at(plan.microbatch_size)
    c, t = space.cluster, plan.topology()
    speed = [w.speed for w in c.workers]
    policy = plan.policy

    fwd_link = bandwidth(c, t.forward_workers)
    bwd_link = bandwidth(c, t.backward_workers)

    def f_time(s: int) -> float:
        layers = t.layers_of_forward(s)
        moved = sum(kept_bytes(prof.layers[i], policy[i]) for i in layers)
        store = c.store.seconds(moved) if t.is_split else 0.0
        return ((prof.forward_seconds(layers) + store) / speed[t.forward_workers[s]]
                + boundary_bytes(prof, layers) / fwd_link)

    def b_time(s: int) -> float:
        layers = t.layers_of_backward(s)
        rec = [i for i in layers if policy[i] == "recompute"]
        moved = sum(kept_bytes(prof.layers[i], policy[i]) for i in layers)
        store = c.store.seconds(moved) if t.is_split or "offload" in policy else 0.0
        return ((prof.backward_seconds(layers) + prof.forward_seconds(rec) + store
                 ) / speed[t.backward_workers[s]]
                + boundary_bytes(prof, layers) / bwd_link)

    fs = [f_time(s) for s in range(t.n_forward_stages)]
    bs = [b_time(s) for s in range(t.n_backward_stages)]
    hop = c.network.latency + 2 * c.action_overhead
    m = plan.microbatches
    if t.is_split:
        bottleneck = max(max(fs), max(bs))
        fill = sum(fs) + sum(bs) + (len(fs) + len(bs)) * hop
    else:
        bottleneck = max(f + b for f, b in zip(fs, bs, strict=True))
        fill = sum(fs) + sum(bs) + 2 * len(fs) * hop
    if plan.mode == "async":
        return m * bottleneck + c.step_overhead
    return (m - 1) * bottleneck + fill + c.step_overhead
