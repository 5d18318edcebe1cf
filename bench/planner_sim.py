"""Part 1 of bench/planner.py: the planner against fixed baseline plans on a described
8-GPU cluster, simulated (`pipefb.sim.simulate`); no processes.

[Note: planner bench scenario]
- Cluster: `bench/clusters/8gpu.yaml`, 8 A100-40GB-class workers on 2 hosts (PCIe inside a
  host, 100 Gb/s between hosts, offload store in host memory at 12 GB/s per worker).
- Model: a GPT-2-medium-shaped `gpt` (24 blocks, width 1024, 16 heads, 1024 tokens, vocab
  50257): 27 layers with the embedding, head and loss. Its blocks are identical, so one
  block is profiled and its row repeated (the same figures at 1/24 of the work).
- Device: `analytic_profile` at 60 TFLOP/s and 1.3 TB/s (`Device`). Tensors are fp32, as
  pipefb's models run, so the rate is TF32's (156 TFLOP/s peak on an A100) at ~40%
  utilisation. fp16 at ~100 TFLOP/s would halve every byte too: compute and transfers
  scale about alike, so the ratios below would barely move.
- The profile is taken at 1 sample per micro-batch (one 1024-token sequence: a forward
  runs once on CPU for the stash bytes) and rescaled by `Profile.at`. Its fixed part is
  set to the launch plus the parameter traffic, which do not grow with samples
  (`analytic_profile` counts only the launch as fixed), so the rescaled times equal a
  profile taken at the full micro-batch.
- Batch: 256 sequences in 32 micro-batches of 8 (8192 tokens), the same for every system
  (one row, `planner-free-m`, lets the planner pick the micro-batch count). Cap: each
  GPU's 40 GiB, of which the planner plans to use 90% (`MEMORY_MARGIN`); a system "fits"
  when every worker's simulated peak stays within that same 36 GiB. With this
  micro-batch, PipeDream and 1F1B keeping every activation do not fit on their busiest
  GPU: they must offload or recompute some layers.
- Baselines are the systems as published: GPipe re-materialises (recompute every layer),
  1F1B and PipeDream keep; PipeDream with offload and PipeFB offload every layer. GPipe
  and 1F1B use the even split (`plan: ""`: stages balanced by parameter count); PipeDream
  and PipeFB stages are balanced by each layer's time under their policy (their own
  planners balance time), PipeFB's forward/backward worker split is the best of 1..7.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.stats import summary
from pipefb.job.config import JobConfig
from pipefb.plan.partition import partition
from pipefb.plan.plan import Plan, WorkerAssignment
from pipefb.planner.balance import pass_times as planner_pass_times
from pipefb.planner.candidates import PlanSearch
from pipefb.planner.search import MEMORY_MARGIN, search
from pipefb.schedule import KINDS
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.costs import LayerProfile, Profile
from pipefb.sim.simulate import simulate

CLUSTER_FILE = Path(__file__).resolve().parent / "clusters" / "8gpu.yaml"
STALENESS = 1  # async PipeFB: forwards of step k use weight version k - 1
#: (system suffix, schedule kind, mode) of every schedule the planner is asked about
KIND_MODES = (("gpipe", "gpipe", "sync"), ("1f1b", "1f1b", "sync"),
              ("pipedream", "pipedream", "async"), ("pipefb-sync", "pipefb", "sync"),
              ("pipefb-async", "pipefb", "async"))
STORE_SWEEP = (6e9, 12e9, 25e9, 50e9, 100e9, 200e9)  # store bytes/s of the offload sweep
#: ratio name -> (faster system, baseline system, published figure it stands beside)
RATIOS: dict[str, tuple[str, str, str]] = {
    "pipefb-offload / pipedream-offload": (
        "pipefb-offload", "pipedream-offload", "PipeFB: 1.48-2.27x, same peak memory"),
    "planner-pipefb-async / pipedream-offload": (
        "planner-pipefb-async", "pipedream-offload", "PipeFB: 1.48-2.27x, same peak memory"),
    "planner / pipedream-keep": ("planner", "pipedream-keep", "vPipe: +61-463% (1.61-5.63x)"),
    "planner / gpipe": ("planner", "gpipe", "vPipe: +25-291% over GPipe (1.25-3.91x)"),
    "planner / 1f1b": ("planner", "1f1b", "BaPipe: up to 3.2x"),
    **{f"planner-{s} / even-{s}": (f"planner-{s}", f"even-{s}",
                                   "BaPipe: up to 3.2x (balanced partitions)")
       for s, _, _ in KIND_MODES},
}


@dataclass(frozen=True)
class Device:
    """The rates of one speed-1.0 worker (see [Note: planner bench scenario])."""

    flops_per_second: float = 60e12  # TF32 tensor cores, 156 TFLOP/s peak, ~40% reached
    bytes_per_second: float = 1.3e12  # HBM2, 1.56 TB/s peak, ~85% reached when streaming
    launch_seconds: float = 10e-6  # per layer call: a few kernel launches


@dataclass(frozen=True)
class Scenario:
    """The model, batch and device of the simulated comparison."""

    model_config: dict[str, Any]  # `gpt` config; n_layer identical blocks
    batch_size: int  # sequences per step
    microbatches: int  # micro-batches per step, every system
    device: Device = field(default_factory=Device)
    store_sweep: tuple[float, ...] = STORE_SWEEP  # store bytes/s of the offload sweep

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch."""
        return self.batch_size // self.microbatches


