"""Group hybrid parallelism: data-parallel pipeline groups against one deeper pipeline,
measured on a local cluster and simulated on described GPU clusters.

Part 1 (measured): on 2 local workers, `1x2` (one pipeline of 2 stages) against `2x1`
(2 groups of 1 stage each: plain data parallelism, gradients summed by the gloo
all-reduce) and `auto` (the planner picks G), for bench/pipeline_throughput.py's `mlp`
and `gpt`; every system is `plan: auto` in sync mode with its group count fixed, so each
runs the planner's best per-group plan and carries its predicted step time. Samples/s
over the timed steps of each repeat, median and range (min-max) over repeats, beside the
planner's prediction; systems interleaved on one local cluster with the calibrated
cluster description.

Part 2 (simulated, `bench/groups_sim.py`): the planner's choice of G against the best
single pipeline (G = 1) and pure data parallelism (G = N) on 8 to 64 described GPUs.

Run: `python bench/groups.py [--quick] [--part all|simulated|measured] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.cluster import local_client, run_interleaved
from bench.output import add_part_flags, add_run_flags, run_parts
from bench.pipeline_throughput import MODELS, QUICK_MODELS
from bench.stats import error_bars, fmt, summary
from pipefb.job.config import JobConfig

WORKERS = 2
#: measured system -> group count (0: the planner picks)
SYSTEMS = {"1x2": 1, "2x1": 2, "auto": 0}
#: ratio name -> (system, baseline)
RATIOS = {"2x1/1x2": ("2x1", "1x2"), "auto/1x2": ("auto", "1x2")}


def make_job(args: argparse.Namespace, model: str, system: str) -> JobConfig:
    """The job of one measured system: plan auto, sync, its group count fixed."""
    spec = (QUICK_MODELS if args.quick else MODELS)[model]
    return JobConfig(schedule="auto", mode="sync", plan="auto", groups=SYSTEMS[system],
                     workers=WORKERS, batch_size=args.batch, microbatches=args.microbatches,
                     steps=args.warmup + args.steps, optimizer="adamw", lr=1e-3, seed=0,
                     **spec)


def run_job(client: Any, job: JobConfig, warmup: int) -> dict[str, Any]:
    """Measured and predicted samples/s of one job, with the plan it ran."""
    from protos.convert import plan_from_proto

    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    plan = plan_from_proto(client.status(job_id).plan)
    seconds = [r.seconds for r in reports[warmup:]]
    # steps overlap (no barrier), so reports come in bursts: the window's wall time over
    # its steps is the step time
    return {"samples_per_second": job.batch_size * len(seconds) / sum(seconds),
            "predicted_samples_per_second": job.batch_size / plan.predicted_step_seconds,
            "groups": plan.groups,
            "plan": f"{plan.groups} x {plan.schedule} {plan.mode} on "
                    f"{len(plan.assignment) // plan.groups} worker(s), {plan.microbatches} "
                    f"x {plan.microbatch_size} per group",
            "loss": reports[-1].loss}


def run_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Every model and system, `repeats` times interleaved, on one local cluster."""
    started = time.perf_counter()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as tmp, \
            local_client(WORKERS, Path(tmp), threads=args.threads,
                         env={"OMP_NUM_THREADS": str(args.threads)},
                         calibrated=True) as client:
        for model in args.models.split(","):
            def one(system: str, _: int, model: str = model) -> dict[str, Any]:
                return run_job(client, make_job(args, model, system), args.warmup)

            runs = run_interleaved([WORKERS], list(SYSTEMS), args.repeats, one)[str(WORKERS)]
            out[model] = summarise(runs)
            out[model]["job"] = {k: v for k, v in make_job(args, model, "1x2").to_dict().items()
                                 if k not in ("groups", "steps")}
    return {"models": out, "wall_seconds": time.perf_counter() - started}


