"""Part 2 of bench/groups.py: group hybrid parallelism on described GPU clusters of 8 to
64 GPUs, simulated (`pipefb.sim.simulate`); no processes.

[Note: GHP bench scenario]
- Clusters: N A100-40GB-class GPUs, 8 per host (PCIe 4.0 inside a host, ~20 GB/s and
  10 us; 100 Gb/s between hosts, ~12 GB/s and 20 us; the offload store in host memory at
  12 GB/s per GPU): `bench/clusters/8gpu.yaml`'s figures, host count grown.
- Model: a GPT of 64 blocks at GPT-2-medium width (1024, 16 heads, 1024 tokens, vocab
  50257), about 0.87 B parameters, 67 layers with the embedding, head and loss: deep
  enough that one pipeline can give every one of 64 GPUs a stage, and heavy enough
  (3.6 GB of fp32 gradients) that summing gradients across groups costs real time.
  Profiled analytically as in bench/planner_sim.py ([Note: planner bench scenario]).
- Batch: 512 sequences per step, the same for every system; each of G groups takes 512/G.
- Systems, each the planner's full search (schedule, micro-batch count, partition, policy
  under the 40 GiB cap) for a fixed G, simulated over the whole cluster:
  `single pipeline` G = 1 (one pipeline over all N GPUs), `pure DP` G = N (each GPU a
  whole model), `GHP` the planner's choice (its training-time model ranks every G, the
  best three and any within 10% of the best are searched and simulated), and
  `exhaustive` the best simulated G (every G searched): how far the model's choice is
  from the best.
"""

from __future__ import annotations

import math
import time
from typing import Any

from bench.planner_sim import Scenario, gpt_profile
from pipefb.planner.groups import GroupChoice, search_groups
from pipefb.sim.cluster import Cluster, Link, WorkerSpec

GIB = 1 << 30
PER_HOST = 8  # GPUs per host
SIZES = (8, 16, 32, 64)
QUICK_SIZES = (8, 16)
SCENARIO = Scenario({"n_layer": 64, "n_embd": 1024, "n_head": 16, "block_size": 1024,
                     "vocab_size": 50257}, batch_size=512, microbatches=64)
QUICK_SCENARIO = Scenario({"n_layer": 16, "n_embd": 128, "n_head": 4, "block_size": 128,
                           "vocab_size": 4096}, batch_size=64, microbatches=16)


def gpu_cluster(n: int, per_host: int = PER_HOST) -> Cluster:
    """`n` 40 GiB GPUs, `per_host` to a host ([Note: GHP bench scenario])."""
    workers = tuple(WorkerSpec(f"gpu{i}", 1.0, 40 * GIB, f"node{i // per_host}")
                    for i in range(n))
    inside = Link(20e9, 10e-6)
    links = {frozenset((a.name, b.name)): inside
             for i, a in enumerate(workers) for b in workers[i + 1:] if a.host == b.host}
    hosts = {w.host: sum(x.host == w.host for x in workers) for w in workers}
    return Cluster(workers, network=Link(12e9, 20e-6), store=Link(12e9, 20e-6), links=links,
                   host_cores=hosts, action_overhead=20e-6, step_overhead=50e-6)


def _row(c: GroupChoice, batch: int, n: int) -> dict[str, Any]:
    """One group count's outcome: per-group plan, model and simulated times."""
    fits = c.plan is not None and math.isfinite(c.step_seconds)
    plan = c.plan
    return {"groups": c.groups, "workers_per_group": n // c.groups,
            "plan": (f"{plan.schedule} {plan.mode} x{plan.microbatches} "
                     f"(micro-batch {plan.microbatch_size})" if plan else ""),
            "partition": list(plan.forward_partition) if plan else [],
            "model_seconds": c.model_seconds,
            "step_seconds": c.step_seconds if fits else None,
            "samples_per_second": batch / c.step_seconds if fits else None,
            "note": c.note}


def one_size(profile: Any, n: int, batch: int) -> dict[str, Any]:
    """Every group count on `n` GPUs (exhaustive), and what the planner's model picks."""
    started = time.perf_counter()
    result = search_groups(profile, gpu_cluster(n), batch, exhaustive=True)
    rows = {str(c.groups): _row(c, batch, n) for c in result.choices}
    picked, best = result.by_model, result.best
    out: dict[str, Any] = {"rows": rows, "ghp_groups": picked.groups,
                           "exhaustive_groups": best.groups,
                           "ghp_over_exhaustive": best.step_seconds / picked.step_seconds,
                           "search_seconds": time.perf_counter() - started}
    for name, g in (("single_pipeline", 1), ("pure_dp", n)):
        step = rows[str(g)]["step_seconds"] if str(g) in rows else None
        out[f"ghp_vs_{name}"] = step / picked.step_seconds if step else None
    return out


def run_simulated(quick: bool) -> dict[str, Any]:
    """The simulated comparison for every cluster size, with progress."""
    sc = QUICK_SCENARIO if quick else SCENARIO
    profile = gpt_profile(sc)
    sizes: dict[str, Any] = {}
    for n in QUICK_SIZES if quick else SIZES:
        sizes[str(n)] = one_size(profile, n, sc.batch_size)
        r = sizes[str(n)]
        print(f"simulated {n} GPUs: GHP picks G={r['ghp_groups']} (exhaustive "
              f"G={r['exhaustive_groups']}), {r['search_seconds']:.0f} s", flush=True)
    return {"scenario": {"model_config": sc.model_config, "batch_size": sc.batch_size,
                         "layers": profile.n_layers, "per_host": PER_HOST,
                         "param_bytes": profile.param_bytes(range(profile.n_layers)),
                         "memory_bytes": 40 * GIB},
            "sizes": sizes}