SCENARIO = Scenario({"n_layer": 24, "n_embd": 1024, "n_head": 16, "block_size": 1024,
                     "vocab_size": 50257}, batch_size=256, microbatches=32)
QUICK_SCENARIO = Scenario({"n_layer": 24, "n_embd": 128, "n_head": 4, "block_size": 128,
                           "vocab_size": 4096}, batch_size=32, microbatches=8,
                          store_sweep=(12e9, 100e9))


# -- the profile ------------------------------------------------------------------------------


def gpt_profile(sc: Scenario) -> Profile:
    """The scenario's analytic profile: one block profiled, its row repeated n_layer times,
    fixed parts set to launch plus parameter traffic (see [Note: planner bench scenario])."""
    from pipefb.profile.analytic import analytic_profile

    cfg = sc.model_config
    job = JobConfig(model="gpt", dataset="synthetic", loss="cross_entropy", schedule="gpipe",
                    workers=1, batch_size=sc.batch_size, microbatches=sc.microbatches,
                    model_config={**cfg, "n_layer": 1},
                    dataset_config={"task": "tokens", "vocab_size": cfg["vocab_size"],
                                    "block_size": cfg["block_size"]})
    d = sc.device
    one = analytic_profile(job, 1, d.flops_per_second, d.bytes_per_second, d.launch_seconds)
    rows = [_fixed_parts(x, d) for x in one.layers]
    names = [x.name for x in rows]
    if names != ["Embedding", "Block", "Head", "CrossEntropy"]:
        raise RuntimeError(f"unexpected gpt layers {names}")
    layers = (rows[0], *[rows[1]] * cfg["n_layer"], rows[2], rows[3])
    return replace(one, layers=layers).at(sc.microbatch_size)


def _fixed_parts(x: LayerProfile, d: Device) -> LayerProfile:
    """A forward reads the parameters once, a backward reads them and writes their
    gradients: traffic that does not grow with samples."""
    params = x.param_bytes / d.bytes_per_second
    return replace(x, forward_fixed_seconds=min(x.forward_seconds, d.launch_seconds + params),
                   backward_fixed_seconds=min(x.backward_seconds,
                                              d.launch_seconds + 2 * params))


# -- plans ------------------------------------------------------------------------------------

#: a pass ("combined", "forward", "backward") -> the per-layer cost its stages balance
Costs = Callable[[str], list[float]]


def pass_times(profile: Profile, store: Link, policy: Sequence[str]) -> Costs:
    """Per-layer time of each pass under `policy`, store traffic included: the rule the
    planner balances stages by (`pipefb.planner.search`, [Note: search] step 1)."""
    return lambda which: planner_pass_times(profile, store, policy, which)


def param_costs(profile: Profile) -> Costs:
    """The even split's cost of every pass: 1 + parameter count
    (`pipefb.job.config.layer_costs` of the fp32 layers), as `plan: ""` balances."""
    costs = [1.0 + x.param_bytes / 4 for x in profile.layers]
    return lambda which: costs


def make_plan(kind: str, mode: str, policy: Sequence[str], n_fwd: int, costs: Costs,
              sc: Scenario, workers: int) -> Plan:
    """A plan of `kind` whose stages balance `costs` (PipeFB: `n_fwd` forward workers)."""
    if kind == "pipefb":
        fwd = partition(costs("forward"), n_fwd)
        bwd = partition(costs("backward"), workers - n_fwd)
        roles = (tuple(WorkerAssignment(r, "forward", r) for r in range(n_fwd))
                 + tuple(WorkerAssignment(n_fwd + s, "backward", s)
                         for s in range(workers - n_fwd)))
    else:
        fwd = bwd = partition(costs("combined"), workers)
        roles = tuple(WorkerAssignment(r, "combined", r) for r in range(workers))
    return Plan(schedule=kind, microbatches=sc.microbatches, microbatch_size=sc.microbatch_size,
                forward_partition=fwd, backward_partition=bwd, policy=tuple(policy),
                assignment=roles, mode=mode,
                staleness=STALENESS if kind == "pipefb" and mode == "async" else 0)


