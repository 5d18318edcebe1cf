"""The any-model matrix: every user-style model of tests/plugin_pkg/pipefb_zoo on every sync
schedule and activation policy, against `--schedule single`; the largest difference of the
per-step losses and of the final weights (`PYTHONPATH=. python bench/any_model.py`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
ZOO_PATH = ROOT / "tests" / "plugin_pkg"
SCHEDULES = [("gpipe", 2), ("1f1b", 3), ("pipefb", 4)]
POLICIES = ("keep", "offload", "recompute")


def largest_differences(client: Any, job: Any) -> tuple[float, float]:
    """(largest |loss - single's| over the steps, largest |weight - single's|)."""
    from pipefb.runtime.reference import SingleProcess

    job_id = client.submit(job).job_id
    losses = [r.loss for r in client.train(job_id)]
    weights = client.weights(job_id)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count: bit-equal reductions
    try:
        single = SingleProcess(replace(job, schedule="single"))
        want = [s.loss for s in single.run()]
        want_weights = single.weights()
    finally:
        torch.set_num_threads(threads)
    loss_gap = max(abs(a - b) for a, b in zip(losses, want, strict=True))
    weight_gap = max(float((weights[k].double() - v.double()).abs().max())
                     for k, v in want_weights.items())
    return loss_gap, weight_gap


def main() -> int:
    """Runs the matrix on a fresh local cluster of 4 workers; prints a markdown table."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--steps", type=int, default=3, help="steps of each job (default 3)")
    p.add_argument("--models", nargs="*", default=None,
                   help="only these zoo models (default: all of tests/test_any_model.ZOO)")
    args = p.parse_args()
    sys.path.insert(0, str(ZOO_PATH))
    sys.path.insert(0, str(ROOT))
    from bench.cluster import local_client
    from pipefb.job.config import JobConfig
    from tests.test_any_model import ZOO

    env = {"PYTHONPATH": os.pathsep.join([str(ZOO_PATH), os.environ.get("PYTHONPATH", "")])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, local_client(4, Path(tmp), threads=1,
                                                            env=env) as client:
        for model, extra in sorted(ZOO.items()):
            if args.models is not None and model not in args.models:
                continue
            for schedule, workers in SCHEDULES:
                for policy in POLICIES:
                    if schedule == "pipefb" and policy == "keep":
                        continue  # the split carries saved tensors through the store
                    job = JobConfig(model=model, schedule=schedule, workers=workers,
                                    optimizer="adamw", lr=0.01, seed=7, batch_size=8,
                                    microbatches=4, steps=args.steps, policy=policy,
                                    **extra)
                    loss, weight = largest_differences(client, job)
                    rows.append({"model": model, "schedule": schedule, "workers": workers,
                                 "policy": policy, "loss": loss, "weight": weight})
                    print(f"| {model} | {schedule} x{workers} | {policy} | {loss:.3g} | "
                          f"{weight:.3g} |", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: (r["loss"], r["weight"]))
    print(f"largest: {worst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
