"""Scaling: step time against the number of workers and against model depth.

On one local cluster of 4 workers, the tiny GPT of the other benches runs as jobs of
`--steps` timed steps after `--warmup`, interleaved over `--repeats`:

- workers: `1f1b` on 1, 2 and 4 workers (1 worker: gradient accumulation in one worker
  process, the same runtime and transport), and sync `pipefb` on 2 and 4;
- depth: `1f1b` on 2 workers with 2, 4 and 8 transformer blocks.

Reported: the median step seconds (coordinator-measured) with min-max over every timed
step of every repeat, and for workers the speed-up over 1 worker, for depth the seconds
per block. Run: `python bench/scaling.py [--quick] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import local_client, run_interleaved
from bench.output import add_part_flags, add_run_flags, run_parts
from bench.pipeline_throughput import MODELS, QUICK_MODELS
from bench.stats import fmt, summary
from pipefb.job.config import JobConfig

WORKERS = (1, 2, 4)
SCHEDULES = {"1f1b": WORKERS, "pipefb": (2, 4)}
DEPTHS = (2, 4, 8)
DEPTH_WORKERS = 2


def make_job(args: argparse.Namespace, schedule: str, workers: int, blocks: int
             ) -> JobConfig:
    """The gpt job of one point, with `blocks` transformer blocks."""
    spec = (QUICK_MODELS if args.quick else MODELS)["gpt"]
    return JobConfig(**{**spec, "model_config": {**spec["model_config"], "n_layer": blocks}},
                     schedule=schedule, workers=workers, batch_size=args.batch,
                     microbatches=args.microbatches, steps=args.warmup + args.steps,
                     optimizer="adamw", lr=1e-3, seed=0, mode="sync")


def step_seconds(client: Any, job: JobConfig, warmup: int) -> dict[str, Any]:
    """Runs one job; the seconds of its steps after the warm-up."""
    job_id = client.submit(job).job_id
    return {"seconds": [r.seconds for r in client.train(job_id)][warmup:]}


def points(args: argparse.Namespace) -> dict[str, tuple[str, int, int]]:
    """Every measured point: name -> (schedule, workers, blocks)."""
    base = (QUICK_MODELS if args.quick else MODELS)["gpt"]["model_config"]["n_layer"]
    out = {f"{s} x{n}": (s, n, base) for s, counts in SCHEDULES.items() for n in counts}
    out.update({f"depth {d}": ("1f1b", DEPTH_WORKERS, d) for d in DEPTHS})
    return out


def run_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Every point `--repeats` times, interleaved, on one local cluster of 4 workers."""
    named = points(args)
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-scaling-") as tmp, \
            local_client(max(WORKERS), Path(tmp), threads=args.threads) as client:
        runs = run_interleaved([max(WORKERS)], list(named), args.repeats,
                               lambda name, _: step_seconds(client, make_job(
                                   args, *named[name]), args.warmup))
    per = runs[str(max(WORKERS))]
    seconds = {name: [s for r in per[name] for s in r["seconds"]] for name in named}
    steps = {name: summary(values) for name, values in seconds.items()}
    one = statistics.median(seconds["1f1b x1"])
    return {
        "points": {name: {"schedule": s, "workers": n, "blocks": b}
                   for name, (s, n, b) in named.items()},
        "step_seconds": steps,
        "speedup_over_1": {name: one / steps[name]["median"] for name in named
                           if not name.startswith("depth")},
        "seconds_per_block": {name: steps[name]["median"] / named[name][2] for name in named
                              if name.startswith("depth")},
    }


def chart(results: dict[str, Any], path: Path) -> None:
    """Step ms against workers (per schedule) and against depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meas = results["measured"]
    steps, named = meas["step_seconds"], meas["points"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for schedule, counts in SCHEDULES.items():
        names = [f"{schedule} x{n}" for n in counts]
        left.errorbar(list(counts), [steps[n]["median"] * 1e3 for n in names],
                      yerr=_whiskers(steps, names), marker="o", capsize=3, label=schedule)
    left.set_xticks(list(WORKERS))
    left.set_xlabel("workers")
    left.set_ylabel("step ms (median, min-max)")
    left.legend()
    names = [f"depth {d}" for d in DEPTHS]
    right.errorbar([named[n]["blocks"] for n in names],
                   [steps[n]["median"] * 1e3 for n in names], yerr=_whiskers(steps, names),
                   marker="o", capsize=3, label=f"1f1b x{DEPTH_WORKERS}")
    right.set_xticks(list(DEPTHS))
    right.set_xlabel("transformer blocks")
    right.legend()
    fig.suptitle("scaling, tiny GPT on local workers sharing this machine's cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _whiskers(steps: dict[str, Any], names: list[str]) -> list[list[float]]:
    return [[(steps[n]["median"] - steps[n]["min"]) * 1e3 for n in names],
            [(steps[n]["max"] - steps[n]["median"]) * 1e3 for n in names]]


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of this bench for docs/benchmarks.md."""
    meas, args = res["measured"], res["args"]
    lines = ["## Scaling: step time against workers and depth", "", f"`{cmd}`", "",
             f"The tiny GPT, batch {args['batch']} in {args['microbatches']} micro-batches, "
             f"AdamW, sync; {args['steps']} timed steps after {args['warmup']} per job, "
             f"{args['repeats']} repeats interleaved on one local cluster of "
             f"{max(WORKERS)} workers. Median [min-max] step ms over every timed step. "
             "1 worker is `1f1b` with one stage: gradient accumulation in one worker process "
             "through the same runtime.", "",
             "| point | step ms | speed-up over 1 worker |", "| --- | --- | --- |"]
    for name, speedup in meas["speedup_over_1"].items():
        lines.append(f"| {name} | {fmt(meas['step_seconds'][name], 1e3)} | {speedup:.2f} |")
    lines += ["", f"| blocks (1f1b x{DEPTH_WORKERS}) | step ms | ms per block |",
              "| --- | --- | --- |"]
    for name, per_block in meas["seconds_per_block"].items():
        lines.append(f"| {meas['points'][name]['blocks']} | "
                     f"{fmt(meas['step_seconds'][name], 1e3)} | {per_block * 1e3:.1f} |")
    lines += ["", "Every worker, the coordinator and Redis share this machine's 2 cores, so "
              "more workers add transfers and processes without adding cores: the speed-up "
              "a pipeline can show here is bounded near 1, and what the table shows is "
              "pipefb's overhead per added stage.",
              "", f"![scaling]({png})", ""]
    return lines


def print_results(results: dict[str, Any]) -> None:
    meas = results.get("measured")
    if not meas:
        return
    for name, s in meas["step_seconds"].items():
        print(f"{name:<10} {fmt(s, 1e3)} ms per step")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_part_flags(p, "a tiny run for CI", ("measured",))
    add_run_flags(p, repeats=3)
    p.set_defaults(batch=16)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.batch = 2, 1, 1, 8
    started = time.perf_counter()
    results = run_parts("scaling", args, {"measured": lambda: run_measured(args)},
                        print_results, chart, "scaling.png")
    print(f"{time.perf_counter() - started:.0f} s")
    return results


if __name__ == "__main__":
    main()
