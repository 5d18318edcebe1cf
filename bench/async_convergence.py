"""Convergence of the asynchronous schedules against sync training, on the demo's gpt.

Runs the demo job (`scripts/demo.sh`: tiny gpt on the text corpus, batch 16 in 4
micro-batches, AdamW) for `--steps` steps at each `--lrs` learning rate as:

- `single`: one process, the sync reference (sync pipelines equal it bit for bit);
- `single-2bw`: one process, PipeDream-2BW's rule with delay 1 (`SingleProcess(job, 1)`:
  step t's gradient at weights t - 1, applied to the newest), which async PipeFB equals;
- `single-2bw-k1`: one process, the micro-batch-granular rule: only each step's first
  micro-batch at weights t - 1, the other three at t (`staleness_microbatches` 1);
- `pipefb-sync`, `pipefb-async` (staleness 1, `staleness_microbatches` 4: PipeDream-2BW's
  rule), `pipefb-async-k1` (staleness 1 and the default `staleness_microbatches`, 1 on one
  pipeline group), `pipedream`: the pipelines on a local cluster of `--workers` workers.

It records each run's training losses, its held-out loss every `--eval-every` steps and at
the end, and plots the curves. Then it times pipefb sync, async and async-k1 against each
other: `--speed-repeats` interleaved rounds of `--speed-steps` steps each, no evaluation,
the median step time of each run past its first `WARMUP` steps. Usage:

    PYTHONPATH=. python bench/async_convergence.py --steps 300 \
        --out bench/results/async_convergence --png docs/async-convergence.png

`--only single-2bw-k1,pipefb-async-k1 --previous results.json` runs those systems and takes
the others from an earlier run of the same settings (every run is deterministic).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import machine
from bench.cluster import local_client
from bench.output import args_json, write_results
from pipefb.job.config import JobConfig
from pipefb.runtime.evaluate import evaluate
from pipefb.runtime.reference import SingleProcess

DEMO: dict[str, Any] = {  # scripts/demo.sh's job
    "model": "gpt", "dataset": "text", "loss": "cross_entropy", "batch_size": 16,
    "microbatches": 4, "optimizer": "adamw", "seed": 0}
PIPELINES: dict[str, dict[str, Any]] = {
    "pipefb-sync": {"schedule": "pipefb", "mode": "sync"},
    "pipefb-async": {"schedule": "pipefb", "mode": "async", "staleness": 1,
                     "staleness_microbatches": 4},
    "pipefb-async-k1": {"schedule": "pipefb", "mode": "async", "staleness": 1},  # default K
    "pipedream": {"schedule": "pipedream", "mode": "async"},
}
SINGLES: dict[str, tuple[int, int]] = {  # name: (staleness, staleness_microbatches)
    "single": (0, 0), "single-2bw": (1, 4), "single-2bw-k1": (1, 1)}
SYSTEMS = (*SINGLES, *PIPELINES)
TIMED = ("pipefb-sync", "pipefb-async", "pipefb-async-k1")  # the speed comparison
WARMUP = 5  # steps of each timed run left out of its median


def run_single(job: JobConfig, staleness: int, k: int = 0) -> dict[str, Any]:
    """The one-process run: losses, held-out loss every `job.eval_every` steps and at the end."""
    single = SingleProcess(replace(job, schedule="single", mode="sync",
                                   staleness_microbatches=k), staleness)
    losses, held_out = [], {}
    for report in single.run():
        losses.append(report.loss)
        done = report.step + 1
        if job.eval_every and done % job.eval_every == 0 and done < job.steps:
            held_out[done] = evaluate(job, single.weights())["loss"]
    held_out[job.steps] = evaluate(job, single.weights())["loss"]
    return {"losses": losses, "held_out": held_out}


def run_pipeline(client: Any, job: JobConfig) -> dict[str, Any]:
    """One job on the local cluster: losses, the coordinator's held-out losses, and the
    held-out loss of the weights it ends with."""
    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    held_out = {r.step + 1: r.eval["loss"] for r in reports if "loss" in r.eval}
    held_out[job.steps] = evaluate(job, client.weights(job_id))["loss"]
    return {"losses": [r.loss for r in reports], "held_out": held_out,
            "step_seconds": [r.seconds for r in reports]}


def run_speed(client: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """Samples per second of each TIMED system at the demo's lr, per interleaved repeat."""
    job = JobConfig(schedule="single", workers=args.workers, steps=args.speed_steps,
                    lr=args.lrs[0], **DEMO)
    speed: dict[str, list[float]] = {name: [] for name in TIMED}
    for _ in range(args.speed_repeats):
        for name in TIMED:
            job_id = client.submit(replace(job, **PIPELINES[name])).job_id
            seconds = [r.seconds for r in client.train(job_id)][WARMUP:]
            speed[name].append(job.batch_size / statistics.median(seconds))
    return speed


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system at every learning rate, on one local cluster."""
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    previous = json.loads(args.previous.read_text()) if args.previous else {}
    env = {"OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as logs, \
            local_client(args.workers, Path(logs), threads=args.threads, env=env) as client:
        for lr in args.lrs:
            job = JobConfig(schedule="single", workers=args.workers, steps=args.steps, lr=lr,
                            eval_every=args.eval_every, **DEMO)
            earlier = previous.get("runs", {}).get(str(lr), {})
            by_system = {}
            for name in SYSTEMS:
                if args.only and name not in args.only:
                    # deterministic: the earlier run's (JSON made its step keys strings)
                    by_system[name] = {**earlier[name], "held_out": {
                        int(k): v for k, v in earlier[name]["held_out"].items()}}
                elif name in SINGLES:
                    by_system[name] = run_single(job, *SINGLES[name])
                else:
                    by_system[name] = run_pipeline(client, replace(job, **PIPELINES[name]))
            for res in by_system.values():
                res["final"] = res["held_out"][args.steps]
            sync = by_system["single"]["final"]
            for res in by_system.values():
                res["vs_sync"] = res["final"] / sync - 1
            runs[str(lr)] = by_system
            print(f"lr {lr} done ({time.perf_counter() - started:.0f} s)", flush=True)
        speed = run_speed(client, args) if args.speed_repeats else {}
    return {"speed": speed, "bench": "async_convergence", "machine": machine.describe(),
            "args": args_json(args), "demo": DEMO, "systems": list(SYSTEMS),
            "wall_seconds": time.perf_counter() - started, "runs": runs}


def smooth(values: list[float], window: int) -> list[float]:
    """The trailing mean over `window` values (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window))
            for i in range(len(values))]


