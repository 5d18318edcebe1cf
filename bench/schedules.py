"""Step time and per-worker peak memory of every schedule and policy, in one run.

PipeFB (sync and async) against PipeDream with `keep`, PipeDream with `offload`, 1F1B and
GPipe, on the same model, micro-batching and number of processes (2 and 4 workers), on one
local cluster, systems interleaved. Figures are medians and ranges (min-max) over the timed
steps of all repeats; speed ratios compare per-repeat medians. Peak memory is each rank's
highest accounted peak (parameters, gradients, optimizer state, weight versions, live and
stashed activations); with `--device cuda` also each rank's CUDA allocator peak. Run:
`python bench/schedules.py [--quick] [--device cuda] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench import machine
from bench.cluster import local_client, run_interleaved
from bench.output import args_json, measured_main
from bench.stats import error_bars, fmt, summary
from pipefb.job.config import JobConfig

# name -> (schedule, mode, policy); policy "" is the schedule's default (keep; pipefb offload)
SYSTEMS: dict[str, tuple[str, str, str]] = {
    "gpipe": ("gpipe", "sync", ""),
    "1f1b": ("1f1b", "sync", ""),
    "pipedream-keep": ("pipedream", "async", "keep"),
    "pipedream-offload": ("pipedream", "async", "offload"),
    "pipefb-sync": ("pipefb", "sync", ""),
    "pipefb-async": ("pipefb", "async", ""),
}
BASELINE = "pipedream-offload"  # the published comparison: PipeFB vs PipeDream with offload
PUBLISHED = (1.48, 2.27)  # PipeFB paper: speed-up over PipeDream with offload, same peak memory
MODEL = {"model": "gpt", "dataset": "text", "loss": "cross_entropy",
         "model_config": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64},
         "dataset_config": {"block_size": 64, "max_bytes": 1_000_000}}
# --device cuda: a model large enough that kernels, not launches, take the time
GPU_MODEL = {**MODEL, "model_config": {"n_layer": 6, "n_embd": 384, "n_head": 6,
                                        "block_size": 128},
             "dataset_config": {"block_size": 128, "max_bytes": 4_000_000}}
QUICK_MODEL = {**MODEL, "model_config": {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                          "block_size": 16},
               "dataset_config": {"block_size": 16, "max_bytes": 100_000}}


def make_job(args: argparse.Namespace, name: str, workers: int) -> JobConfig:
    """The bench job of one system with `workers` workers."""
    schedule, mode, policy = SYSTEMS[name]
    spec = QUICK_MODEL if args.quick else GPU_MODEL if args.device == "cuda" else MODEL
    return JobConfig(schedule=schedule, mode=mode, policy=policy, workers=workers,
                     device=args.device, staleness=1, batch_size=args.batch,
                     microbatches=args.microbatches,
                     steps=args.warmup + args.steps, optimizer="adamw", lr=1e-3, seed=0,
                     **spec)


def rank_peaks(reports: list[Any]) -> dict[str, dict[str, Any]]:
    """Each rank's peaks over a job's step reports: its role, highest accounted peak (with
    the kinds at it), activation peak and CUDA allocator peak."""
    ranks: dict[str, dict[str, Any]] = {}
    for r in reports:
        for w in r.workers:
            entry = ranks.setdefault(str(w.rank), {"role": f"{w.role[0].upper()}{w.stage}",
                                                   "peak": 0, "kinds": {}, "activation": 0,
                                                   "device_peak": 0})
            if w.peak_memory_bytes > entry["peak"]:
                entry["peak"], entry["kinds"] = w.peak_memory_bytes, dict(w.memory_bytes)
            entry["activation"] = max(entry["activation"], w.activation_peak_bytes)
            entry["device_peak"] = max(entry["device_peak"],
                                       w.device_memory_bytes.get("allocated_peak", 0))
    return ranks


def run_job(client: Any, job: JobConfig, warmup: int) -> dict[str, Any]:
    """Step seconds after warm-up and each rank's peaks of one job."""
    reports = list(client.train(client.submit(job).job_id))
    return {"seconds": [r.seconds for r in reports[warmup:]], "losses": [r.loss for r in reports],
            "ranks": rank_peaks(reports)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system, 2 and 4 workers, `repeats` times interleaved, on one local cluster."""
    counts = [int(w) for w in args.workers.split(",")]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as logs, \
            local_client(max(counts), Path(logs), env=env) as client:
        runs = run_interleaved(counts, list(SYSTEMS), args.repeats, lambda name, n: run_job(
            client, make_job(args, name, n), args.warmup))
    job = make_job(args, "pipefb-sync", max(counts))
    return {"bench": "schedules", "machine": machine.describe(),
            "args": args_json(args),
            "job": {k: v for k, v in job.to_dict().items()
                    if k not in ("schedule", "mode", "policy", "workers")},
            "published": PUBLISHED, "baseline": BASELINE,
            "wall_seconds": time.perf_counter() - started,
            "workers": {n: summarise(per) for n, per in runs.items()}}


def summarise(per: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Step time per system, speed ratios against the baseline, peaks of the first repeat."""
    step = {s: summary([t for rep in reps for t in rep["seconds"]]) for s, reps in per.items()}
    medians = {s: [summary(rep["seconds"])["median"] for rep in reps] for s, reps in per.items()}
    speedup = {s: summary([b / t for b, t in zip(medians[BASELINE], medians[s], strict=True)])
               for s in per}
    return {"step_seconds": step, "speedup_vs_baseline": speedup,
            "ranks": {s: reps[0]["ranks"] for s, reps in per.items()},
            "max_peak_bytes": {s: max(r["peak"] for r in reps[0]["ranks"].values())
                               for s, reps in per.items()},
            "max_device_peak_bytes": {s: max(r["device_peak"] for r in reps[0]["ranks"].values())
                                      for s, reps in per.items()}}


def chart(results: dict[str, Any], path: Path) -> None:
    """Per worker count: step time per system (left), each rank's peak memory (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = list(results["workers"])
    fig, axes = plt.subplots(len(counts), 2, figsize=(12, 3.8 * len(counts)), squeeze=False)
    names = list(SYSTEMS)
    for row, n in zip(axes, counts, strict=True):
        res = results["workers"][n]
        med, err = error_bars(res["step_seconds"], names, 1e3)
        row[0].bar(range(len(names)), med, yerr=err, capsize=3, color="#4C72B0")
        row[0].set_xticks(range(len(names)), names, rotation=25, ha="right")
        row[0].set_ylabel("ms per step (median, min-max)")
        row[0].set_title(f"{n} workers: step time")
        ranks = sorted({r for s in names for r in res["ranks"][s]}, key=int)
        peak_bars(row[1], res["ranks"], names, {r: f"rank {r}" for r in ranks},
                  {"rotation": 25, "ha": "right"})
        row[1].set_ylabel("peak accounted MiB")
        row[1].set_title(f"{n} workers: peak memory per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def peak_bars(ax: Any, by_system: dict[str, dict[str, Any]], names: list[str],
              ranks: dict[str, str], ticks: dict[str, Any]) -> None:
    """Grouped bars of each system's per-rank peak accounted MiB (`ranks`: rank -> legend
    label; a system without the rank gets 0), the systems as x ticks (`ticks`: their
    text options)."""
    width = 0.8 / len(ranks)
    for k, (rank, label) in enumerate(ranks.items()):
        peaks = [by_system[s].get(rank, {}).get("peak", 0) / 2**20 for s in names]
        ax.bar([i + k * width for i in range(len(names))], peaks, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, **ticks)
    ax.legend(fontsize=7)


def print_results(results: dict[str, Any]) -> None:
    """One line per system and worker count."""
    for n, res in results["workers"].items():
        print(f"{n} workers:")
        for s in SYSTEMS:
            peak = res["max_peak_bytes"][s] / 2**20
            cuda = res["max_device_peak_bytes"][s] / 2**20
            print(f"  {s:18s} {fmt(res['step_seconds'][s], 1e3)} ms/step  "
                  f"speed vs {BASELINE} {fmt(res['speedup_vs_baseline'][s], digits=2)}  "
                  f"max rank peak {peak:.1f} MiB" + (f", cuda {cuda:.1f} MiB" if cuda else ""))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags; `--quick` picks tiny sizes for CI."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny gpt, 2 timed steps, 1 repeat")
    p.add_argument("--out", type=Path, default=None, help="write results.json and a PNG here")
    p.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    p.add_argument("--batch", type=int, default=32, help="samples per step")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=2, help="whole runs of every system")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers compute (cuda: all share this machine's GPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch = 2, 1, 1, 8
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, and writes `results.json` + `schedules.png` to `--out`."""
    return measured_main(parse_args(argv), run, print_results, chart, "schedules.png")


if __name__ == "__main__":
    main()
