"""Where a bench's results go: `results.json` and its chart in the `--out` folder."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_results(out: Path | None, results: dict[str, Any],
                  chart: Callable[[dict[str, Any], Path], None] | None = None,
                  png: str = "chart.png") -> None:
    """Writes `out/results.json` and, with a `chart`, `out/<png>`; nothing when `out` is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "results.json.part"  # a run killed while writing leaves the last whole one
    partial.write_text(json.dumps(results, indent=1))
    partial.replace(out / "results.json")
    if chart is not None:
        chart(results, out / png)


def add_run_flags(p: argparse.ArgumentParser, *, repeats: int) -> None:
    """The flags of a measured bench that runs jobs on a local cluster: where results go,
    the job's batch and micro-batches, timed and warm-up steps, repeats and threads."""
    p.add_argument("--out", type=Path, default=None, help="write results.json and a PNG here")
    p.add_argument("--batch", type=int, default=32, help="measured: samples per step")
    p.add_argument("--microbatches", type=int, default=4,
                   help="measured: micro-batches per step (plan auto may pick others)")
    p.add_argument("--steps", type=int, default=10, help="measured: timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="measured: untimed steps first")
    p.add_argument("--repeats", type=int, default=repeats,
                   help="measured: runs of every system")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")


def measured_main(args: argparse.Namespace,
                  run: Callable[[argparse.Namespace], dict[str, Any]],
                  show: Callable[[dict[str, Any]], None],
                  chart: Callable[[dict[str, Any], Path], None], png: str) -> dict[str, Any]:
    """The main of a measured bench once its flags are parsed: gives this process (where
    the one-process baselines run) `args.threads` torch threads and the allocator settings
    every worker has, then runs, prints and writes `results.json` and the chart to
    `args.out`."""
    import torch

    from pipefb.allocator import keep_freed_memory

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    results = run(args)
    show(results)
    write_results(args.out, results, chart, png)
    return results


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """A bench's flags as JSON-able values (paths as strings), for its results."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def add_part_flags(p: argparse.ArgumentParser, quick_help: str,
                   parts: tuple[str, ...] = ("simulated", "measured")) -> None:
    """`--quick` and `--part` of a bench with these parts (a simulated and a measured one
    unless told)."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--part", choices=("all", *parts), default="all")


def run_parts(bench: str, args: argparse.Namespace, parts: dict[str, Callable[[], Any]],
              show: Callable[[dict[str, Any]], None],
              chart: Callable[[dict[str, Any], Path], None], png: str) -> dict[str, Any]:
    """Runs the parts `args.part` selects, in order, into one results dict with the machine
    and flags; prints it with `show` and writes it (and its chart) to `args.out`."""
    from bench import machine

    started = time.perf_counter()
    results: dict[str, Any] = {"bench": bench, "machine": machine.describe(),
                               "args": args_json(args)}
    for name, part in parts.items():
        if args.part in ("all", name):
            results[name] = part()
    results["wall_seconds"] = time.perf_counter() - started
    show(results)
    write_results(args.out, results, chart, png)
    return results
