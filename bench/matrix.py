"""Every system on every model in one run: throughput, per-worker peak memory and pipeline
efficiency.

Systems, each on the same model, data, micro-batching, optimizer (AdamW) and number of
processes (2): `single` (one process, gradient accumulation over the same micro-batches),
torch.distributed.pipelining's `torch-gpipe` and `torch-1f1b` (gloo, the coordinator's
balanced 2-stage split), and pipefb's `gpipe`, `1f1b`, `pipedream-keep`,
`pipedream-offload`, `pipefb-sync`, `pipefb-async` (staleness 1) and `auto` (`--plan auto`:
the planner picks schedule, micro-batches, partition, policy and groups). Models: `mlp` and
`convnet` on digits, `gpt` on text. Systems run interleaved, `--repeats` times.

- samples/s: batch x timed steps over the timed steps' wall time (steps overlap, so single
  gaps come in bursts), one figure per run; medians and [min-max] over repeats; ratios are
  taken per repeat, then summarised.
- peak memory per worker: pipefb's ranks report their accounted peak (parameters,
  gradients, optimizer state, weight versions, live and stashed activations); `single` and
  the torch ranks are counted alike by `bench.saved_memory` (saved tensors as activations).
- efficiency: measured samples/s over the ideal, one process's samples/s (`single`, same
  repeat) x workers x (1 - bubble), where the bubble is the simulator's idle share of the
  plan the system ran, on ideal workers (profiled layer costs, free transfers, a core
  each): what the schedule and partition leave idle, nothing else. The torch systems take
  the bubble of the balanced 2-stage plan their split comes from.
- steps: each model's `STEPS` (warm-up, timed) unless `--steps`/`--warmup` say otherwise.
- cores: every worker and torch rank runs on cores of its own where there are enough
  (`--no-pin-cpus`: wherever the kernel puts them; [Note: pinned workers]).

Run: `python bench/matrix.py [--quick] [--device cuda] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench import machine, torch_pipelining
from bench.cluster import local_client
from bench.output import add_run_flags, args_json, measured_main, write_results
from bench.pipeline_throughput import MODELS as THROUGHPUT_MODELS
from bench.pipeline_throughput import QUICK_MODELS as THROUGHPUT_QUICK
from bench.pipeline_throughput import stage_boundary, two_stage_plan
from bench.saved_memory import SavedTensorMeter
from bench.schedules import GPU_MODEL, peak_bars, rank_peaks
from bench.stats import error_bars, fmt, summary
from pipefb.job.config import JobConfig
from pipefb.planner.candidates import Candidate
from pipefb.profile.measure import measure_profile
from pipefb.runtime.reference import SingleProcess
from pipefb.sim.cluster import Cluster, Link
from pipefb.sim.simulate import simulate
from protos.convert import plan_from_proto

WORKERS = 2
#: pipefb's systems: JobConfig fields over the bench job
PIPEFB: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "pipedream-keep": {"schedule": "pipedream", "mode": "async", "policy": "keep"},
    "pipedream-offload": {"schedule": "pipedream", "mode": "async", "policy": "offload"},
    "pipefb-sync": {"schedule": "pipefb", "mode": "sync"},
    "pipefb-async": {"schedule": "pipefb", "mode": "async", "staleness": 1},
    "auto": {"schedule": "auto", "plan": "auto", "groups": 0},
}
#: torch.distributed.pipelining's systems -> (its schedule, the pipefb system of that plan)
TORCH: dict[str, str] = {"torch-gpipe": "gpipe", "torch-1f1b": "1f1b"}
SYSTEMS = ("single", *TORCH, *PIPEFB)
ASYNC = frozenset({"pipedream-keep", "pipedream-offload", "pipefb-async"})
#: ratios reported per model: (system, baseline)
RATIOS = [(s, "single") for s in SYSTEMS[1:]] + [(s, "torch-1f1b") for s in PIPEFB] + [
    ("pipefb-async", "pipedream-offload"),  # the PipeFB paper's comparison
    ("pipedream-offload", "pipedream-keep")]  # what offloading costs PipeDream
#: issue 36's GPU targets: (system, baseline, the least ratio wanted)
OFFLOAD_TARGETS = [("pipedream-offload", "pipedream-keep", 0.8),
                   ("pipefb-async", "pipedream-offload", 1.5),
                   ("pipefb-sync", "single", 1.0)]
MODELS: dict[str, dict[str, Any]] = {
    "mlp": THROUGHPUT_MODELS["mlp"],
    "convnet": {"model": "convnet", "dataset": "digits", "loss": "cross_entropy",
                "model_config": {"channels1": 32, "channels2": 64, "hidden": 256}},
    "gpt": THROUGHPUT_MODELS["gpt"],
}
#: a GPT whose activations dominate its memory (12 layers of 768, sequence 512): not in
#: the default models (a CPU takes minutes a step); the GPU offload entry runs it
GPT_LARGE: dict[str, Any] = {
    **GPU_MODEL, "model_config": {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 512},
    "dataset_config": {"block_size": 512, "max_bytes": 8_000_000}}
QUICK_MODELS: dict[str, dict[str, Any]] = {
    **THROUGHPUT_QUICK, "convnet": {**MODELS["convnet"], "model_config": {}},
    "gpt-large": THROUGHPUT_QUICK["gpt"]}


#: (warm-up, timed) steps of each model's runs where the flags leave them (`--steps 0`,
#: `--warmup -1`): the small models' steps take milliseconds, so 10 of them measure the
#: noise of a moment; 300 are a second and a half of steady state
STEPS: dict[str, tuple[int, int]] = {"mlp": (20, 300), "convnet": (20, 300), "gpt": (2, 10),
                                     "gpt-large": (2, 10)}


def steps_of(model: str, args: argparse.Namespace) -> tuple[int, int]:
    """(warm-up, timed) steps of `model`'s runs: the flags where given, else `STEPS`."""
    warmup, timed = STEPS[model]
    return (args.warmup if args.warmup >= 0 else warmup), (args.steps or timed)


