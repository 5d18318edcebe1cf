"""PipeDream `offload` against `keep`, and sync PipeFB, through the node-local shared-memory
tier ([Note: local tier index] in offload_store/shm.py) and through Redis alone, with the
background stash writer on and off ([Note: background stash] in offload_store/writer.py),
on the CPU, 2 workers:
the demo's gpt (batch 16 in 4 micro-batches) and a model with large activations (`mlp`:
Linear 64 -> 16384, ReLU, Linear 16384 -> 10; batch 128 in 4 micro-batches, 2 MiB saved
per micro-batch and stage). One local cluster per setting (`SETTINGS`: the workers'
`PIPEFB_STASH_IN_FLIGHT_BYTES`, 0 = the compute thread writes, and
`PIPEFB_LOCAL_TIER_DIR`, empty = no shared-memory tier; with the tier, a PipeDream rank's
private index puts and takes on its compute thread whatever the cap, [Note: copies on the
compute thread] in offload_store/writer.py, so the cap matters to PipeFB's forward
ranks there), the systems interleaved in each
of `--repeats` repeats; each job's median step after its first 5 steps. Ratios are taken
per repeat, then summarised. Run: `PYTHONPATH=. python bench/offload_overlap.py
[--repeats 3] [--steps 20] [--settings ...] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import local_client
from bench.local_tier import GPT
from bench.output import args_json, write_results
from bench.stats import fmt, summary
from pipefb.job.config import JobConfig

WIDE = {"model": "mlp", "dataset": "digits", "loss": "cross_entropy",
        "model_config": {"in_features": 64, "hidden": 16384, "depth": 1}}
MODELS: dict[str, tuple[dict[str, Any], int]] = {"gpt": (GPT, 16), "wide": (WIDE, 128)}
SYSTEMS: dict[str, dict[str, Any]] = {
    "pipedream-keep": {"schedule": "pipedream", "mode": "async", "policy": "keep"},
    "pipedream-offload": {"schedule": "pipedream", "mode": "async", "policy": "offload"},
    "pipefb-sync": {"schedule": "pipefb", "mode": "sync"},
}
# the workers' environment per setting: the writer's cap (0: the compute thread writes)
# and the node-local tier (the local cluster's default: on; "": off)
SETTINGS: dict[str, dict[str, str]] = {
    "tier, background": {"PIPEFB_STASH_IN_FLIGHT_BYTES": "268435456"},
    "tier, compute thread": {"PIPEFB_STASH_IN_FLIGHT_BYTES": "0"},
    "redis, background": {"PIPEFB_STASH_IN_FLIGHT_BYTES": "268435456",
                          "PIPEFB_LOCAL_TIER_DIR": ""},
    "redis, compute thread": {"PIPEFB_STASH_IN_FLIGHT_BYTES": "0", "PIPEFB_LOCAL_TIER_DIR": ""},
}


def job(model: str, system: str, steps: int) -> JobConfig:
    """`steps` steps of `system` on `model`, 2 workers, 4 micro-batches, AdamW."""
    spec, batch = MODELS[model]
    return JobConfig(workers=2, batch_size=batch, microbatches=4, steps=steps,
                     optimizer="adamw", lr=1e-3, **spec, **SYSTEMS[system])


def one_run(client: Any, j: JobConfig) -> dict[str, float]:
    """The median step seconds after the first 5 steps, and the blocked-on-store share
    of the ranks' compute time (`bench.matrix.store_blocked_share`)."""
    from bench.matrix import store_blocked_share

    reports = list(client.train(client.submit(j).job_id))
    return {"seconds": statistics.median(r.seconds for r in reports[5:]),
            "blocked": store_blocked_share(reports[5:])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every model and system in every repeat, per writer setting."""
    out: dict[str, Any] = {"args": args_json(args), "settings": {}}
    for setting in args.settings:
        runs: dict[str, dict[str, list[dict[str, float]]]] = {
            m: {s: [] for s in SYSTEMS} for m in MODELS}
        with tempfile.TemporaryDirectory() as tmp, local_client(
                2, Path(tmp), env=SETTINGS[setting]) as client:
            for _ in range(args.repeats):
                for m in MODELS:
                    for s in SYSTEMS:
                        runs[m][s].append(one_run(client, job(m, s, args.steps)))
        out["settings"][setting] = {m: summarise(r) for m, r in runs.items()}
        print_setting(setting, out["settings"][setting])
    return out


def summarise(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Step ms and blocked share per system; offload / keep and pipefb / keep throughput."""
    keep = [r["seconds"] for r in runs["pipedream-keep"]]
    return {"step_ms": {s: summary([r["seconds"] * 1e3 for r in rs]) for s, rs in runs.items()},
            "store_blocked_share": {s: summary([r["blocked"] for r in rs])
                                    for s, rs in runs.items()},
            "ratios": {f"{s}/pipedream-keep": summary(
                [k / r["seconds"] for k, r in zip(keep, runs[s], strict=True)])
                for s in ("pipedream-offload", "pipefb-sync")}}


def print_setting(setting: str, res: dict[str, Any]) -> None:
    for m, r in res.items():
        print(f"{setting}, {m}: " + ", ".join(
            f"{s} {fmt(v)} ms (blocked {fmt(r['store_blocked_share'][s], digits=3)})"
            for s, v in r["step_ms"].items()) + "; " + ", ".join(
            f"{k} {fmt(v, digits=3)}" for k, v in r["ratios"].items()), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per setting")
    p.add_argument("--steps", type=int, default=20, help="steps per job (5 untimed)")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                   help="the settings to run, one local cluster each")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = p.parse_args(argv)
    results = run(args)
    write_results(args.out, results)
    return results


if __name__ == "__main__":
    main()
