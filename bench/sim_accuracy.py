"""Simulated against measured step time of local runs: gpt and mlp, 2-4 workers, every schedule.

Each run is one `plan: auto` job with its schedule fixed: the coordinator profiles the
layers on its workers (each worker once per model: later runs reuse its reply, [Note:
profile reuse]), plans the partition and policy, simulates the plan on this machine's
calibrated cluster (`calibration.cluster`) and trains it. Two predictions are compared
with the measured step time of the steps after warm-up (their wall time over their count:
steps overlap, so single gaps come in bursts; error: simulated / measured - 1): the
planner's, from the profile measured on idle workers, and the in-situ one, the same plan
simulated with costs fitted to the action times of steps 1-8 (`pipefb.planner.insitu.STEPS`);
the timed steps come after those. Run: `python bench/sim_accuracy.py [--quick] [--out DIR]`.
Target: |error| <= 15% for every run.

[Note: repeated runs]
On a shared machine the same job's step time varies from one minute to the next, and a
slow spell only ever slows; the calibration (the store's bandwidth, the gRPC latency)
varies too, and every prediction of a round starts from one calibration. With one run per
job on one calibration, a run's error would be as much the machine's minute as the
simulator's. So every job runs `--repeats` times (5 by default), in rounds: each round
starts a fresh local cluster, measures this machine again for it (`--cached-cluster`:
the cached calibration instead; the user's cache is left alone), profiles afresh and runs
every job once, so a slow spell or an odd calibration lands on one run of several jobs,
not on every run of one. A job's row is its run of median error, with that run's step
time, prediction and in-situ fit; `trials` keeps every run's, and the page gives the
range of the step times.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import machine
from bench.cluster import local_client
from bench.output import args_json, write_results
from bench.pipeline_throughput import MODELS
from bench.pipeline_throughput import QUICK_MODELS as THROUGHPUT_QUICK
from bench.stats import summary
from pipefb.job.config import JobConfig
from pipefb.planner.insitu import STEPS as IN_SITU
from pipefb.planner.insitu import median_action_seconds

TARGET = 0.15  # |simulated / measured - 1|
#: timed steps per run by model: mlp's steps are much shorter than gpt's, so it runs more
#: of them, giving each run a comparable span of steps that one scheduler hiccup cannot
#: move by much
STEPS = {"gpt": 16, "mlp": 160}
SCHEDULES = ("gpipe", "1f1b", "pipedream", "pipefb")
# the throughput bench's models; the quick mlp (all that quick mode runs) is a little wider
QUICK_MODELS: dict[str, dict[str, Any]] = {
    **THROUGHPUT_QUICK, "mlp": {**MODELS["mlp"], "model_config": {"hidden": 64, "depth": 3}}}


def make_job(args: argparse.Namespace, model: str, schedule: str, workers: int) -> JobConfig:
    """One run: `plan: auto` with the schedule fixed (pipefb needs an even worker count)."""
    spec = (QUICK_MODELS if args.quick else MODELS)[model]
    return JobConfig(schedule=schedule, plan="auto", workers=workers, batch_size=args.batch,
                     microbatches=args.microbatches,
                     steps=args.warmup + timed_steps(args, model),
                     optimizer="adamw", lr=1e-3, seed=0, **spec)


def timed_steps(args: argparse.Namespace, model: str) -> int:
    """Timed steps of a run of `model`: `--steps`, else the model's `STEPS`."""
    return int(args.steps or STEPS[model])


