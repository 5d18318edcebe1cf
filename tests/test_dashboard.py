"""The generated Grafana dashboard: unique panel ids, contract-only queries, no drift."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import dashboard
from tests.metric_contract import (
    METRIC_NAME,
    SELECTOR,
    all_panels,
    contract_metric,
    labels_used,
    queries,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return json.loads(dashboard.dashboard_json())


def test_panel_ids_are_unique_and_positive(board: dict[str, Any]) -> None:
    ids = [p["id"] for p in all_panels(board)]
    assert len(ids) == len(set(ids)) == 36
    assert min(ids) == 1


def test_panels_fit_the_grid_without_overlap(board: dict[str, Any]) -> None:
    cells: set[tuple[int, int]] = set()
    for p in all_panels(board):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, f"{p['title']} overlaps another panel"
        cells |= area


def test_every_query_names_only_contract_metrics_and_their_labels(
        board: dict[str, Any]) -> None:
    exprs = queries(board)
    assert len(exprs) == 38
    for expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, f"no pipefb metric in {expr!r}"
        selected = [n for n, _ in SELECTOR.findall(expr)]
        assert all(n.startswith("pipefb_") for n in selected), f"foreign selector in {expr!r}"
        known = [contract_metric(n) for n in names]
        assert None not in known, f"{expr!r} names a metric outside the contract"
        allowed = set().union(*(labels for _, labels in known if labels))
        assert labels_used(expr) <= allowed, f"{expr!r} uses labels outside {sorted(allowed)}"


def test_the_checker_catches_foreign_names_and_labels() -> None:
    assert contract_metric("pipefb_job_step_seconds_bucket") == ("pipefb_job_step_seconds",
                                                                 {"job", "le"})
    assert contract_metric("pipefb_job_loss_sum") is None  # a gauge has no _sum series
    assert contract_metric("pipefb_worker_stage_seconds") is None
    expr = 'sum by (stage, le) (rate(pipefb_x{job=~"$job", worker!=""}[5m]))'
    assert labels_used(expr) == {"stage", "le", "job", "worker"}


def test_the_issue_panels_are_all_there(board: dict[str, Any]) -> None:
    """Throughput, loss, compute vs idle, bubble, memory by kind, bytes/s, store memory,
    weight-version lag, migrations and restarts; learning rate, gradient norm and
    skipped steps."""
    text = "\n".join(queries(board))
    needed = ["pipefb_job_samples_per_second", "pipefb_job_loss",
              "pipefb_worker_compute_seconds_sum", "pipefb_worker_idle_seconds_total",
              "pipefb_job_bubble_fraction", "pipefb_worker_memory_bytes",
              "rate(pipefb_worker_sent_bytes_total", "rate(pipefb_worker_received_bytes_total",
              "pipefb_worker_stash_bytes", "pipefb_store_used_memory_bytes",
              "pipefb_job_weight_version_lag", "pipefb_migrations_total",
              "pipefb_restarts_total", "pipefb_job_learning_rate", "pipefb_job_grad_norm",
              "pipefb_job_skipped_steps_total"]
    assert [n for n in needed if n not in text] == []
    memory = next(p for p in all_panels(board) if p["title"] == "Memory per worker by kind")
    assert memory["targets"][0]["legendFormat"] == "{{worker}} {{kind}}"


def test_every_query_metric_is_documented(board: dict[str, Any]) -> None:
    doc = ROOT / "docs" / "metrics.md"
    if not doc.exists():
        pytest.skip("docs/metrics.md not written yet (the metrics branch adds it)")
    text = doc.read_text()
    names = {contract_metric(n)[0] for e in queries(board) for n in METRIC_NAME.findall(e)}  # type: ignore[index]
    assert sorted(n for n in names if n not in text) == []


def test_committed_configmap_equals_a_fresh_generation() -> None:
    """Regenerate with: python -m deploy.dashboard"""
    committed = dashboard.CONFIGMAP_PATH.read_text()
    assert committed == dashboard.configmap_yaml()
    doc = yaml.safe_load(committed)
    assert doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "pipefb-dashboard"
    assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(doc["data"]["pipefb.json"])
    assert (board["uid"], board["title"]) == ("pipefb-training", "pipefb training")


def test_check_flag_reports_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    out = tmp_path / "cm.yaml"
    assert dashboard.main(["--check", "--out", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
    assert dashboard.main(["--out", str(out)]) == 0
    assert dashboard.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("pipefb_job_loss", "pipefb_job_lost"))
    assert dashboard.main(["--check", "--out", str(out)]) == 1
