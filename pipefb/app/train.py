"""`pipefb local train`: run a job (one process, or a fresh local cluster), show progress,
write the report. The cluster path talks to the coordinator through its client, imported
only when called, so the core modules never load grpc.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from pipefb.allocator import keep_freed_memory
from pipefb.app.local import TIER_ENV, LocalServices
from pipefb.app.report import write_report
from pipefb.cpus import format_cpu_list
from pipefb.errors import NonFiniteLoss
from pipefb.job.config import JobConfig
from pipefb.memory import KINDS
from pipefb.processes import default_threads
from pipefb.runtime.evaluate import evaluate
from pipefb.runtime.reference import SingleProcess
from pipefb.runtime.throughput import StepRate
from pipefb.schedule.kinds import runs_in_process

console = Console(stderr=True)
RECONNECT_SECONDS = 120.0  # with --max-restarts: how long to wait for a relaunched coordinator


class StepProgress:
    """A progress bar (step, loss, samples/s), or one plain line per step without a
    terminal (written as is, without rich's markup and highlighting, which would take time
    on the cores the workers use)."""

    def __init__(self, bar: Progress | None, task: TaskID | None) -> None:
        self.bar, self.task = bar, task

    def update(self, step: dict[str, Any], total: int) -> None:
        """Shows a finished step."""
        sps, left = step["samples_per_second_median"], step["seconds_left"]
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=step["step"] + 1, loss=step["loss"],
                            sps=sps, left=clock(left))
        else:
            self.line(f"step {step['step'] + 1}/{total} loss {step['loss']:.4f} "
                      f"{sps:.1f} samples/s, {clock(left)} left{optimizer_note(step)}")
        if step.get("skipped") and step.get("grad_norm") is None:  # fp16 without clipping
            self.line(f"step {step['step'] + 1}: the fp16 gradients overflowed: no weights "
                      f"were updated (loss scale now {step.get('loss_scale', 0.0):g})")
        elif step.get("skipped"):
            self.line(f"step {step['step'] + 1}: gradient norm {step['grad_norm']} is not "
                      "finite: no weights were updated")
        if step.get("eval"):
            held_out = ", ".join(f"{k} {v:.4f}" for k, v in sorted(step["eval"].items()))
            self.line(f"step {step['step'] + 1}: held-out {held_out}")

    def line(self, text: str) -> None:
        """One line on stderr: above the bar, or as is without one."""
        if self.bar is not None:
            console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)


def clock(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def optimizer_note(step: dict[str, Any]) -> str:
    """", lr X, grad norm Y" for a plain progress line (the norm with clipping only)."""
    note = f", lr {step['lr']:.3g}" if step.get("lr") else ""
    if step.get("grad_norm") is not None:
        note += f", grad norm {step['grad_norm']:.4g}"
    return note


@contextmanager
def progress(job: JobConfig, enabled: bool) -> Iterator[StepProgress]:
    """A StepProgress for the job's steps."""
    if not (enabled and console.is_terminal):
        yield StepProgress(None, None)
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]:.4f}"),
                  TextColumn("{task.fields[sps]:.0f} samples/s"), TimeElapsedColumn(),
                  TextColumn("{task.fields[left]} left"), console=console) as bar:
        task = bar.add_task(f"{job.schedule} x{job.workers}", total=job.steps, loss=float("nan"),
                            sps=0.0, left="-:--:--")
        yield StepProgress(bar, task)


def base_report(job: JobConfig, workers: int) -> dict[str, Any]:
    """Fields every report has."""
    return {"schedule": job.schedule, "workers": workers, "job": job.to_dict(), "steps": []}


def run_local(job: JobConfig, out: Path, *, progress: bool = True, threads: int = 0,
              metrics: bool = False, pin_cpus: bool = True) -> int:
    """Runs the job and writes report.json, weights.safetensors and loss.png into `out`.

    `threads` (0: cores / workers) is every process's torch thread count, the single
    process's included, so `single` and a pipeline compute bit-identical results.
    `metrics`: the cluster's services serve Prometheus /metrics (printed, and kept in
    `out`/logs/cluster.json). `pin_cpus`: each worker runs on cores of its own where there
    are enough ([Note: pinned workers] in pipefb/cpus.py).
    """
    threads = threads or default_threads(job.workers)
    if runs_in_process(job.schedule):
        torch.set_num_threads(threads)
        report = run_single(job, progress)
    else:
        report = run_cluster(job, out, progress, threads, metrics, pin_cpus)
    report["threads_per_process"] = threads
    weights = report.pop("_weights")
    report["eval"] = evaluate(job, weights)
    path = write_report(out, report, weights)
    if report.get("peak_memory_by_kind"):
        console.print(memory_table(report["peak_memory_by_kind"], report["steps"][-1],
                                   report["device"].get("peak_allocated_bytes")))
    held_out = ", ".join(f"held-out {k} {v:.4f}" for k, v in report["eval"].items())
    console.print(f"final loss {report['steps'][-1]['loss']:.4f}, "
                  f"{report['samples_per_second']:.1f} samples/s"
                  f"{'; ' + held_out if held_out else ''}; report: {path}")
    return 0