def summarise(per: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Measured and predicted samples/s per system, the ratios of per-repeat throughputs,
    each system's plan and group count (first repeat) and final losses."""
    rates = {s: [rep["samples_per_second"] for rep in reps] for s, reps in per.items()}
    return {
        "samples_per_second": {s: summary(v) for s, v in rates.items()},
        "predicted_samples_per_second": {
            s: summary([rep["predicted_samples_per_second"] for rep in reps])
            for s, reps in per.items()},
        "ratios": {name: summary([x / y for x, y in zip(rates[a], rates[b], strict=True)])
                   for name, (a, b) in RATIOS.items()},
        "predicted_ratios": {name: per[a][0]["predicted_samples_per_second"]
                             / per[b][0]["predicted_samples_per_second"]
                             for name, (a, b) in RATIOS.items()},
        "plans": {s: reps[0]["plan"] for s, reps in per.items()},
        "groups": {s: reps[0]["groups"] for s, reps in per.items()},
        "final_loss": {s: [rep["loss"] for rep in reps] for s, reps in per.items()},
    }


def chart(results: dict[str, Any], path: Path) -> None:
    """Measured against predicted samples/s per model (left), simulated samples/s against
    cluster size for the GHP choice, the single pipeline and pure DP (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = results.get("measured", {}).get("models", {})
    panels = len(measured) + int("simulated" in results)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5), squeeze=False)
    column = iter(axes[0])
    for model, res in measured.items():
        _measured_panel(next(column), model, res)
    if "simulated" in results:
        _simulated_panel(next(column), results["simulated"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _measured_panel(ax: Any, model: str, res: dict[str, Any]) -> None:
    names = list(res["samples_per_second"])
    s, p = res["samples_per_second"], res["predicted_samples_per_second"]
    med, err = error_bars(s, names)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], med, 0.4, yerr=err, capsize=3, label="measured",
           color="#4C72B0")
    ax.bar([i + 0.2 for i in x], [p[k]["median"] for k in names], 0.4, label="predicted",
           color="#DD8452")
    ax.set_xticks(list(x), [f"{k}\nG={res['groups'][k]}" for k in names])
    ax.set_ylabel("samples/s (measured: median, min-max)")
    ax.set_title(f"{model}: {WORKERS} local workers")
    ax.legend()


def _simulated_panel(ax: Any, sim: dict[str, Any]) -> None:
    sizes = sorted(sim["sizes"], key=int)
    batch = sim["scenario"]["batch_size"]

    def rate(n: str, g: str) -> float:
        row = sim["sizes"][n]["rows"].get(g)
        return row["samples_per_second"] if row and row["samples_per_second"] else float("nan")

    xs = [int(n) for n in sizes]
    ax.plot(xs, [rate(n, str(sim["sizes"][n]["ghp_groups"])) for n in sizes], "o-",
            label="GHP (planner's G)")
    ax.plot(xs, [rate(n, "1") for n in sizes], "s--", label="single pipeline (G=1)")
    ax.plot(xs, [rate(n, n) for n in sizes], "^--", label="pure DP (G=N)")
    for n in sizes:
        ax.annotate(f"G={sim['sizes'][n]['ghp_groups']}", (int(n), rate(n, str(
            sim["sizes"][n]["ghp_groups"]))), textcoords="offset points", xytext=(4, 6),
            fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("GPUs (described, 8 per host)")
    ax.set_ylabel(f"simulated samples/s (batch {batch})")
    ax.set_title("simulated: GHP vs single pipeline vs pure DP")
    ax.legend(fontsize=8)


def print_results(results: dict[str, Any]) -> None:
    """One line per measured system, then each simulated size's group counts."""
    for model, res in results.get("measured", {}).get("models", {}).items():
        print(f"{model}:")
        for s, v in res["samples_per_second"].items():
            print(f"  {s:5s} {fmt(v)} samples/s, predicted "
                  f"{res['predicted_samples_per_second'][s]['median']:.1f}  {res['plans'][s]}")
        for name, v in res["ratios"].items():
            print(f"  {name:9s} {fmt(v, digits=2)} (predicted "
                  f"{res['predicted_ratios'][name]:.2f})")
    for n, r in results.get("simulated", {}).get("sizes", {}).items():
        print(f"{n} GPUs: GHP G={r['ghp_groups']} (exhaustive G={r['exhaustive_groups']}); "
              + ", ".join(f"G={g} {row['step_seconds'] * 1e3:.0f} ms" if row["step_seconds"]
                          else f"G={g} -" for g, row in r["rows"].items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags; `--quick` picks tiny sizes for CI."""
    p = argparse.ArgumentParser(description=__doc__)
    add_part_flags(p, "tiny models, 2 timed steps, 1 repeat; small simulated clusters")
    p.add_argument("--models", default="mlp,gpt", help="measured: comma-separated models")
    add_run_flags(p, repeats=3)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch = 2, 1, 1, 8
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, and writes `results.json` + `groups.png` to `--out`."""
    from bench.groups_sim import run_simulated

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = {"measured": lambda: run_measured(args),
             "simulated": lambda: run_simulated(args.quick)}
    return run_parts("groups", args, parts, print_results, chart, "groups.png")


if __name__ == "__main__":
    main()
