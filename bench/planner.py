"""The planner's plans against fixed schedules and the even split, simulated and measured.

Part 1 (simulated, `bench/planner_sim.py`): a described cluster of 8 A100-40GB-class GPUs
(`bench/clusters/8gpu.yaml`) and an analytic profile of a GPT-2-medium-shaped `gpt`; the
planner's best plan, its best plan per schedule, GPipe, 1F1B, PipeDream with keep and with
offload, PipeFB with offload, and each planner plan with its stages balanced by parameter
count instead; step time, samples/s, peak memory, the ratios beside the published ones
(PipeFB, vPipe, BaPipe), and PipeFB against PipeDream as the offload store gets faster.

Part 2 (measured): `plan: auto` (schedule auto, sync and async) and `plan: auto` with each
schedule fixed, against the even split (`plan: ""`, stages balanced by parameter count) of
gpipe, 1f1b, pipedream and pipefb, on 2 and 4 local workers (`pipefb.app.local.LocalServices`,
the calibrated local cluster description), for a `gpt` whose head and loss (a large
vocabulary) outweigh its blocks. Medians and ranges (min-max) over the timed steps of all
repeats; ratios compare per-repeat medians; systems interleaved.
Run: `python bench/planner.py [--quick] [--part all|simulated|measured] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.cluster import local_client, run_interleaved
from bench.output import add_part_flags, add_run_flags, run_parts
from bench.stats import error_bars, fmt, summary
from pipefb.job.config import JobConfig

FIXED = ("gpipe", "1f1b", "pipedream", "pipefb")
#: measured system -> (schedule, mode, plan); mode "" is the schedule's default
SYSTEMS: dict[str, tuple[str, str, str]] = {
    "auto": ("auto", "sync", "auto"), "auto-async": ("auto", "async", "auto"),
    **{f"{plan or 'even'}-{s}": (s, "", plan) for s in FIXED for plan in ("", "auto")},
}
#: ratio name -> (system, baseline): the planner against each schedule's even split
RATIOS = {f"{a}/even-{s}": (a, f"even-{s}") for s in FIXED for a in ("auto", f"auto-{s}")}
VOCAB = 4096  # a head (C x 4096) and loss that outweigh the blocks
MODEL: dict[str, Any] = {
    "model": "gpt", "dataset": "synthetic", "loss": "cross_entropy",
    "model_config": {"n_layer": 4, "n_embd": 64, "n_head": 4, "block_size": 64,
                     "vocab_size": VOCAB},
    "dataset_config": {"task": "tokens", "vocab_size": VOCAB, "block_size": 64}}
QUICK_MODEL: dict[str, Any] = {
    **MODEL,
    "model_config": {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 16,
                     "vocab_size": 512},
    "dataset_config": {"task": "tokens", "vocab_size": 512, "block_size": 16}}


def make_job(args: argparse.Namespace, name: str, workers: int) -> JobConfig:
    """The job of one measured system with `workers` workers."""
    schedule, mode, plan = SYSTEMS[name]
    spec = QUICK_MODEL if args.quick else MODEL
    return JobConfig(schedule=schedule, mode=mode, plan=plan, workers=workers, staleness=1,
                     batch_size=args.batch, microbatches=args.microbatches,
                     steps=args.warmup + args.steps, optimizer="adamw", lr=1e-3, seed=0,
                     **spec)


def run_job(client: Any, job: JobConfig, warmup: int) -> dict[str, Any]:
    """Step seconds after warm-up, the plan that ran and the highest rank peak of one job."""
    from protos.convert import plan_from_proto

    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    status = client.status(job_id)
    plan = plan_from_proto(status.plan)
    planner = json.loads(status.planner_json) if status.planner_json else {}
    roles = (f" {len(plan.forward_partition) - 1}F+{len(plan.backward_partition) - 1}B"
             if plan.schedule == "pipefb" else "")
    return {"seconds": [r.seconds for r in reports[warmup:]],
            "plan": {"label": f"{plan.schedule} {plan.mode}{roles} x{plan.microbatches}",
                     "forward_partition": list(plan.forward_partition),
                     "backward_partition": list(plan.backward_partition),
                     "policy": sorted(set(plan.policy)),
                     "predicted_step_seconds": planner.get("predicted_step_seconds")},
            "max_peak_bytes": max(w.peak_memory_bytes for r in reports for w in r.workers)}


def run_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Every measured system, each worker count, `repeats` times interleaved, one cluster."""
    counts = [int(w) for w in args.workers.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as tmp, \
            local_client(max(counts), Path(tmp), threads=args.threads,
                         env={"OMP_NUM_THREADS": str(args.threads)},
                         calibrated=True) as client:
        runs = run_interleaved(counts, list(SYSTEMS), args.repeats, lambda name, n: run_job(
            client, make_job(args, name, n), args.warmup))
    job = make_job(args, "even-gpipe", max(counts))
    return {"job": {k: v for k, v in job.to_dict().items()
                    if k not in ("schedule", "mode", "plan", "workers")},
            "wall_seconds": time.perf_counter() - started,
            "workers": {n: summarise(per, args.batch) for n, per in runs.items()},
            "step_seconds": {n: {s: [rep["seconds"] for rep in reps] for s, reps in per.items()}
                             for n, per in runs.items()}}


def summarise(per: dict[str, list[dict[str, Any]]], batch: int) -> dict[str, Any]:
    """Samples/s per system (per repeat: the timed steps' samples over their wall time;
    steps overlap, so single step gaps come in bursts), median and range over repeats; the
    ratios of per-repeat throughputs; the plans of the first repeat."""
    rates = {s: [batch * len(rep["seconds"]) / sum(rep["seconds"]) for rep in reps]
             for s, reps in per.items()}
    sps = {s: summary(v) for s, v in rates.items()}
    ratios = {name: summary([x / y for x, y in zip(rates[a], rates[b], strict=True)])
              for name, (a, b) in RATIOS.items()}
    return {"samples_per_second": sps, "ratios": ratios,
            "plans": {s: reps[0]["plan"] for s, reps in per.items()},
            "max_peak_bytes": {s: max(rep["max_peak_bytes"] for rep in reps)
                               for s, reps in per.items()}}


def chart(results: dict[str, Any], path: Path) -> None:
    """Simulated samples/s per system (left), measured samples/s per worker count (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = results.get("measured", {}).get("workers", {})
    panels = int("simulated" in results) + len(measured)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.5), squeeze=False)
    column = iter(axes[0])
    if "simulated" in results:
        _simulated_panel(next(column), results["simulated"])
    for n, res in measured.items():
        _measured_panel(next(column), n, res)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _simulated_panel(ax: Any, sim: dict[str, Any]) -> None:
    rows = sim["systems"]
    names = list(rows)
    values = [rows[s]["samples_per_second"] for s in names]
    colors = ["#4C72B0" if rows[s]["fits"] else "#C44E52" for s in names]
    ax.barh(range(len(names)), values, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("simulated samples/s (log; red: over the memory cap)")
    ax.set_title(f"simulated: {sim['scenario']['cluster_file']}, batch "
                 f"{sim['scenario']['batch_size']}")


def _measured_panel(ax: Any, n: str, res: dict[str, Any]) -> None:
    names = list(res["samples_per_second"])
    s = res["samples_per_second"]
    med, err = error_bars(s, names)
    colors = ["#55A868" if k.startswith("auto") else "#8172B2" for k in names]
    ax.bar(range(len(names)), med, yerr=err, capsize=3, color=colors)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("samples/s (median, min-max)")
    ax.set_title(f"measured, {n} local workers (green: plan auto)")


def print_results(results: dict[str, Any]) -> None:
    """The simulated table and ratios, then one line per measured system."""
    sim = results.get("simulated")
    if sim:
        for name, r in sim["systems"].items():
            print(f"{name:22s} {r['label']:24s} {r['step_seconds'] * 1e3:9.1f} ms "
                  f"{r['samples_per_second']:8.1f} samples/s  peak "
                  f"{r['max_peak_bytes'] / 2**30:5.1f} GiB{'' if r['fits'] else ' OVER CAP'}")
        for name, r in sim["ratios"].items():
            print(f"  {name:42s} {r['value']:5.2f}x  (published {r['published']})")
    for n, res in results.get("measured", {}).get("workers", {}).items():
        print(f"{n} workers:")
        for s, v in res["samples_per_second"].items():
            print(f"  {s:16s} {fmt(v)} samples/s  {res['plans'][s]['label']} "
                  f"{res['plans'][s]['forward_partition']}")
        for name, v in res["ratios"].items():
            print(f"  {name:22s} {fmt(v, digits=2)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags; `--quick` picks tiny sizes for CI."""
    p = argparse.ArgumentParser(description=__doc__)
    add_part_flags(p, "small simulated model; tiny gpt, 2 workers, 2 timed steps, 1 repeat")
    p.add_argument("--workers", default="2,4", help="measured: comma-separated worker counts")
    add_run_flags(p, repeats=2)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch, args.workers = 2, 1, 1, 8, "2"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, and writes `results.json` + `planner.png` to `--out`."""
    from bench.planner_sim import run_simulated

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = {"simulated": lambda: run_simulated(args.quick),
             "measured": lambda: run_measured(args)}
    return run_parts("planner", args, parts, print_results, chart, "planner.png")


if __name__ == "__main__":
    main()