SHORT_KINDS = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim",
               "weight_versions": "versions", "activations": "live", "stashed": "stashed",
               "stash_in_flight": "in flight", "node_tier": "node tier"}


def memory_table(peaks: dict[str, dict[str, int]], last_step: dict[str, Any],
                 device_peaks: dict[str, int] | None = None) -> Table:
    """Per-worker peak memory by kind (KiB), as `pipefb local train` prints at the end;
    on CUDA also each worker's allocator peak (`device_peaks`)."""
    table = Table(title="peak memory per worker, KiB (F/B/C: forward/backward/combined stage)")
    table.add_column("rank", justify="right")
    table.add_column("stage")
    for kind in KINDS:
        table.add_column(SHORT_KINDS.get(kind, kind), justify="right")
    table.add_column("total", justify="right")
    if device_peaks:
        table.add_column("cuda peak", justify="right")
    roles = {str(w["rank"]): f"{w['role'][0].upper()}{w['stage']}" for w in last_step["workers"]}
    for rank, kinds in peaks.items():
        cells = [f"{kinds.get(k, 0) / 1024:,.1f}" for k in KINDS]
        cells.append(f"{sum(kinds.values()) / 1024:,.1f}")
        if device_peaks:
            cells.append(f"{device_peaks.get(rank, 0) / 1024:,.1f}")
        table.add_row(rank, roles.get(rank, ""), *cells)
    return table


def run_single(job: JobConfig, show: bool) -> dict[str, Any]:
    """The reference: every micro-batch in this process, with the workers' allocator
    settings."""
    keep_freed_memory()
    single = SingleProcess(job)
    report = base_report(job, 1)
    peak = 0
    rate = StepRate(job.batch_size)
    with progress(job, show) as bar:
        for s in single.run():
            if not math.isfinite(s.loss):
                raise NonFiniteLoss(f"step {s.step} has a non-finite loss ({s.loss})")
            rate.add(s.seconds)
            step = {"step": s.step, "loss": s.loss, "seconds": s.seconds,
                    "samples_per_second": s.samples_per_second,
                    "samples_per_second_median": rate.samples_per_second(),
                    "seconds_left": rate.seconds_left(job.steps - s.step - 1),
                    "lr": s.lr, "grad_norm": s.grad_norm, "skipped": s.skipped,
                    "loss_scale": s.loss_scale, "device_memory_bytes": s.device_memory_bytes}
            report["steps"].append(step)
            peak = max(peak, s.peak_memory_bytes)
            bar.update(step, job.steps)
    report["peak_memory_bytes"] = {"0": peak}
    report["device"] = device_summary(job, report["steps"])
    report["plan"] = {"schedule": "single", "microbatches": job.microbatches,
                      "microbatch_size": job.microbatch_size}
    report["_weights"] = single.weights()
    return report


def run_cluster(job: JobConfig, out: Path, show: bool, threads: int = 0,
                metrics: bool = False, pin_cpus: bool = True) -> dict[str, Any]:
    """A fresh local cluster with `job.workers` workers runs the job to the end."""
    from coordinator.client import CoordinatorClient

    cluster_file = local_cluster_file(job.workers, out) if job.plan == "auto" else None
    with LocalServices(job.workers, out / "logs", threads=threads,
                      extra_env={"PIPEFB_CHECKPOINT_ROOT": str(out.resolve())},
                      cluster_file=cluster_file, metrics=metrics,
                      restart=job.max_restarts > 0, pin_cpus=pin_cpus) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        for name, url in cluster.metrics_urls().items():
            console.print(f"metrics {name} -> {url}")
        client.wait_for_workers(job.workers)
        report = train_on(client, job, show)
        # each worker's cores in start order ([Note: pinned workers]); [] where unpinned
        report["worker_cpus"] = [format_cpu_list(c) for c in cluster.worker_cpus]
        return report


def train_on(client: Any, job: JobConfig, show: bool) -> dict[str, Any]:
    """Submits the job through a coordinator client, follows it to the end and builds its
    report (the weights under `_weights`, for `write_report`)."""
    from protos.convert import plan_from_proto

    report = base_report(job, job.workers)
    job_id = client.submit(job).job_id
    last = None
    with progress(job, show) as bar:
        for last in client.follow(job_id, RECONNECT_SECONDS if job.max_restarts else 0):
            step = step_dict(last)
            report["steps"].append(step)
            bar.update(step, job.steps)
    if last is not None:
        report["timeline"] = timeline(last)
    report["job_id"] = job_id
    status = client.status(job_id)
    report["restarts"] = list(status.restarts)  # why each replayed attempt failed
    report["start_step"] = status.start_step  # where the last attempt started (a checkpoint)
    # checkpoints a resume or replay passed over, and why ([Note: manifests])
    report["refused_checkpoints"] = list(status.refused_checkpoints)
    for why in status.refused_checkpoints:
        console.print(f"checkpoint refused: {why}; the job started from step "
                      f"{status.start_step}")
    plan = plan_from_proto(status.plan)
    report["plan"] = plan.to_dict()
    report["groups"] = plan.group_ranks()  # the ranks of each pipeline group
    if status.planner_json:
        report["planner"] = json.loads(status.planner_json)
    report["_weights"] = client.weights(job_id)
    report["peak_memory_bytes"], report["peak_memory_by_kind"] = peaks_by_rank(report["steps"])
    report["device"] = device_summary(job, report["steps"])
    return report


