"""The metric contract of issue 7 (docs/metrics.md) and a reader of PromQL for the tests:
which metrics and labels a dashboard query names."""

from __future__ import annotations

import re
from typing import Any

from pipefb.runtime.step_metrics import STEP_METRICS

# The metric contract (issue 7, docs/metrics.md): name -> (type, labels).
_WORKER = ("job", "worker", "role")
_GRPC = ("grpc_service", "grpc_method", "grpc_code")
CONTRACT: dict[str, tuple[str, tuple[str, ...]]] = {
    "pipefb_worker_samples_total": ("counter", _WORKER),
    "pipefb_worker_steps_total": ("counter", _WORKER),
    "pipefb_worker_compute_seconds": ("histogram", (*_WORKER, "phase")),
    "pipefb_worker_idle_seconds_total": ("counter", _WORKER),
    "pipefb_worker_sent_bytes_total": ("counter", ("job", "worker", "channel")),
    "pipefb_worker_received_bytes_total": ("counter", ("job", "worker", "channel")),
    "pipefb_worker_stash_bytes": ("gauge", ("job", "worker")),
    "pipefb_worker_stash_keys": ("gauge", ("job", "worker")),
    "pipefb_worker_memory_bytes": ("gauge", ("job", "worker", "kind")),
    "pipefb_worker_peak_memory_bytes": ("gauge", ("job", "worker")),
    "pipefb_worker_weight_version": ("gauge", ("job", "worker")),
    "pipefb_worker_store_retries_total": ("counter", ("worker",)),
    "pipefb_worker_grad_norm": ("gauge", ("job", "worker")),
    "pipefb_job_step": ("gauge", ("job",)),
    "pipefb_job_loss": ("gauge", ("job",)),
    "pipefb_job_samples_per_second": ("gauge", ("job",)),
    "pipefb_job_learning_rate": ("gauge", ("job",)),
    "pipefb_job_grad_norm": ("gauge", ("job",)),
    "pipefb_job_skipped_steps_total": ("counter", ("job",)),
    "pipefb_job_loss_scale": ("gauge", ("job",)),
    "pipefb_job_step_seconds": ("histogram", ("job",)),
    "pipefb_job_predicted_step_seconds": ("gauge", ("job",)),
    "pipefb_job_bubble_fraction": ("gauge", ("job",)),
    "pipefb_job_weight_version_lag": ("gauge", ("job",)),
    "pipefb_workers_registered": ("gauge", ()),
    "pipefb_workers_alive": ("gauge", ()),
    "pipefb_migrations_total": ("counter", ("job",)),
    "pipefb_migrated_bytes_total": ("counter", ("job",)),
    "pipefb_migration_seconds_total": ("counter", ("job",)),
    "pipefb_restarts_total": ("counter", ("job",)),
    "pipefb_store_used_memory_bytes": ("gauge", ()),
    "pipefb_grpc_server_handled_total": ("counter", _GRPC),
    "pipefb_grpc_server_handling_seconds": ("histogram", _GRPC[:2]),
}
# The step metrics catalogue's series ([Note: step metrics]).
for _metric in STEP_METRICS:
    CONTRACT[f"pipefb_worker_{_metric.name}_total"] = ("counter", _WORKER)
    CONTRACT[f"pipefb_job_{_metric.name}_total"] = ("counter", ("job",))
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}")
METRIC_NAME = re.compile(r"\bpipefb_\w+")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def contract_metric(series: str) -> tuple[str, set[str]] | None:
    """The contract metric a series name belongs to, and the labels it carries."""
    if series in CONTRACT:
        return series, set(CONTRACT[series][1])
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and CONTRACT.get(base, ("",))[0] == "histogram":
            extra = {"le"} if suffix == "_bucket" else set()
            return base, set(CONTRACT[base][1]) | extra
    return None


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels of collapsed rows included."""
    out = []
    for panel in board["panels"]:
        out += [panel, *panel.get("panels", [])]
    return out


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and the query variables."""
    exprs = [t["expr"] for p in all_panels(board) for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def labels_used(expr: str) -> set[str]:
    """Label names in matchers, by/without clauses and label_values()."""
    used = {m for _, body in SELECTOR.findall(expr) for m in _MATCHER.findall(body)}
    used |= {x.strip() for group in _BY.findall(expr) for x in group.split(",") if x.strip()}
    used |= set(re.findall(r"label_values\([^,]+,\s*(\w+)\)", expr))
    return used