def chart(results: dict[str, Any], path: Path) -> None:
    """Per learning rate: training loss (trailing mean of 10 steps) and held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = list(results["runs"])
    fig, axes = plt.subplots(len(lrs), 2, figsize=(13, 4 * len(lrs)), squeeze=False)
    styles = {"single": ("black", "-"), "single-2bw": ("#888888", ":"),
              "single-2bw-k1": ("#bbbbbb", ":"),
              "pipefb-sync": ("#1f77b4", "--"), "pipefb-async": ("#d62728", "-"),
              "pipefb-async-k1": ("#ff7f0e", "-"), "pipedream": ("#2ca02c", "-")}
    for row, lr in zip(axes, lrs, strict=True):
        for name, res in results["runs"][lr].items():
            color, line = styles[name]
            row[0].plot(smooth(res["losses"], 10), color=color, linestyle=line, label=name)
            steps = sorted(res["held_out"], key=int)
            row[1].plot([int(s) for s in steps], [res["held_out"][s] for s in steps],
                        color=color, linestyle=line, marker=".", label=name)
        row[0].set_title(f"lr {lr}: training loss (mean of the last 10 steps)")
        row[1].set_title(f"lr {lr}: held-out loss")
        for ax in row:
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def show(results: dict[str, Any]) -> None:
    for lr, by_system in results["runs"].items():
        for name, res in by_system.items():
            print(f"lr {lr} {name:15s} held-out {res['final']:.3f} "
                  f"({res['vs_sync']:+.1%} vs sync)")
    for name, rates in results.get("speed", {}).items():
        print(f"{name:15s} samples/s median {statistics.median(rates):.1f} "
              f"[{min(rates):.1f}-{max(rates):.1f}]")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps of every run")
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")],
                   default=[3e-3, 1e-3], help="comma-separated learning rates (demo: 3e-3)")
    p.add_argument("--workers", type=int, default=4, help="workers of every pipeline")
    p.add_argument("--eval-every", type=int, default=25, help="held-out loss every K steps")
    p.add_argument("--only", type=lambda s: s.split(","), default=[],
                   help="comma-separated systems to run; the others' results come from "
                        "--previous (the losses are deterministic)")
    p.add_argument("--previous", type=Path, default=None,
                   help="an earlier results.json of the same settings")
    p.add_argument("--speed-steps", type=int, default=40, help="steps of each timed run")
    p.add_argument("--speed-repeats", type=int, default=3,
                   help="interleaved rounds of the timed runs (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    p.add_argument("--png", type=Path, default=None, help="write the curves here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run(args)
    show(results)
    write_results(args.out, results)
    if args.png is not None:
        chart(results, args.png)
    return results


if __name__ == "__main__":
    main()