def local_cluster_file(workers: int, out: Path) -> Path:
    """`out`/cluster.yaml: this machine's cluster description for `workers` workers
    (measured once, cached), what the coordinator plans "auto" on, with the cap of the
    workers' node-local tier (`calibration.store.tier_cap`); without the tier where the
    environment turns the workers' off (`TIER_ENV` empty)."""
    from calibration.cluster import local_cluster

    path = out / "cluster.yaml"
    out.mkdir(parents=True, exist_ok=True)
    cluster = local_cluster(workers)
    if os.environ.get(TIER_ENV) == "":
        cluster = replace(cluster, local_tier=None, local_tier_bytes=math.inf,
                          shared_tier=None)
    path.write_text(yaml.safe_dump(cluster.to_dict(), sort_keys=False))
    return path


def step_dict(msg: Any) -> dict[str, Any]:
    """A StepReport message as the report's step entry."""
    return {
        "step": msg.step, "loss": msg.loss, "seconds": msg.seconds,
        "samples_per_second": msg.samples_per_second,
        "samples_per_second_median": msg.samples_per_second_median,
        "seconds_left": msg.seconds_left, "lr": msg.lr,
        "grad_norm": msg.grad_norm if msg.HasField("grad_norm") else None,
        "skipped": msg.skipped, "loss_scale": msg.loss_scale, "eval": dict(msg.eval),
        "workers": [{"rank": w.rank, "worker_id": w.worker_id, "role": w.role, "stage": w.stage,
                     "group": w.group,
                     "compute_seconds": w.compute_seconds, "idle_seconds": w.idle_seconds,
                     "peak_memory_bytes": w.peak_memory_bytes,
                     "memory_bytes": dict(w.memory_bytes), "bytes_sent": w.bytes_sent,
                     "bytes_stashed": w.bytes_stashed,
                     "action_seconds": dict(w.action_seconds),
                     "weight_version": w.weight_version,
                     "versions": [[v.action, v.step, v.version] for v in w.versions],
                     "kept_versions": list(w.kept_versions),
                     "kind_peak_bytes": dict(w.kind_peak_bytes),
                     "activation_peak_bytes": w.activation_peak_bytes,
                     "device_memory_bytes": dict(w.device_memory_bytes),
                     "weights_digest": w.weights_digest,
                     "metrics": dict(w.metrics)} for w in msg.workers],
    }


def timeline(msg: Any) -> dict[str, Any]:
    """One step's executed actions per rank, times relative to the step's first action."""
    t0 = min((s.start for w in msg.workers for s in w.spans), default=0.0)
    return {"step": msg.step, "ranks": [
        {"rank": w.rank, "role": w.role, "stage": w.stage, "group": w.group,
         "spans": [[s.action, s.start - t0, s.end - t0] for s in w.spans]}
        for w in msg.workers]}


def device_summary(job: JobConfig, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """report.json's `device`: where the job computed and, on CUDA, each rank's highest
    allocator peak over all steps (`peak_allocated_bytes`, `peak_reserved_bytes`)."""
    out: dict[str, Any] = {"type": job.device}
    if job.device == "cuda" and torch.cuda.is_available():
        out["name"] = torch.cuda.get_device_name()
    allocated: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for step in steps:
        # a pipeline's step has one entry per rank; the single process's step is its own
        for w in step.get("workers") or [{"rank": 0, **step}]:
            stats, rank = w.get("device_memory_bytes") or {}, str(w["rank"])
            if stats:
                allocated[rank] = max(allocated.get(rank, 0), stats["allocated_peak"])
                reserved[rank] = max(reserved.get(rank, 0), stats["reserved_peak"])
    if allocated:
        out["peak_allocated_bytes"], out["peak_reserved_bytes"] = allocated, reserved
    return out


def peaks_by_rank(steps: list[dict[str, Any]]
                  ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Each rank's highest accounted peak over all steps, and its bytes by kind then."""
    best: dict[str, tuple[int, dict[str, int]]] = {}
    for step in steps:
        for w in step["workers"]:
            key = str(w["rank"])
            if key not in best or w["peak_memory_bytes"] > best[key][0]:
                best[key] = (w["peak_memory_bytes"], dict(w["memory_bytes"]))
    ranks = sorted(best, key=int)
    return {r: best[r][0] for r in ranks}, {r: best[r][1] for r in ranks}
