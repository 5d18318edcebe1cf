"""bf16 and fp16 against float32 on the demo's gpt (PipeFB, 2 workers, batch 16 in 4
micro-batches, CPU): throughput and stash bytes per step, precisions interleaved,
`--repeats` runs each (`PYTHONPATH=. python bench/precision.py [--steps 8] [--repeats 3]
[--out DIR]`). Each run's throughput is the median of its steps after the first two; the
line gives the median and range over the repeats, and the bf16 / fp32 and fp16 / fp32
ratios."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cluster import local_client
from bench.output import write_results
from bench.stats import fmt, ratio, summary
from pipefb.job.config import JobConfig

GPT = {"model": "gpt", "dataset": "text", "loss": "cross_entropy",
       "model_config": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64},
       "dataset_config": {"block_size": 64}}
PRECISIONS = ("fp32", "bf16", "fp16")
WARMUP = 2  # untimed steps of each run


def job(precision: str, steps: int, device: str) -> JobConfig:
    """`steps` steps of PipeFB in `precision`."""
    return JobConfig(schedule="pipefb", workers=2, batch_size=16, microbatches=4,
                     steps=steps + WARMUP, optimizer="adamw", lr=3e-3, precision=precision,
                     device=device, **GPT)


def one_run(client: Any, j: JobConfig) -> tuple[float, int]:
    """(samples per second, median over the timed steps; stash bytes of one step)."""
    reports = list(client.train(client.submit(j).job_id))
    timed = reports[WARMUP:]
    stashed = {sum(w.bytes_stashed for w in r.workers) for r in timed}
    assert len(stashed) == 1, stashed  # the same stash every step
    return statistics.median(j.batch_size / r.seconds for r in timed), stashed.pop()


def main() -> None:
    """Prints one line per precision and the ratios; writes results.json with --out."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each precision")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = p.parse_args()
    rates: dict[str, list[float]] = {k: [] for k in PRECISIONS}
    stash: dict[str, set[int]] = {k: set() for k in PRECISIONS}
    with tempfile.TemporaryDirectory() as tmp, local_client(2, Path(tmp)) as client:
        for _ in range(args.repeats):
            for precision in PRECISIONS:  # interleaved, so drift hits both alike
                rate, stashed = one_run(client, job(precision, args.steps, args.device))
                rates[precision].append(rate)
                stash[precision].add(stashed)
    results: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}}
    for precision in PRECISIONS:
        (stashed,) = stash[precision]
        results[precision] = {"samples_per_second": summary(rates[precision]),
                              "runs": rates[precision], "stash_bytes_per_step": stashed}
        print(f"{precision}: samples/s {fmt(summary(rates[precision]))} "
              f"(runs {[round(r, 1) for r in rates[precision]]}), stash "
              f"{stashed / 2**20:.2f} MiB per step", flush=True)
    results["ratios"] = {}
    for low in PRECISIONS[1:]:
        speed = ratio(rates[low], rates["fp32"])
        bytes_ratio = (results[low]["stash_bytes_per_step"]
                       / results["fp32"]["stash_bytes_per_step"])
        results["ratios"][low] = {"throughput": speed, "stash_bytes": bytes_ratio}
        print(f"{low} / fp32: throughput {fmt(speed, digits=3)}, stash bytes "
              f"{bytes_ratio:.3f}")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
