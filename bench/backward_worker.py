"""Backward-only worker compute per micro-batch vs the same layers' eager backward alone.

The claim checked: a PipeFB backward worker runs only the captured backward graphs of its
layers from the fetched stash (no hidden forward recompute), so its `B` time per
micro-batch is within 15% of `loss.backward()` over the same layers in one process.

A real local cluster runs short `pipefb` jobs with 2 workers (1 forward, 1 backward: the
backward stage holds every layer); the backward rank's `B` seconds per micro-batch come
from its step reports. After each job the baseline builds the same layers in this
process and times only `backward()` (the forward is run untimed first) on the same
micro-batches; rounds alternate so the machine's drift cancels in each round's ratio.
With one micro-batch per step the forward worker is idle while the backward runs, so the
two do not compete for the cores. Every process uses one torch thread.

Run: python bench/backward_worker.py [--rounds 7] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipefb.app.local import LocalServices
from pipefb.job.config import JobConfig, build_layers
from pipefb.job.data import build_dataset
from pipefb.seeding import derive_seed, seed_random_ops

TARGET = 1.15  # backward-only worker time / eager backward time, per micro-batch


def make_job(steps: int, microbatches: int) -> JobConfig:
    """A GPT big enough that compute dominates Python overhead."""
    return JobConfig(model="gpt", dataset="text", loss="cross_entropy", schedule="pipefb",
                     workers=2, batch_size=8 * microbatches, microbatches=microbatches,
                     steps=steps, optimizer="adamw", lr=1e-3, seed=0,
                     model_config={"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64},
                     dataset_config={"block_size": 64, "max_bytes": 500_000})


def worker_rounds(job: JobConfig, warmup: int, rounds: int
                  ) -> list[tuple[list[float], list[float]]]:
    """Per round: the backward rank's B seconds per micro-batch in one short job, then the
    same layers' eager backward in this process; alternating cancels the machine's drift."""
    from coordinator.client import CoordinatorClient
    from pipefb.allocator import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # this process runs the eager baseline: allocator set as a worker's
    pairs = []
    with tempfile.TemporaryDirectory() as logs, \
            LocalServices(job.workers, Path(logs), threads=1) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(job.workers)
        for _ in range(rounds):
            job_id = client.submit(job).job_id
            reports = list(client.train(job_id))
            worker = [next(w for w in r.workers if w.role == "backward").action_seconds["B"]
                      / job.microbatches for r in reports[warmup:]]
            pairs.append((worker, eager_backward_seconds(job, warmup)))
    return pairs


def eager_backward_seconds(job: JobConfig, warmup: int) -> list[float]:
    """`backward()` of the same layers in this process, per micro-batch after warm-up."""
    layers = build_layers(job)
    data = build_dataset(job.dataset, job.dataset_config, job.seed)
    times = []
    for step in range(job.steps):
        for m in range(job.microbatches):
            x, y = data.microbatch(step, m, job.microbatch_size)
            for i, layer in enumerate(layers):
                seed_random_ops(derive_seed(job.seed, step, m, i))
                x = layer(x, y) if i == len(layers) - 1 else layer(x)
            started = time.perf_counter()
            (x / job.microbatches).backward()
            if step >= warmup:
                times.append(time.perf_counter() - started)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    return times


def summary(values: list[float]) -> dict[str, float]:
    """Median and range in milliseconds."""
    return {"median_ms": 1e3 * statistics.median(values), "min_ms": 1e3 * min(values),
            "max_ms": 1e3 * max(values), "n": len(values)}


def main() -> None:
    """Runs the paired rounds and prints the ratio against the 15% target."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="steps per job (one job a round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    p.add_argument("--quick", action="store_true", help="2 rounds of 4 steps (CI smoke size)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 4, 1, 2
    job = make_job(args.steps, args.microbatches)
    pairs = worker_rounds(job, args.warmup, args.rounds)
    worker = [t for w, _ in pairs for t in w]
    eager = [t for _, e in pairs for t in e]
    ratios = [statistics.median(w) / statistics.median(e) for w, e in pairs]
    ratio = statistics.median(ratios)
    result: dict[str, Any] = {
        "worker_backward": summary(worker), "eager_backward": summary(eager),
        "ratio_median": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios),
        "target": TARGET, "job": job.to_dict(),
        "args": {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                 "microbatches": args.microbatches}}
    print(json.dumps(result, indent=2))
    verdict = "within" if ratio <= TARGET else "NOT within"
    print(f"backward-only worker / eager backward, per micro-batch: {ratio:.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} rounds "
          f"({verdict} the {TARGET:.2f} target)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