def make_job(spec: dict[str, Any], args: argparse.Namespace, model: str) -> JobConfig:
    """The bench job of one model (1F1B, replaced per system)."""
    return JobConfig(schedule="1f1b", workers=WORKERS, device=args.device,
                     batch_size=args.batch, microbatches=args.microbatches,
                     steps=sum(steps_of(model, args)), optimizer="adamw", lr=1e-3, seed=0,
                     **spec)


def run_single(job: JobConfig) -> dict[str, Any]:
    """The one-process reference: step seconds, losses and its memory as one 'rank'."""
    single = SingleProcess(replace(job, schedule="single"))
    with SavedTensorMeter(exclude=single.params) as meter:
        steps = list(single.run())
    return {"seconds": [s.seconds for s in steps], "losses": [s.loss for s in steps],
            "ranks": {"0": {"role": "all", "activation": meter.peak,
                            "peak": max(s.peak_memory_bytes for s in steps) + meter.peak}}}


def run_pipefb(client: Any, job: JobConfig) -> dict[str, Any]:
    """One job on the local cluster: step gaps, losses, rank peaks, the plan it ran and
    the share of its ranks' compute time they spent blocked on the store."""
    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    status = client.status(job_id)
    return {"seconds": [r.seconds for r in reports], "losses": [r.loss for r in reports],
            "ranks": rank_peaks(reports), "plan": plan_from_proto(status.plan),
            "store_blocked_share": store_blocked_share(reports)}


def store_blocked_share(reports: list[Any]) -> float:
    """Seconds every rank's compute thread spent in STASH and FETCH (`store_blocked_seconds`)
    over its seconds in F, B and OPT, summed over the job's steps and ranks."""
    workers = [w for r in reports for w in r.workers]
    compute = sum(w.compute_seconds for w in workers)
    blocked = sum(w.metrics.get("store_blocked_seconds", 0.0) for w in workers)
    return blocked / compute if compute else 0.0


def bubble(plan: Any, profile: Any) -> float:
    """The simulator's idle share of `plan` on ideal workers: the profile's layer costs,
    free transfers and store, one core each (see the module docstring)."""
    free = Link(bandwidth=1e18, latency=0.0)
    workers = len(plan.assignment)
    return simulate(plan, profile, Cluster.uniform(workers, network=free, store=free)
                    ).bubble_fraction


def describe(plan: Any) -> str:
    """e.g. `1f1b x4, partition (0, 3, 7), 2 groups, policy keep`."""
    policy = ",".join(sorted(set(plan.policy)))
    groups = f", {plan.groups} groups" if plan.groups > 1 else ""
    back = (f" / {plan.backward_partition}" if plan.backward_partition != plan.forward_partition
            else "")
    return (f"{Candidate(plan, 0.0, 0.0).label}, partition {plan.forward_partition}{back}"
            f"{groups}, policy {policy}")


