"""Samples/s of one job under single, pipefb 1f1b, pipefb pipefb and torch pipelining, in one run.

Same model, data, micro-batching, optimizer and 2-stage split for every system. Figures are
medians and ranges (min-max) over the steps after warm-up; ratios compare medians within
each repeat. Run: `python bench/pipeline_throughput.py [--quick] [--out DIR]`.
Targets: 1f1b / torch-pipelining >= 1.0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import machine, torch_pipelining
from bench.output import args_json, measured_main
from bench.stats import error_bars, fmt, ratio, summary
from pipefb.job.config import JobConfig, build_layers, layer_costs
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import Plan
from pipefb.runtime.reference import SingleProcess

SYSTEMS = ("single", "pipefb-1f1b", "pipefb-pipefb", "torch-1f1b")
RATIOS = (("pipefb-1f1b", "torch-1f1b"), ("pipefb-pipefb", "pipefb-1f1b"),
          ("pipefb-1f1b", "single"), ("pipefb-pipefb", "single"), ("torch-1f1b", "single"))
TARGETS = {"pipefb-1f1b/torch-1f1b": 1.0}  # ratio >= target
WORKERS = 2  # both pipelines use 2 processes

# Model and data per bench model; `--quick` shrinks them (see `sizes`).
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"model": "gpt", "dataset": "text", "loss": "cross_entropy",
            "model_config": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64},
            "dataset_config": {"block_size": 64, "max_bytes": 1_000_000}},
    "mlp": {"model": "mlp", "dataset": "digits", "loss": "cross_entropy",
            "model_config": {"hidden": 512, "depth": 4}},
}
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "gpt": {**MODELS["gpt"],
            "model_config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16},
            "dataset_config": {"block_size": 16, "max_bytes": 100_000}},
    "mlp": {**MODELS["mlp"], "model_config": {"hidden": 32, "depth": 3}},
}


def make_job(spec: dict[str, Any], args: argparse.Namespace) -> JobConfig:
    """The bench job of one model; `schedule` is replaced per system."""
    return JobConfig(schedule="1f1b", workers=WORKERS, batch_size=args.batch,
                     microbatches=args.microbatches, steps=args.warmup + args.steps,
                     optimizer="adamw", lr=1e-3, seed=0, **spec)


def two_stage_plan(job: JobConfig, schedule: str = "1f1b") -> Plan:
    """The coordinator's balanced 2-worker plan of `schedule` for the job."""
    costs = layer_costs(build_layers(job))
    return balanced_plan(schedule, WORKERS, costs, job.batch_size, job.microbatches)


def stage_boundary(job: JobConfig) -> int:
    """First layer of stage 1 in the coordinator's 2-worker 1f1b plan."""
    return two_stage_plan(job).forward_partition[1]


def run_single(job: JobConfig) -> tuple[list[float], list[float]]:
    """(step seconds, step losses) of the in-process reference."""
    steps = list(SingleProcess(replace(job, schedule="single")).run())
    return [s.seconds for s in steps], [s.loss for s in steps]


def run_cluster(client: Any, job: JobConfig) -> tuple[list[float], list[float], dict[str, Any]]:
    """(step seconds, losses, per-rank compute/idle seconds) of one job on the cluster."""
    reports = list(client.train(client.submit(job).job_id))
    ranks: dict[str, Any] = {}
    for r in reports:
        for w in r.workers:
            entry = ranks.setdefault(f"{w.rank}:{w.role}", {"compute": [], "idle": []})
            entry["compute"].append(w.compute_seconds)
            entry["idle"].append(w.idle_seconds)
    return [r.seconds for r in reports], [r.loss for r in reports], ranks


def one_repeat(client: Any, job: JobConfig, boundary: int, args: argparse.Namespace
               ) -> dict[str, Any]:
    """Every system once on `job`: step seconds, losses and rank times per system."""
    out: dict[str, Any] = {}
    seconds, losses = run_single(job)
    out["single"] = {"seconds": seconds, "losses": losses}
    for schedule in ("1f1b", "pipefb"):
        seconds, losses, ranks = run_cluster(client, replace(job, schedule=schedule))
        out[f"pipefb-{schedule}"] = {"seconds": seconds, "losses": losses, "ranks": ranks}
    torch_run = torch_pipelining.run(job, boundary, "1f1b", args.threads)
    out["torch-1f1b"] = {k: torch_run[k] for k in ("seconds", "losses")}
    return out


