"""PipeDream with `offload` against `keep` on the demo's gpt (2 workers, batch 16 in 4
micro-batches), once with the workers' in-process local tier on and once with every
stash through the shared store (the node-local shared-memory tier off in both: see
bench/offload_overlap.py for it), systems interleaved, 3 repeats each (`PYTHONPATH=. python
bench/local_tier.py`): the throughput ratio offload / keep per repeat and its median."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cluster import local_client
from pipefb.job.config import JobConfig

GPT = {"model": "gpt", "dataset": "text", "loss": "cross_entropy",
       "model_config": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64},
       "dataset_config": {"block_size": 64}}


def job(policy: str) -> JobConfig:
    """25 steps of PipeDream with `policy` on every layer."""
    return JobConfig(schedule="pipedream", mode="async", workers=2, batch_size=16,
                     microbatches=4, steps=25, optimizer="adamw", lr=3e-3, policy=policy,
                     **GPT)


def median_step(client: object, j: JobConfig) -> float:
    """The median step seconds after the first 5 steps."""
    reports = list(client.train(client.submit(j).job_id))  # type: ignore[attr-defined]
    return statistics.median(r.seconds for r in reports[5:])


def main() -> None:
    """Prints one line per tier setting."""
    for tier in ("1073741824", "0"):
        with tempfile.TemporaryDirectory() as tmp, local_client(
                2, Path(tmp), env={"PIPEFB_LOCAL_STASH_BYTES": tier,
                                   "PIPEFB_LOCAL_TIER_DIR": ""}) as client:
            res: dict[str, list[float]] = {"keep": [], "offload": []}
            for _ in range(3):
                for policy in ("keep", "offload"):
                    res[policy].append(median_step(client, job(policy)))
            ratios = [k / o for k, o in zip(res["keep"], res["offload"], strict=True)]
            print(f"local tier {tier} B: keep ms {[round(x * 1e3, 1) for x in res['keep']]}, "
                  f"offload ms {[round(x * 1e3, 1) for x in res['offload']]}, offload/keep "
                  f"{[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