def one_run(system: str, job: JobConfig, client: Any, args: argparse.Namespace,
            warmup: int) -> dict[str, Any]:
    """`system` once on `job`: timed samples/s, losses, rank peaks (and the plan)."""
    if system == "single":
        run = run_single(job)
    elif system in TORCH:
        run = torch_pipelining.run(job, stage_boundary(job), TORCH[system], args.threads,
                                   args.pin_cpus)
    else:
        run = run_pipefb(client, replace(job, **PIPEFB[system]))
    timed = run["seconds"][warmup:]
    return {**run, "samples_per_second": job.batch_size * len(timed) / sum(timed)}


def systems_here(device: str) -> list[str]:
    """The systems this device runs: torch's need a CPU (gloo has no CUDA send/recv, and
    NCCL refuses two ranks on one GPU)."""
    return [s for s in SYSTEMS if device == "cpu" or s not in TORCH]


def summarise(job: JobConfig, runs: dict[str, list[dict[str, Any]]], profile: Any
              ) -> dict[str, Any]:
    """Per system: samples/s, ratios, efficiency, bubble, rank peaks and loss agreement."""
    names = list(runs)
    sps = {s: [r["samples_per_second"] for r in reps] for s, reps in runs.items()}
    bubbles = {s: [bubble(r["plan"], profile) for r in reps]
               for s, reps in runs.items() if "plan" in reps[0]}
    # torch's ranks run the balanced 2-stage plan whatever pipefb's jobs planned
    bubbles.update({t: [bubble(two_stage_plan(job, p), profile)] * len(runs[t])
                    for t, p in TORCH.items() if t in runs})
    bubbles["single"] = [0.0] * len(sps["single"])
    efficiency = {s: summary([v / (one * (1 if s == "single" else WORKERS) * (1 - b))
                              for v, one, b in zip(sps[s], sps["single"], bubbles[s],
                                                   strict=True)]) for s in names}
    ratios = {f"{a}/{b}": summary([x / y for x, y in zip(sps[a], sps[b], strict=True)])
              for a, b in RATIOS if a in runs and b in runs}
    reference = runs["single"][0]["losses"]
    return {
        "job": job.to_dict(), "samples_per_second": {s: summary(v) for s, v in sps.items()},
        "ratios": ratios, "efficiency": efficiency,
        "bubble": {s: statistics.median(v) for s, v in bubbles.items()},
        "store_blocked_share": {s: summary([r["store_blocked_share"] for r in reps])
                                for s, reps in runs.items() if "store_blocked_share" in reps[0]},
        "ranks": {s: reps[0]["ranks"] for s, reps in runs.items()},
        "plans": {s: describe(reps[0]["plan"]) for s, reps in runs.items()
                  if "plan" in reps[0]},
        "max_loss_diff_vs_single": {s: max(abs(x - y) for x, y in zip(
            reps[0]["losses"], reference, strict=True)) for s, reps in runs.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system on every model, `repeats` times interleaved, on one local cluster."""
    specs = QUICK_MODELS if args.quick else {
        **MODELS, **({"gpt": GPU_MODEL} if args.device == "cuda" else {}),
        "gpt-large": GPT_LARGE}
    names = [m for m in args.models.split(",") if m]
    jobs = {m: make_job(specs[m], args, m) for m in names}
    systems = [s for s in systems_here(args.device) if s in args.systems]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {s: [] for s in systems}
                                                        for m in names}
    env = {"OMP_NUM_THREADS": str(args.threads)}
    started = time.perf_counter()
    # profiled first, so that every repeat can leave a results.json: a run stopped by a
    # time limit (a lent GPU's minutes) keeps the repeats it finished
    profiles = {m: measure_profile(jobs[m], jobs[m].microbatch_size) for m in names}

    def results(done: int) -> dict[str, Any]:
        return {"bench": "matrix", "machine": machine.describe(), "args": args_json(args),
                "workers": WORKERS, "systems": systems, "repeats_done": done,
                "steps": {m: list(steps_of(m, args)) for m in names},
                "skipped": {s: "torch.distributed.pipelining on one GPU: gloo has no CUDA "
                               "send/recv and NCCL refuses two ranks on one device"
                            for s in SYSTEMS if s not in systems},
                "wall_seconds": time.perf_counter() - started,
                "models": {m: summarise(jobs[m], runs[m], profiles[m]) for m in names}}

    with tempfile.TemporaryDirectory(prefix="pipefb-bench-") as logs, \
            local_client(WORKERS, Path(logs), threads=args.threads, env=env,
                         calibrated=True, pin_cpus=args.pin_cpus) as client:
        for r in range(args.repeats):
            for m in names:
                for s in systems:
                    runs[m][s].append(one_run(s, jobs[m], client, args,
                                              steps_of(m, args)[0]))
                print(f"repeat {r + 1}/{args.repeats} {m} done "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
            if r + 1 < args.repeats:
                write_results(args.out, results(r + 1))
    return results(args.repeats)


def chart(results: dict[str, Any], path: Path) -> None:
    """Per model: samples/s (min-max bars), efficiency, and each worker's peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    names = results["systems"]
    fig, axes = plt.subplots(len(models), 3, figsize=(17, 3.8 * len(models)), squeeze=False)
    colors = ["#888888" if s == "single" else "#d62728" if s in TORCH else "#1f77b4"
              for s in names]
    for row, m in zip(axes, models, strict=True):
        res = results["models"][m]
        for ax, key, label in ((row[0], "samples_per_second", "samples/s (median, min-max)"),
                               (row[1], "efficiency", "measured / ideal (median, min-max)")):
            med, err = error_bars(res[key], names)
            ax.bar(range(len(names)), med, yerr=err, capsize=3, color=colors)
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{m}: {key.replace('_', ' ')}")
        peak_bars(row[2], res["ranks"], names, {str(k): f"worker {k}" for k in range(WORKERS)},
                  {"rotation": 30, "ha": "right", "fontsize": 8})
        row[2].set_ylabel("peak MiB (accounted)")
        row[2].set_title(f"{m}: peak memory per worker")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def mib_per_rank(ranks: dict[str, Any], key: str) -> str:
    """`a / b` MiB of each rank's `key`, in rank order."""
    return " / ".join(f"{ranks[r][key] / 2**20:.2f}" for r in sorted(ranks, key=int))


BLOCKED_TEXT = ("Blocked on store: the seconds pipefb's compute threads spent in STASH and "
                "FETCH over their seconds in F, B and OPT (`store_blocked_seconds`), median "
                "[min-max] over repeats. ")


def blocked_cell(model: dict[str, Any], system: str) -> str:
    """The blocked-on-store share of `system` as a table cell (`-` for the systems without
    a store: single and torch's)."""
    share = model.get("store_blocked_share", {}).get(system)
    return fmt(share, digits=3) if share is not None else "-"


def steps_text(res: dict[str, Any]) -> str:
    """'T timed steps after W warm-up', per model where they differ."""
    a = res["args"]
    steps = res.get("steps") or {m: [a["warmup"], a["steps"]] for m in res["models"]}
    texts = {m: f"{t} timed steps after {w} warm-up" for m, (w, t) in steps.items()}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"{m}: {text}" for m, text in texts.items())


def repeats_done(res: dict[str, Any]) -> int:
    """The repeats a result holds: all it was asked for, unless a time limit stopped it."""
    return int(res.get("repeats_done", res["args"]["repeats"]))


def doc_section(cmd: str, res: dict[str, Any], png: str) -> list[str]:
    """Markdown of the matrix: one table per model, then the plot."""
    a = res["args"]
    device = res["machine"]["gpu"] if a["device"] == "cuda" else res["machine"]["cpu"]
    blocked = any("store_blocked_share" in r for r in res["models"].values())
    lines = [f"## Every system on every model ({a['device'].upper()}: {device})", "",
             f"`{cmd}`", "",
             f"Batch {a['batch']} in {a['microbatches']} micro-batches "
             f"({a['batch'] // a['microbatches']} samples each), AdamW, {steps_text(res)}, "
             f"{repeats_done(res)} repeat(s) of every system "
             f"interleaved, {a['threads']} torch thread(s) in every process, "
             f"{res['workers']} processes for every pipeline. samples/s and ratios: median "
             "[min-max] over repeats. Efficiency: measured samples/s over `single`'s x "
             "workers x (1 - bubble), the bubble being the simulator's idle share of the "
             "plan on ideal workers (free transfers, a core each). Peak per worker: "
             "parameters + gradients + optimizer state + weight versions + activations "
             "(saved tensors and, for pipefb, tensors in flight), MiB. "
             + (BLOCKED_TEXT if blocked else "") + "Loss diff: largest "
             "per-step difference from `single` (async systems differ by design: they "
             "train on older weights). `auto` picks its own micro-batches (`xN` under each "
             "table: N micro-batches) and the data draws samples per micro-batch, so its loss diff "
             "compares other samples (tests/test_plan_auto.py checks that it trains "
             "exactly as one process on its micro-batches), and its efficiency, taken "
             "against `single` on the job's micro-batches, can pass 1.", ""]
    skipped = [f"- not run: `{s}`: {why}" for s, why in res["skipped"].items()]
    lines += [*skipped, ""] if skipped else []
    bases = ["single", *(["torch-1f1b"] if "torch-1f1b" in res["systems"] else [])]
    for m, r in res["models"].items():
        lines += [f"### {m} (`{json.dumps(r['job']['model_config'])}`)", "",
                  "| system | samples/s | " + "".join(f"vs {b} | " for b in bases)
                  + "efficiency | bubble | " + ("blocked on store | " if blocked else "")
                  + "peak per worker, MiB | activation peak per worker, MiB | loss diff |",
                  "| --- " * (7 + blocked + len(bases)) + "|"]
        for s in res["systems"]:
            vs = "".join((fmt(r["ratios"][k], digits=2) if k in r["ratios"] else "-") + " | "
                         for k in (f"{s}/{b}" for b in bases))
            lines.append(
                f"| {s} | {fmt(r['samples_per_second'][s])} | {vs}"
                f"{fmt(r['efficiency'][s], digits=2)} | {r['bubble'][s]:.2f} | "
                + (f"{blocked_cell(r, s)} | " if blocked else "")
                + f"{mib_per_rank(r['ranks'][s], 'peak')} | "
                f"{mib_per_rank(r['ranks'][s], 'activation')} | "
                f"{r['max_loss_diff_vs_single'][s]:.1e} |")
        lines += ["", f"`auto` ran: {r['plans'].get('auto', '-')}.", ""]
    return [*lines, f"![matrix]({png})", ""]


def offload_section(cmd: str, res: dict[str, Any]) -> list[str]:
    """Markdown of the offload targets (`OFFLOAD_TARGETS`): one row per model and target,
    with both systems' peak memory per worker."""
    a = res["args"]
    lines = ["## Offload at equal peak memory (issue 36's GPU targets)", "", f"`{cmd}`", "",
             f"Batch {a['batch']} in {a['microbatches']} micro-batches, {steps_text(res)}, "
             f"{repeats_done(res)} repeat(s) interleaved, "
             f"{res['workers']} processes per pipeline on one device; ratios of samples/s, "
             "median [min-max] over repeats; peak per worker as in the matrix, MiB.", "",
             "| model | system / baseline | ratio | target | met | peak per worker, MiB "
             "(system; baseline) |", "| --- | --- | --- | --- | --- | --- |"]
    for m, r in res["models"].items():
        for system, base, least in OFFLOAD_TARGETS:
            got = r["ratios"].get(f"{system}/{base}")
            if got is None:
                continue
            lines.append(
                f"| {m} | {system} / {base} | {fmt(got, digits=2)} | >= {least} | "
                f"{'yes' if got['median'] >= least else 'no'} | "
                f"{mib_per_rank(r['ranks'][system], 'peak')}; "
                f"{mib_per_rank(r['ranks'][base], 'peak')} |")
    return [*lines, ""]


def print_results(results: dict[str, Any]) -> None:
    """One line per model and system."""
    for m, r in results["models"].items():
        print(f"{m}:")
        for s in results["systems"]:
            print(f"  {s:18s} {fmt(r['samples_per_second'][s])} samples/s  efficiency "
                  f"{fmt(r['efficiency'][s], digits=2)}  bubble {r['bubble'][s]:.2f}  "
                  f"blocked on store {blocked_cell(r, s)}  peak "
                  f"{mib_per_rank(r['ranks'][s], 'peak')} MiB  loss diff "
                  f"{r['max_loss_diff_vs_single'][s]:.1e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's flags; `--quick` picks tiny sizes for CI."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, 2 timed steps, 1 repeat")
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated: mlp,convnet,gpt (6x384 on cuda), gpt-large "
                        "(12 layers of 768, sequence 512)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where every system computes (cuda: the workers share this GPU)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of the systems; `single` always runs")
    add_run_flags(p, repeats=3)
    p.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=True,
                   help="workers and torch's ranks on cores of their own where there are "
                        "enough (default on, as `pipefb local train`)")
    p.set_defaults(batch=16, steps=0, warmup=-1)  # 0 and -1: each model's `STEPS`
    args = p.parse_args(argv)
    chosen = [s for s in args.systems.split(",") if s]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: {unknown[0]!r} is not one of {', '.join(SYSTEMS)}")
    args.systems = ["single", *(s for s in chosen if s != "single")]
    bad = [m for m in args.models.split(",") if m and m not in QUICK_MODELS]
    if bad:
        p.error(f"--models: {bad[0]!r} is not one of {', '.join(QUICK_MODELS)}")
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the bench, prints it, and writes `results.json` + `matrix.png` to `--out`."""
    return measured_main(parse_args(argv), run, print_results, chart, "matrix.png")


if __name__ == "__main__":
    main()