def runs(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(model, schedule, workers) of every run; pipefb splits workers evenly, so 2 or 4."""
    counts = [int(w) for w in args.workers.split(",")]
    return [(m, s, n) for m in args.models.split(",") for n in counts for s in SCHEDULES
            if not (s == "pipefb" and n % 2)]


def run_job(client: Any, job: JobConfig, warmup: int) -> dict[str, Any]:
    """Predicted and measured step time of one job, with the plan it ran."""
    from pipefb.app.train import timeline
    from protos.convert import plan_from_proto

    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    status = client.status(job_id)
    plan = plan_from_proto(status.plan)
    planner = json.loads(status.planner_json)
    gaps = [r.seconds for r in reports[warmup:]]
    # steps overlap (no barrier), so reports come in bursts: the mean gap (the window's
    # wall time over its steps) is the step time; the median of bursty gaps is not
    measured = {**summary(gaps), "mean": sum(gaps) / len(gaps)}
    predicted, in_situ = plan.predicted_step_seconds, planner["in_situ"]
    return {"plan": planner["plan"], "label": planner["candidates"][0]["candidate"],
            "predicted": predicted, "measured": measured,
            "error": predicted / measured["mean"] - 1.0,
            "in_situ": in_situ,
            "in_situ_error": in_situ["step_seconds"] / measured["mean"] - 1.0,
            "simulated_timeline": planner.get("timeline"),
            "measured_timeline": timeline(reports[-1]), "profile": planner["profile"],
            "measured_compute": median_action_seconds(
                [[w.action_seconds for w in r.workers] for r in reports[warmup:]])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run, in `--repeats` rounds; each round on a fresh local cluster, planned on a
    calibration of its own unless `--cached-cluster` ([Note: repeated runs])."""
    todo = runs(args)
    n_max = max(n for _, _, n in todo)
    trials: list[list[dict[str, Any]]] = [[] for _ in todo]
    clusters: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as tmp:
        for round_ in range(args.repeats):
            folder = Path(tmp) / f"round-{round_}"
            cluster_file, links = round_cluster(folder, n_max, fresh=not args.cached_cluster)
            clusters.append(links)
            with local_client(n_max, folder, threads=args.threads,
                              cluster_file=cluster_file) as client:
                for k, (model, schedule, n) in enumerate(todo):
                    res = run_job(client, make_job(args, model, schedule, n), args.warmup)
                    trials[k].append({**res, "round": round_})
                    _progress(args, round_, k, len(todo), (model, schedule, n), res,
                              time.perf_counter() - started)
    results = [{"model": model, "schedule": schedule, "workers": n,
                "steps": timed_steps(args, model), **middle_trial(t),
                "trials": [_trial(r) for r in t]}
               for (model, schedule, n), t in zip(todo, trials, strict=True)]
    return {"bench": "sim_accuracy", "machine": machine.describe(),
            "args": args_json(args),
            "target": TARGET, "clusters": clusters, "runs": results,
            "abs_error": _errors(results, "error"),
            "in_situ_abs_error": _errors(results, "in_situ_error"),
            "wall_seconds": time.perf_counter() - started}


def _progress(args: argparse.Namespace, round_: int, k: int, count: int,
              job: tuple[str, str, int], res: dict[str, Any], seconds: float) -> None:
    model, schedule, n = job
    print(f"[round {round_ + 1}/{args.repeats}, {k + 1}/{count}] {model} {schedule} x{n}: "
          f"simulated {res['predicted'] * 1e3:.1f} ms ({res['error']:+.0%}), in situ "
          f"{res['in_situ']['step_seconds'] * 1e3:.1f} ms ({res['in_situ_error']:+.0%}), "
          f"measured {res['measured']['mean'] * 1e3:.1f} ms [{seconds:.0f} s]", flush=True)


def round_cluster(folder: Path, workers: int, fresh: bool) -> tuple[Path, dict[str, Any]]:
    """FOLDER/cluster.yaml, the cluster description a round plans on: this machine measured
    again (cached in FOLDER alone, not in the user's cache) when `fresh`, else the cached
    calibration; with its links and when they were measured."""
    from calibration.cache import cache_path, read_cache
    from calibration.cluster import local_cluster

    cache = folder / "calibration" if fresh else None
    cluster = local_cluster(workers, cache_dir=cache, refresh=fresh)
    path, links = folder / "cluster.yaml", cluster.to_dict()
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(links, sort_keys=False))
    _, head = read_cache(cache_path(cache))
    found = re.search(r"measured (\S+)", head)
    return path, {"network": links["network"], "store": links["store"],
                  **{k: links[k] for k in ("shared_tier",) if k in links},
                  "measured": found.group(1) if found else "unknown"}


def middle_trial(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose error is the median of the runs' (the lower of the two middle ones for
    an even count): a run's step time, its prediction and its in-situ fit stay together
    ([Note: repeated runs])."""
    ordered = sorted(trials, key=lambda t: t["error"])
    return ordered[(len(ordered) - 1) // 2]


def _trial(res: dict[str, Any]) -> dict[str, float]:
    """What the results keep of every run: its step times and errors."""
    return {"round": res["round"], "measured": res["measured"]["mean"],
            "predicted": res["predicted"],
            "in_situ": res["in_situ"]["step_seconds"], "error": res["error"],
            "in_situ_error": res["in_situ_error"]}


def _errors(results: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Summary of |error| over the runs, with how many are within the target."""
    errors = [abs(r[key]) for r in results]
    return {**summary(errors), "within_target": sum(e <= TARGET for e in errors)}


