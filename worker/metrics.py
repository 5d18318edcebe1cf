"""A worker's Prometheus metrics, updated from each step's StepResult (see docs/metrics.md)."""

from __future__ import annotations

import contextlib
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from offload_store import StoreStats
from pipefb.memory import KINDS
from pipefb.runtime.result import StepResult
from pipefb.runtime.step_metrics import STEP_METRICS

# Seconds of one F or B action (or a B's recompute): tiny layers take well under a
# millisecond on a cpu, a large stage seconds.
COMPUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASES = ("forward", "backward", "recompute")
CHANNELS = ("grpc", "store")


class WorkerMetrics:
    """The metrics of one worker process; `worker` is its name (the `worker` label)."""

    def __init__(self, worker: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._job = ""  # the job whose gauges are exported
        self._store_seen = StoreStats()  # the store counters at the previous step
        job_role, job_worker = ["job", "worker", "role"], ["job", "worker"]

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: list[str]) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.samples = counter("pipefb_worker_samples_total",
                               "Samples whose forward (backward on backward workers) ran here",
                               job_role)
        self.steps = counter("pipefb_worker_steps_total", "Steps this worker finished", job_role)
        self.compute = Histogram(
            "pipefb_worker_compute_seconds", "Seconds of one forward, backward or recompute "
            "action", [*job_role, "phase"], buckets=COMPUTE_BUCKETS, registry=registry)
        self.idle = counter("pipefb_worker_idle_seconds_total",
                            "Seconds spent waiting for peers, the store or weights (bubble)",
                            job_role)
        self.sent = counter("pipefb_worker_sent_bytes_total",
                            "Tensor bytes sent to peers (grpc) or stashed (store)",
                            [*job_worker, "channel"])
        self.received = counter("pipefb_worker_received_bytes_total",
                                "Tensor bytes received from peers (grpc) or fetched (store)",
                                [*job_worker, "channel"])
        self.stash_bytes = gauge("pipefb_worker_stash_bytes",
                                 "Bytes this worker stashed in the store during the last step",
                                 job_worker)
        self.stash_keys = gauge("pipefb_worker_stash_keys",
                                "Keys this worker stashed in the store during the last step",
                                job_worker)
        self.memory = gauge("pipefb_worker_memory_bytes",
                            "Bytes by kind at the last step's peak (pipefb.memory.KINDS)",
                            [*job_worker, "kind"])
        self.peak = gauge("pipefb_worker_peak_memory_bytes",
                          "Peak accounted bytes of the last step, all kinds", job_worker)
        self.version = gauge("pipefb_worker_weight_version",
                             "Weight version after the last step", job_worker)
        self.grad_norm = gauge("pipefb_worker_grad_norm",
                               "The whole model's gradient norm before clipping, last step "
                               "(weight owners of jobs with clip_grad_norm)", job_worker)
        self.retries = counter("pipefb_worker_store_retries_total",
                               "Backoff sleeps after the store refused a write (full)",
                               ["worker"])
        self.retries.labels(worker)  # exported as 0 from the start
        self.catalogue = {m.name: counter(f"pipefb_worker_{m.name}_total", m.help, job_role)
                          for m in STEP_METRICS}  # [Note: step metrics]
        self._gauges = (self.stash_bytes, self.stash_keys, self.peak, self.version,
                        self.grad_norm)

    def assigned(self, job: str, role: str) -> None:
        """A new job rank: its counters start at 0 and the previous job's gauges go."""
        with self._lock:
            if self._job and self._job != job:
                self._remove_gauges(self._job)
            self._job, self._store_seen = job, StoreStats()
        for m in (self.samples, self.steps, self.idle, *self.catalogue.values()):
            m.labels(job, self.worker, role)
        for channel in CHANNELS:
            self.sent.labels(job, self.worker, channel)
            self.received.labels(job, self.worker, channel)

    def _remove_gauges(self, job: str) -> None:
        for g in self._gauges:
            _remove(g, job, self.worker)
        for kind in KINDS:
            _remove(self.memory, job, self.worker, kind)

    def received_grpc(self, job: str, nbytes: int) -> None:
        """Counts tensor bytes a peer streamed to this worker."""
        self.received.labels(job, self.worker, "grpc").inc(nbytes)

    def step(self, job: str, role: str, result: StepResult, store: StoreStats | None) -> None:
        """Updates every metric from one finished step; `store` is the rank's offload store
        counters now (None without a store)."""
        labels = (job, self.worker, role)
        self.samples.labels(*labels).inc(result.samples)
        self.steps.labels(*labels).inc()
        self.idle.labels(*labels).inc(result.idle_seconds)
        for phase, seconds in result.phase_seconds:
            self.compute.labels(*labels, phase).observe(seconds)
        self.sent.labels(job, self.worker, "grpc").inc(result.bytes_sent)
        self.sent.labels(job, self.worker, "store").inc(result.bytes_stashed)
        self.stash_bytes.labels(job, self.worker).set(result.bytes_stashed)
        self._store_step(job, store or StoreStats())
        for kind, nbytes in result.memory_bytes.items():
            self.memory.labels(job, self.worker, kind).set(nbytes)
        self.peak.labels(job, self.worker).set(result.peak_memory_bytes)
        self.version.labels(job, self.worker).set(result.weight_version)
        if result.grad_norm is not None:
            self.grad_norm.labels(job, self.worker).set(result.grad_norm)
        for name, value in result.metrics.items():
            self.catalogue[name].labels(*labels).inc(value)

    def _store_step(self, job: str, now: StoreStats) -> None:
        """What the store counters gained since the previous step."""
        with self._lock:
            seen, self._store_seen = self._store_seen, now
        self.received.labels(job, self.worker, "store").inc(now.bytes_taken - seen.bytes_taken)
        self.stash_keys.labels(job, self.worker).set(now.keys_put - seen.keys_put)
        self.retries.labels(self.worker).inc(now.retries - seen.retries)


def _remove(metric: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set
        metric.remove(*labels)
