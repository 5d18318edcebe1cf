"""The coordinator's Prometheus metrics: jobs from each step report, the worker registry,
and the offload store's memory (see docs/metrics.md)."""

from __future__ import annotations

import contextlib
import logging
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from coordinator.registry import Registry
from offload_store import StoreAdmin, StoreUnavailable, open_admin
from pipefb.runtime.step_metrics import STEP_METRICS
from pipefb.schedule import Action, Kind
from protos import coordinator_pb2

log = logging.getLogger(__name__)

# Seconds of one training step, from a few milliseconds (tiny models) to minutes.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                300.0)
STORE_TIMEOUT_SECONDS = 2.0  # the memory query is tiny; a slow store must not hold up a step report


class CoordinatorMetrics:
    """Job, registry and store metrics of one coordinator process."""

    def __init__(self, workers: Registry, store_address: str,
                 registry: CollectorRegistry = REGISTRY) -> None:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("job",)) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.step = gauge("pipefb_job_step", "Index of the job's last finished step (0-based)")
        self.loss = gauge("pipefb_job_loss", "Mean training loss of the last step")
        self.samples_per_second = gauge("pipefb_job_samples_per_second",
                                        "Batch size / the median step seconds of the last "
                                        "steps (pipefb.runtime.throughput)")
        self.lr = gauge("pipefb_job_learning_rate", "Learning rate of the last step's update")
        self.grad_norm = gauge("pipefb_job_grad_norm", "The whole model's gradient norm "
                               "before clipping, last step (jobs with clip_grad_norm)")
        self.skipped = Counter("pipefb_job_skipped_steps_total", "Steps whose gradient norm "
                               "was not finite, or whose fp16 gradients overflowed, so no "
                               "weight owner updated", ["job"],
                               registry=registry)
        self.loss_scale = gauge("pipefb_job_loss_scale", "fp16: the loss scale of the next "
                                "step (halved after an overflow; jobs with precision fp16)")
        self.step_seconds = Histogram("pipefb_job_step_seconds", "Seconds of each step",
                                      ["job"], buckets=STEP_BUCKETS, registry=registry)
        self.predicted = gauge("pipefb_job_predicted_step_seconds",
                               "Step seconds the planner predicted (0: no prediction)")
        self.bubble = gauge("pipefb_job_bubble_fraction",
                            "Idle / (compute + idle) summed over the workers, last step")
        self.version_lag = gauge("pipefb_job_weight_version_lag",
                                 "Newest weight version minus the oldest a forward used, "
                                 "last step")
        self.migrations = Counter("pipefb_migrations_total", "Live layer migrations", ["job"],
                                  registry=registry)
        self.migrated_bytes_total = Counter(
            "pipefb_migrated_bytes_total", "Bytes of weights and optimizer state that layer "
            "migrations moved between workers", ["job"], registry=registry)
        self.migration_seconds = Counter(
            "pipefb_migration_seconds_total", "Seconds layer migrations took, from the pause "
            "at the step boundary to running again", ["job"], registry=registry)
        self.restarts = Counter("pipefb_restarts_total", "Job restarts after a failure",
                                ["job"], registry=registry)
        self.registered = gauge("pipefb_workers_registered", "Workers in the registry", ())
        self.registered.set_function(lambda: len(workers.workers()))
        self.alive = gauge("pipefb_workers_alive", "Registered workers whose heartbeats arrive",
                           ())
        self.alive.set_function(lambda: sum(workers.alive(w) for w in workers.workers()))
        self.store_memory = gauge("pipefb_store_used_memory_bytes",
                                  "The offload store's INFO used_memory, read at each step", ())
        self._store_address = store_address
        self._store: StoreAdmin | None = None
        self._lock = threading.Lock()
        self.catalogue = {m.name: Counter(f"pipefb_job_{m.name}_total", f"{m.help}, every "
                                          "rank", ["job"], registry=registry)
                          for m in STEP_METRICS}  # [Note: step metrics]
        self._per_job = (self.step, self.loss, self.samples_per_second, self.lr,
                         self.grad_norm, self.skipped, self.loss_scale, self.step_seconds,
                         self.predicted, self.bubble, self.version_lag, self.migrations,
                         self.migrated_bytes_total, self.migration_seconds, self.restarts,
                         *self.catalogue.values())

    def job_started(self, job: str) -> None:
        """Exports the job's counters (0 so far), its prediction (none yet) and the store's
        memory before any step."""
        self.migrations.labels(job)
        self.migrated_bytes_total.labels(job)
        self.migration_seconds.labels(job)
        self.restarts.labels(job)
        self.skipped.labels(job)
        for counter in self.catalogue.values():
            counter.labels(job)
        self.predicted.labels(job).set(0.0)
        self.read_store()

    def migrated(self, job: str) -> None:
        """Counts one migration of the job's layers."""
        self.migrations.labels(job).inc()

    def migration_done(self, job: str, count: int, seconds: float) -> None:
        """Adds the bytes one migration moved and the seconds it took."""
        self.migrated_bytes_total.labels(job).inc(count)
        self.migration_seconds.labels(job).inc(seconds)

    def restarted(self, job: str) -> None:
        """Counts one restart of the job (a failed attempt replayed)."""
        self.restarts.labels(job).inc()

    def step_done(self, report: coordinator_pb2.StepReport, predicted_seconds: float) -> None:
        """Updates the job's metrics from a step report, then reads the store's memory."""
        job = report.job_id
        self.step.labels(job).set(report.step)
        self.loss.labels(job).set(report.loss)
        self.samples_per_second.labels(job).set(report.samples_per_second_median)
        self.lr.labels(job).set(report.lr)
        if report.HasField("grad_norm"):
            self.grad_norm.labels(job).set(report.grad_norm)
        if report.skipped:
            self.skipped.labels(job).inc()
        if report.loss_scale:  # fp16 only
            self.loss_scale.labels(job).set(report.loss_scale)
        self.step_seconds.labels(job).observe(report.seconds)
        self.predicted.labels(job).set(predicted_seconds)
        self.bubble.labels(job).set(bubble_fraction(report))
        self.version_lag.labels(job).set(weight_version_lag(report))
        for w in report.workers:
            for name, value in w.metrics.items():
                if name in self.catalogue:  # a newer worker's metric is not exported here
                    self.catalogue[name].labels(job).inc(value)
        self.read_store()

    def read_store(self) -> None:
        """Sets pipefb_store_used_memory_bytes from the store's used memory; logs a failure."""
        try:
            with self._lock:
                if self._store is None:
                    self._store = open_admin(self._store_address,
                                             timeout_seconds=STORE_TIMEOUT_SECONDS)
                used = self._store.used_memory()
            self.store_memory.set(used)
        except (StoreUnavailable, OSError, ValueError) as error:
            log.warning("cannot read the store's used_memory: %s", error)

    def forget(self, job: str) -> None:
        """Removes a forgotten job's series."""
        for metric in self._per_job:
            with contextlib.suppress(KeyError):
                metric.remove(job)


def bubble_fraction(report: coordinator_pb2.StepReport) -> float:
    """Idle / (compute + idle) over the step's workers (0 when nothing was timed)."""
    idle = sum(w.idle_seconds for w in report.workers)
    busy = idle + sum(w.compute_seconds for w in report.workers)
    return idle / busy if busy > 0 else 0.0


def weight_version_lag(report: coordinator_pb2.StepReport) -> int:
    """The newest weight version after the step minus the oldest one a forward of the step
    used: 1 in sync mode (step v's forwards use v, its OPT makes v + 1), 1 + staleness in
    async PipeFB; 0 when the step ran no forward."""
    forwards = [v.version for w in report.workers for v in w.versions
                if Action.parse(v.action).kind is Kind.F]
    if not forwards:
        return 0
    return int(max(w.weight_version for w in report.workers)) - min(forwards)
