"""The step metrics catalogue: figures a rank reports by name for each step, which the
worker, the coordinator and report.json carry without code of their own for each one.

[Note: step metrics] A rank adds to a metric while a step runs (`Iteration.count`); the
step's `StepResult.metrics` holds every catalogue metric (0 where nothing counted), the
worker's `StepReply.metrics` and the coordinator's `WorkerStepStats.metrics` carry the
map as it is, report.json keeps it per rank, and the worker and the coordinator each
export a Prometheus counter per entry:
`pipefb_worker_<name>_total{job, worker, role}` (the rank's sum over steps) and
`pipefb_job_<name>_total{job}` (the sum over every rank). A new metric is one entry
here, the line in the runtime that counts it, and its row in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepMetric:
    """One metric a step reports."""

    name: str  # snake_case, its base unit last (`_seconds`, `_bytes`, `_count`)
    help: str  # the Prometheus help text


STEP_METRICS: tuple[StepMetric, ...] = (
    StepMetric("store_blocked_seconds",
               "Seconds the compute thread spent in STASH and FETCH actions (on the "
               "offload store)"),
)
STEP_METRIC_NAMES = frozenset(m.name for m in STEP_METRICS)


def step_metrics(counted: dict[str, float]) -> dict[str, float]:
    """Every catalogue metric's value for a step from what the step counted.

    Raises:
        KeyError: a counted name that is not in the catalogue.
    """
    unknown = set(counted) - STEP_METRIC_NAMES
    if unknown:
        raise KeyError(f"step metrics {sorted(unknown)} are not in STEP_METRICS")
    return {m.name: float(counted.get(m.name, 0.0)) for m in STEP_METRICS}
