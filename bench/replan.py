"""Online re-planning under a slowdown: throughput over time with and without `--replan`.

Three systems run the same sync PipeFB job on one local cluster of 4 workers where, from
step `--at` on (`--slowdown`), either rank 3 (backward stage 1) computes `--factor` times
slower (`--scenario rank`: a slower or shared device), or one layer's forward and
backward do, wherever it runs (`--scenario layer`: a per-layer cost that changes
mid-run, as when a block's input grows):

- `static`: the plan it started with, to the end;
- `replan`: `--replan`, which moves layers once the slowdown makes another partition pay;
- `fresh`: `--replan` with the slowdown from step 0; after its first move it runs the
  partition a fresh plan for the slowed cluster gives (its last steps are that baseline).

Reported: samples/s per step (median over repeats, interleaved), and the recovery: the
`replan` job's median samples/s over the steps from `--at` + 20 on, over `fresh`'s over
its last 20 steps (issue 6 asks for at least 0.90), and `static`'s, the same way.
Try: `PYTHONPATH=. python bench/replan.py --out bench/results/replan`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import run_interleaved
from bench.output import add_part_flags, add_run_flags, run_parts
from bench.pipeline_throughput import MODELS, QUICK_MODELS
from bench.stats import fmt, summary
from pipefb.job.config import JobConfig

SYSTEMS = ("static", "replan", "fresh")
WORKERS = 4
SLOWED_RANK = 3  # backward stage 1 of a 4-worker PipeFB plan
SLOWED_LAYER = 4  # the gpt's last block (layers: embedding, 4 blocks, head, loss)
SETTLE_STEPS = 20  # recovery is measured from --at + this on (issue 6: within 20 steps)


def make_job(args: argparse.Namespace, system: str) -> JobConfig:
    """The job of one system (see the module docstring)."""
    spec = (QUICK_MODELS if args.quick else MODELS)["gpt"]
    at = 0 if system == "fresh" else args.at
    return JobConfig(**spec, schedule="pipefb", workers=WORKERS, batch_size=args.batch,
                     microbatches=args.microbatches, steps=args.steps, optimizer="adamw",
                     lr=1e-3, seed=0, mode="sync",
                     replan=system != "static",
                     slowdown=f"{slowed(args.scenario)}={args.factor:g}@{at}")


def slowed(scenario: str) -> str:
    """What the slowdown names: the rank, or the layer (`L` prefix)."""
    return str(SLOWED_RANK) if scenario == "rank" else f"L{SLOWED_LAYER}"


def what(scenario: str) -> str:
    """The slowed part, in words."""
    return (f"rank {SLOWED_RANK} (backward stage 1)" if scenario == "rank"
            else f"layer {SLOWED_LAYER} (a transformer block; its forward and backward)")


def run_job(client: Any, job: JobConfig) -> dict[str, Any]:
    """Runs one job to the end: samples/s of every step and the moves it made."""
    job_id = client.submit(job).job_id
    rates = [r.samples_per_second for r in client.train(job_id)]
    moves = [{"step": m.step, "seconds": m.seconds, "bytes": m.bytes,
              "forward_partition": list(m.forward_partition),
              "backward_partition": list(m.backward_partition)}
             for m in client.status(job_id).migrations]
    return {"samples_per_second": rates, "migrations": moves}


def run_measured(args: argparse.Namespace) -> dict[str, Any]:
    """Every system `--repeats` times, interleaved, on one local cluster."""
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    with tempfile.TemporaryDirectory(prefix="pipefb-bench-replan-") as tmp:
        env = {"PIPEFB_CHECKPOINT_ROOT": tmp}
        with LocalServices(WORKERS, Path(tmp) / "logs", threads=args.threads,
                          extra_env=env) as cluster, \
                CoordinatorClient(cluster.coordinator) as client:
            client.wait_for_workers(WORKERS)
            runs = run_interleaved([WORKERS], SYSTEMS, args.repeats,
                                   lambda s, _: run_job(client, make_job(args, s)))
    per = runs[str(WORKERS)]
    return {"runs": per, **summarise(per, args)}


def summarise(per: dict[str, list[dict[str, Any]]], args: argparse.Namespace
              ) -> dict[str, Any]:
    """Per-step medians over repeats, and the recovery ratios with their ranges."""
    curves = {s: [statistics.median(step) for step in zip(
        *(r["samples_per_second"] for r in per[s]), strict=True)] for s in SYSTEMS}
    fresh = [statistics.median(r["samples_per_second"][-SETTLE_STEPS:]) for r in per["fresh"]]
    start = min(args.at + SETTLE_STEPS, args.steps - 1)
    recovery = {s: summary([statistics.median(r["samples_per_second"][start:]) / f
                            for r, f in zip(per[s], fresh, strict=True)])
                for s in ("replan", "static")}
    first_moves = [r["migrations"][0]["step"] - args.at for r in per["replan"]
                   if r["migrations"]]
    return {"curves": curves, "recovery": recovery,
            "steps_to_first_move": summary(first_moves) if first_moves else None,
            "moves_per_run": summary([len(r["migrations"]) or 1e-9 for r in per["replan"]])}


def chart(results: dict[str, Any], path: Path) -> None:
    """Samples/s per step of each system, the slowdown marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, args = results["measured"], results["args"]
    scenario = args.get("scenario", "rank")
    fig, ax = plt.subplots(figsize=(8, 4))
    for system in SYSTEMS:
        ax.plot(res["curves"][system], label=system, lw=1.5)
    ax.axvline(args["at"], color="grey", ls="--", lw=1)
    ax.text(args["at"], ax.get_ylim()[1] * 0.97,
            f" {slowed(scenario)} x{args['factor']:g}", va="top", fontsize=8, color="grey")
    for move in (r["migrations"] for r in res["runs"]["replan"]):
        for m in move:
            ax.axvline(m["step"], color="tab:orange", alpha=0.3, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (median over repeats)")
    ax.set_title(f"re-planning, {what(scenario)} slowed (orange: moves)",
                 fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of this bench for docs/benchmarks.md."""
    meas, args = res["measured"], res["args"]
    moves = meas["steps_to_first_move"]
    scenario = args.get("scenario", "rank")
    title = "a slowed worker" if scenario == "rank" else "a layer whose cost changes"
    lines = [f"## Online re-planning: {title} ({args['factor']:g}x)", "", f"`{cmd}`", "",
             f"Sync PipeFB on {WORKERS} local workers, gpt, batch {args['batch']}, "
             f"{args['steps']} steps; {what(scenario)} computes "
             f"{args['factor']:g}x slower from step {args['at']} on. `static` keeps its "
             "plan, `replan` runs with `--replan`, `fresh` is slowed from step 0 with "
             "`--replan`, so its last steps run the partition a fresh plan for the slowed "
             f"cluster gives. {args['repeats']} repeats interleaved; median [min-max] of the "
             f"runs' median samples/s from step {args['at'] + SETTLE_STEPS} on, over "
             f"`fresh`'s median of its last {SETTLE_STEPS} steps.", "",
             "| system | samples/s after the slowdown, of a fresh plan's |", "| --- | --- |"]
    lines += [f"| {s} | {fmt(r, digits=2)} |" for s, r in meas["recovery"].items()]
    lines += ["", "First move " + (f"{fmt(moves, digits=0)} steps after the slowdown."
                                   if moves else "never happened."), "",
              "`fresh` calibrates with the slowdown already there, so its re-planner reads "
              "it as the cost of the slowed layers ([Note: online re-planning]): a proxy "
              "for a fresh plan, not an oracle; `replan`, which saw the change happen, can "
              "beat it.", "",
              "On this 2-core machine the injected slowdown sleeps, which gives the shared "
              "cores to the other ranks: a rank twice as slow costs the pipeline far less "
              "than 2x, so the gap between `static` and a fresh plan is small here; on "
              "dedicated devices the slowed stage bounds the step and the gap is the "
              "slowdown's.", "", f"![replan]({png})", ""]
    return lines


def print_results(results: dict[str, Any]) -> None:
    res = results.get("measured")
    if not res:
        return
    for system, r in res["recovery"].items():
        print(f"{system}: {fmt(r, digits=2)} of a fresh plan's samples/s after the slowdown")
    moves = res["steps_to_first_move"]
    print("first move " + (f"{fmt(moves, digits=0)} steps after the slowdown" if moves
                           else "never"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_part_flags(p, "a tiny run for CI", ("measured",))
    p.add_argument("--scenario", choices=("rank", "layer"), default="rank",
                   help=f"slow rank {SLOWED_RANK}, or layer {SLOWED_LAYER} wherever it runs")
    p.add_argument("--factor", type=float, default=2.0, help="the slowdown")
    p.add_argument("--at", type=int, default=10, help="the step the slowdown starts")
    add_run_flags(p, repeats=3)
    p.set_defaults(steps=120, batch=16)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.at, args.batch, args.factor = 40, 1, 12, 8, 8.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    results = run_parts("replan", args, {"measured": lambda: run_measured(args)},
                        print_results, chart, "replan.png")
    print(f"{time.perf_counter() - started:.0f} s")
    return results


if __name__ == "__main__":
    main()