def summarise(job: JobConfig, repeats: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Throughput per system (pooled steps after warm-up), ratios (per repeat), loss checks."""
    sps = {s: [job.batch_size / t for rep in repeats for t in rep[s]["seconds"][warmup:]]
           for s in SYSTEMS}
    per_repeat = [{s: summary([job.batch_size / t for t in rep[s]["seconds"][warmup:]])["median"]
                   for s in SYSTEMS} for rep in repeats]
    ratios = {f"{a}/{b}": summary([r[a] / r[b] for r in per_repeat]) for a, b in RATIOS}
    reference = repeats[0]["single"]["losses"]
    loss_diff = {s: max(abs(x - y) for x, y in zip(repeats[0][s]["losses"], reference,
                                                   strict=True)) for s in SYSTEMS}
    ranks = {s: {k: {"compute": summary(v["compute"][warmup:])["median"],
                     "idle": summary(v["idle"][warmup:])["median"]}
                 for k, v in repeats[0][s]["ranks"].items()}
             for s in SYSTEMS if "ranks" in repeats[0][s]}
    return {"samples_per_second": {s: summary(v) for s, v in sps.items()},
            "per_repeat_median_samples_per_second": per_repeat,
            "ratios": ratios,
            "pooled_ratio_range": {f"{a}/{b}": ratio(sps[a], sps[b]) for a, b in RATIOS},
            "max_loss_diff_vs_single": loss_diff, "rank_seconds_median": ranks}


def chart(results: dict[str, Any], path: Path) -> None:
    """Grouped bars of median samples/s per model and system, error bars = min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        tp = results["models"][name]["samples_per_second"]
        med, err = error_bars(tp, SYSTEMS)
        ax.bar(range(len(SYSTEMS)), med, yerr=err, capsize=4,
               color=["#888888", "#1f77b4", "#2ca02c", "#d62728"])
        ax.set_xticks(range(len(SYSTEMS)), SYSTEMS, rotation=20)
        ax.set_ylabel("samples/s (median, min-max)")
        ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the bench's flags; `--quick` picks tiny sizes for CI."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny mlp, 2 timed steps, 1 repeat (CI)")
    p.add_argument("--out", type=Path, default=None, help="write results.json and a PNG here")
    p.add_argument("--models", default=None,
                   help="comma-separated: gpt, mlp (default both; mlp alone with --quick)")
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3, help="whole runs of every system")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in every process: single, workers, torch ranks "
                        "(0: torch's default)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    if args.models is None:
        args.models = "mlp" if args.quick else "gpt,mlp"
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every system on every model `args.repeats` times on one local cluster."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    specs = QUICK_MODELS if args.quick else MODELS
    names = [m for m in args.models.split(",") if m]
    jobs = {m: make_job(specs[m], args) for m in names}
    repeats: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as logs, \
            LocalServices(WORKERS, Path(logs), extra_env=env) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(WORKERS)
        for r in range(args.repeats):
            for m in names:
                repeats[m].append(one_repeat(client, jobs[m], stage_boundary(jobs[m]), args))
                print(f"repeat {r + 1}/{args.repeats} {m} done "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    models = {m: {"job": jobs[m].to_dict(), "boundary": stage_boundary(jobs[m]),
                  "layers": len(build_layers(jobs[m])),
                  **summarise(jobs[m], repeats[m], args.warmup)} for m in names}
    return {"bench": "pipeline_throughput", "machine": machine.describe(),
            "args": args_json(args),
            "command": " ".join(["python", "bench/pipeline_throughput.py", *sys.argv[1:]]),
            "single_threads": torch.get_num_threads(), "targets": TARGETS,
            "wall_seconds": time.perf_counter() - started, "models": models}


def print_results(results: dict[str, Any]) -> None:
    """One line per system and per ratio."""
    for name, res in results["models"].items():
        print(f"{name} (stage boundary at layer {res['boundary']} of {res['layers']}):")
        for s in SYSTEMS:
            print(f"  {s:14s} {fmt(res['samples_per_second'][s])} samples/s  "
                  f"loss diff vs single {res['max_loss_diff_vs_single'][s]:.1e}")
        for key, value in res["ratios"].items():
            target = TARGETS.get(key)
            verdict = "" if target is None else (
                f"  target >= {target}: {'meets' if value['median'] >= target else 'MISSES'}")
            print(f"  {key:28s} {fmt(value, digits=2)}{verdict}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, and writes `results.json` + `throughput.png` to `--out`."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return measured_main(parse_args(argv), run, print_results, chart, "throughput.png")


if __name__ == "__main__":
    main()