def row(plan: Plan, profile: Profile, cluster: Cluster, sc: Scenario, note: str = ""
        ) -> dict[str, Any]:
    """One system's simulated outcome as a JSON-able row."""
    sim = simulate(plan, profile, cluster, check=False)  # a deadlock still raises
    peaks = {str(r): b for r, b in sorted(sim.peak_memory.items())}
    n_fwd = len(plan.forward_partition) - 1
    roles = f" {n_fwd}F+{len(plan.backward_partition) - 1}B" if plan.schedule == "pipefb" else ""
    return {"label": f"{plan.schedule} {plan.mode}{roles} x{plan.microbatches}",
            "schedule": plan.schedule, "mode": plan.mode, "microbatches": plan.microbatches,
            "forward_partition": list(plan.forward_partition),
            "backward_partition": list(plan.backward_partition),
            "policy": ", ".join(f"{p} {n}" for p, n in Counter(plan.policy).items()),
            "policy_layers": list(plan.policy),
            "step_seconds": sim.step_seconds,
            "samples_per_second": sc.batch_size / sim.step_seconds,
            "bubble_fraction": sim.bubble_fraction, "peak_bytes": peaks,
            "max_peak_bytes": sim.max_peak_memory,
            "fits": all(b <= MEMORY_MARGIN * cluster.workers[r].memory
                        for r, b in sim.peak_memory.items()),
            "note": note}


def fastest(plans: Sequence[Plan], profile: Profile, cluster: Cluster) -> Plan:
    """The plan of `plans` with the shortest simulated step."""
    return min(plans, key=lambda p: simulate(p, profile, cluster, check=False).step_seconds)


# -- the systems ------------------------------------------------------------------------------


def baseline_plans(profile: Profile, cluster: Cluster, sc: Scenario) -> dict[str, Plan]:
    """GPipe, 1F1B, PipeDream (keep, offload) and PipeFB (offload) as published."""
    n, layers = cluster.size, profile.n_layers
    even = param_costs(profile)

    def timed(kind: str, mode: str, policy: str, n_fwd: int) -> Plan:
        per_layer = (policy,) * layers
        return make_plan(kind, mode, per_layer, n_fwd, pass_times(profile, cluster.store,
                                                                  per_layer), sc, n)

    return {
        "gpipe": make_plan("gpipe", "sync", ("recompute",) * layers, n, even, sc, n),
        "1f1b": make_plan("1f1b", "sync", ("keep",) * layers, n, even, sc, n),
        "pipedream-keep": timed("pipedream", "async", "keep", n),
        "pipedream-offload": timed("pipedream", "async", "offload", n),
        "pipefb-offload": fastest([timed("pipefb", "async", "offload", f) for f in range(1, n)],
                                  profile, cluster),
    }


def planner_searches(profile: Profile, cluster: Cluster, sc: Scenario
                     ) -> dict[str, PlanSearch]:
    """The planner's answer per schedule, over every schedule (best of sync and async), and
    with the micro-batch count left to it."""
    def best(schedules: Sequence[str], modes: Sequence[str], fixed: bool = True) -> PlanSearch:
        counts = [sc.microbatches] if fixed else None
        return min((search(profile, cluster, sc.batch_size, schedules=schedules, mode=m,
                           staleness=STALENESS, microbatches=counts) for m in modes),
                   key=lambda r: r.best.step_seconds)

    out = {f"planner-{name}": best((kind,), (mode,)) for name, kind, mode in KIND_MODES}
    out["planner"] = best(KINDS, ("sync", "async"))
    out["planner-free-m"] = best(KINDS, ("sync", "async"), fixed=False)
    return out


def even_plan(plan: Plan, profile: Profile, sc: Scenario) -> Plan:
    """`plan` with its stages balanced by parameter count instead (same schedule, roles and
    policy): what the planner's partition gains over the even split."""
    n_fwd = len(plan.forward_partition) - 1
    workers = len(plan.assignment)
    return make_plan(plan.schedule, plan.mode, plan.policy, n_fwd, param_costs(profile), sc,
                     workers)