def chart(results: dict[str, Any], path: Path) -> None:
    """Simulated against measured step time, one point per run, with the ±15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = {"gpipe": "o", "1f1b": "s", "pipedream": "^", "pipefb": "D"}
    colors = {"gpt": "#4C72B0", "mlp": "#DD8452"}
    top = 0.0
    for r in results["runs"]:
        x, y = r["measured"]["mean"] * 1e3, r["predicted"] * 1e3
        fitted = r["in_situ"]["step_seconds"] * 1e3
        low, high = runs_range(r)
        top = max(top, high * 1e3, y, fitted)
        marker, color = markers[r["schedule"]], colors[r["model"]]
        ax.plot([low * 1e3, high * 1e3], [y, y], color=color, lw=0.8)  # the job's runs
        ax.scatter(x, y, marker=marker, facecolors="none", edgecolors=color, s=40)
        ax.scatter(x, fitted, marker=marker, color=color, s=40)
        ax.plot([x, x], [y, fitted], color=color, lw=0.5, alpha=0.5)
        ax.annotate(f"{r['workers']}", (x, fitted), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    low = min(runs_range(r)[0] for r in results["runs"]) * 1e3 / 2
    line = [low, top * 1.1]
    ax.plot(line, line, color="black", lw=0.8)
    ax.fill_between(line, [v * (1 - TARGET) for v in line], [v * (1 + TARGET) for v in line],
                    color="grey", alpha=0.2, label="±15%")
    for s, m in markers.items():
        ax.scatter([], [], marker=m, color="grey", label=s)
    for name, c in colors.items():
        ax.scatter([], [], marker="o", color=c, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms/step (run of median error; bar: range of the runs)")
    ax.set_ylabel("simulated ms/step")
    ax.set_title("Simulated against measured (hollow: idle-worker profile,\n"
                 "filled: in-situ costs; label: workers)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_results(results: dict[str, Any]) -> None:
    """One line per run, then the error summary."""
    for r in results["runs"]:
        low, high = runs_range(r)
        print(f"{r['model']:4s} {r['schedule']:10s} x{r['workers']}  measured "
              f"{r['measured']['mean'] * 1e3:7.1f} [{low * 1e3:.1f}-{high * 1e3:.1f}] ms  "
              f"simulated {r['predicted'] * 1e3:7.1f} ms ({r['error']:+6.1%})  in situ "
              f"{r['in_situ']['step_seconds'] * 1e3:7.1f} ms ({r['in_situ_error']:+6.1%})  "
              f"{r['label']}  factors {r['in_situ']['factors']}")
    for key, name in (("abs_error", "idle-worker profile"), ("in_situ_abs_error", "in situ")):
        e = results[key]
        print(f"{name}: |error| median {e['median']:.1%}, max {e['max']:.1%}; "
              f"{e['within_target']}/{len(results['runs'])} within {TARGET:.0%}")


def runs_range(run: dict[str, Any]) -> tuple[float, float]:
    """The lowest and highest measured step time of a job's runs."""
    times = [t["measured"] for t in run["trials"]]
    return min(times), max(times)


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of this bench for docs/benchmarks.md: one row per run, then the summary."""
    a = res["args"]
    lines = ["## Simulator against measured local runs", "", f"`{cmd}`", "",
             f"`plan: auto` with the schedule fixed, batch {a['batch']}, {a['microbatches']} "
             f"micro-batches where the planner keeps them, {_steps_text(res)} timed steps after "
             f"{a['warmup']}; every job ran {a['repeats']} times, in rounds, each round on a "
             "fresh local cluster ([Note: repeated runs] in the bench); a job's row is its "
             "run of median error; measured = that run's timed steps' wall time over their "
             "count (the range is of the job's runs); error = simulated / measured - 1. "
             "*Profile*: the planner's prediction from layers profiled on idle workers (each "
             "worker once per round, by the first run that uses it: the coordinator reuses "
             "its reply for the model's later runs). *In situ*: the same "
             "plan simulated with per-kind costs and a link-latency factor fitted to the busy "
             f"and waiting times of steps {IN_SITU.start}-{IN_SITU.stop - 1} "
             "(`pipefb.planner.insitu`; the step time is not fitted).", "", *_cluster_line(res),
             "| model | schedule | workers | plan | measured ms [runs] | profile ms (error) "
             "| in situ ms (error) | in-situ factors F / B / OPT / store / latency |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        f, (low, high) = r["in_situ"]["factors"], runs_range(r)
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['workers']} | {r['label']} | "
            f"{r['measured']['mean'] * 1e3:.1f} [{low * 1e3:.1f}-{high * 1e3:.1f}] | "
            f"{r['predicted'] * 1e3:.1f} ({r['error']:+.0%}) | "
            f"{r['in_situ']['step_seconds'] * 1e3:.1f} ({r['in_situ_error']:+.0%}) | "
            f"{f['F']:.2f} / {f['B']:.2f} / {f['OPT']:.2f} / {f['STASH']:.2f} / "
            f"{f['latency']:.2f} |")
    n = len(res["runs"])
    for key, name in (("abs_error", "profile"), ("in_situ_abs_error", "in situ")):
        e = res[key]
        lines.append(f"\n{name}: |error| median {e['median']:.0%}, max {e['max']:.0%}; "
                     f"{e['within_target']}/{n} runs within {res['target']:.0%}.")
    return [*lines, "", f"![sim accuracy]({png})", ""]


def _cluster_line(res: dict[str, Any]) -> list[str]:
    """What the predictions assumed of the links, over the rounds' calibrations."""
    clusters = res["clusters"]

    def span(values: list[float], scale: float, digits: int) -> str:
        low, high = min(values) * scale, max(values) * scale
        return f"{low:.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else \
            f"{low:.{digits}f}-{high:.{digits}f}"

    def link(name: str) -> str:
        latency = span([c[name]["latency"] for c in clusters], 1e3, 2)
        bandwidth = span([c[name]["bandwidth"] for c in clusters], 1e-9, 2)
        return f"{latency} ms + bytes at {bandwidth} GB/s"

    dates = sorted({c["measured"] for c in clusters})
    when = (f"calibrated at {dates[0]}" if len(dates) == 1 else
            f"measured again before each round ({len(dates)} calibrations, {dates[0]} to "
            f"{dates[-1]})")
    return [f"Predicted on the local cluster {when}: loopback gRPC {link('network')}, store "
            f"{link('store')}.", ""]