def system_plans(profile: Profile, cluster: Cluster, sc: Scenario
                 ) -> dict[str, tuple[Plan, str]]:
    """Every system's plan and a note: baselines, the planner's plans, their even twins."""
    plans = {name: (p, "as published") for name, p in baseline_plans(profile, cluster,
                                                                      sc).items()}
    for name, result in planner_searches(profile, cluster, sc).items():
        plans[name] = (result.plan, f"planner's choice: {result.best.label}")
    for name, _, _ in KIND_MODES:
        plans[f"even-{name}"] = (even_plan(plans[f"planner-{name}"][0], profile, sc),
                                 f"planner-{name} with parameter-balanced stages")
    return plans


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Speed ratios (samples/s of the first over the second) beside the published figures."""
    return {name: {"value": rows[b]["step_seconds"] / rows[a]["step_seconds"],
                   "faster": a, "baseline": b, "published": published,
                   "same_cap": rows[a]["fits"] and rows[b]["fits"]}
            for name, (a, b, published) in RATIOS.items()}


def store_sweep(profile: Profile, cluster: Cluster, sc: Scenario) -> list[dict[str, Any]]:
    """PipeFB against PipeDream, both offloading every layer, as the store gets faster."""
    out = []
    for bandwidth in sc.store_sweep:
        faster = replace(cluster, store=Link(bandwidth, cluster.store.latency))
        plans = baseline_plans(profile, faster, sc)
        pd, fb = (row(plans[k], profile, faster, sc)
                  for k in ("pipedream-offload", "pipefb-offload"))
        out.append({"store_bytes_per_second": bandwidth,
                    "pipedream_offload_seconds": pd["step_seconds"],
                    "pipefb_offload_seconds": fb["step_seconds"],
                    "pipefb_label": fb["label"],
                    "ratio": pd["step_seconds"] / fb["step_seconds"],
                    "max_peak_bytes": {"pipedream-offload": pd["max_peak_bytes"],
                                       "pipefb-offload": fb["max_peak_bytes"]}})
    return out


def planning_seconds(repeats: int = 5, layers: int = 200, workers: int = 64
                     ) -> dict[str, Any]:
    """Wall time of `search` for `layers` random layers on `workers` equal workers, every
    schedule kind (the issue's target: under 2 s for 200 on 64): median and range."""
    import random

    rng = random.Random(3)
    profile = Profile(2, tuple(LayerProfile(
        f"l{i}", rng.uniform(1e-4, 2e-3), rng.uniform(2e-4, 4e-3), rng.randrange(1, 1 << 16),
        rng.randrange(1, 1 << 16), rng.randrange(1, 1 << 18), rng.randrange(0, 1 << 20))
        for i in range(layers)), optimizer_seconds_per_byte=1e-10, optimizer_state_ratio=2.0)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        search(profile, Cluster.uniform(workers), 64)
        times.append(time.perf_counter() - started)
    return {"layers": layers, "workers": workers, "seconds": summary(times)}


def run_simulated(quick: bool, cluster_file: Path = CLUSTER_FILE) -> dict[str, Any]:
    """Part 1: profile, plan and simulate every system; the ratios and the store sweep."""
    started = time.perf_counter()
    sc = QUICK_SCENARIO if quick else SCENARIO
    cluster = Cluster.load(cluster_file)
    profile = gpt_profile(sc)
    profiled = time.perf_counter() - started
    rows = {name: row(plan, profile, cluster, sc, note)
            for name, (plan, note) in system_plans(profile, cluster, sc).items()}
    return {"scenario": {"model": "gpt", "model_config": sc.model_config,
                         "batch_size": sc.batch_size, "microbatches": sc.microbatches,
                         "microbatch_size": sc.microbatch_size,
                         "device": asdict(sc.device), "cluster_file": cluster_file.name,
                         "cap_bytes": min(w.memory for w in cluster.workers),
                         "margin": MEMORY_MARGIN,
                         "cluster": cluster.to_dict(), "staleness": STALENESS},
            "profile": _profile_summary(profile),
            "systems": rows, "ratios": ratios(rows),
            "store_sweep": store_sweep(profile, cluster, sc),
            "planning_time": planning_seconds(repeats=1 if quick else 5),
            "profile_seconds": profiled, "wall_seconds": time.perf_counter() - started}


def _profile_summary(profile: Profile) -> dict[str, Any]:
    """Per distinct layer kind: ms forward and backward, MiB saved and of parameters."""
    kinds: dict[str, dict[str, float]] = {}
    for x in profile.layers:
        kinds.setdefault(x.name, {
            "forward_ms": x.forward_seconds * 1e3, "backward_ms": x.backward_seconds * 1e3,
            "saved_mib": x.saved_bytes / 2**20, "output_mib": x.output_bytes / 2**20,
            "param_mib": x.param_bytes / 2**20})
    return {"microbatch_size": profile.microbatch_size, "layers": profile.n_layers,
            "kinds": kinds}