def _steps_text(res: dict[str, Any]) -> str:
    """The timed steps of the runs, by model where they differ ("16 (gpt) or 160 (mlp)")."""
    by_model = {r["model"]: r.get("steps", res["args"]["steps"]) for r in res["runs"]}
    if len(set(by_model.values())) == 1:
        return str(next(iter(by_model.values())))
    return " or ".join(f"{n} ({m})" for m, n in by_model.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags; `--quick` picks tiny sizes for CI."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny models, 2 timed steps")
    p.add_argument("--out", type=Path, default=None, help="write results.json and a PNG here")
    p.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp")
    p.add_argument("--workers", default="2,3,4", help="comma-separated worker counts")
    p.add_argument("--batch", type=int, default=32, help="samples per step")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=0,
                   help="timed steps per run (default: by model, " +
                        ", ".join(f"{m} {n}" for m, n in STEPS.items()) + ")")
    p.add_argument("--warmup", type=int, default=IN_SITU.stop,
                   help=f"untimed steps first (the in-situ fit uses steps {IN_SITU.start}-"
                        f"{IN_SITU.stop - 1}; default {IN_SITU.stop})")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of every job, in rounds; a job's row is its run of median "
                        "error (default 5)")
    p.add_argument("--cached-cluster", action="store_true",
                   help="plan every round on the cached calibration instead of measuring "
                        "this machine again before each (--quick implies it)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.quick:
        args.steps, args.batch, args.workers, args.models = 2, 8, "2", "mlp"
        args.repeats, args.cached_cluster = min(args.repeats, 2), True
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, and writes `results.json` + `sim_accuracy.png` to `--out`."""
    results = run(parse_args(argv))
    print_results(results)
    write_results(parse_args(argv).out, results, chart, "sim_accuracy.png")
    return results


if __name__ == "__main__":
    main()
