"""The step metrics catalogue ([Note: step metrics]): what a step counts, what it reports,
and that docs/metrics.md documents every series the catalogue makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipefb.runtime.result import Iteration
from pipefb.runtime.step_metrics import STEP_METRICS, step_metrics
from pipefb.schedule import Kind
from tests.metric_contract import CONTRACT

ROOT = Path(__file__).resolve().parent.parent


def test_a_step_reports_every_catalogue_metric_with_zero_where_nothing_counted() -> None:
    assert step_metrics({}) == {m.name: 0.0 for m in STEP_METRICS}


def test_a_name_outside_the_catalogue_is_refused() -> None:
    with pytest.raises(KeyError, match="not_a_metric"):
        step_metrics({"not_a_metric": 1.0})


def test_stash_and_fetch_count_as_blocked_on_the_store() -> None:
    it = Iteration(step=0)
    it.record("0F0", Kind.F, 0.0, 0.5)
    it.record("0STASH0", Kind.STASH, 0.5, 0.25)
    it.record("0FETCH0", Kind.FETCH, 0.75, 0.125)
    it.record("0RECV_F0", Kind.RECV_F, 0.875, 1.0)
    assert step_metrics(it.counted)["store_blocked_seconds"] == 0.375
    assert it.compute == 0.5 and it.idle == 1.125  # FETCH is a wait; STASH is neither


@pytest.mark.parametrize("metric", [m.name for m in STEP_METRICS])
def test_each_catalogue_metric_is_documented_and_in_the_contract(metric: str) -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for series in (f"pipefb_worker_{metric}_total", f"pipefb_job_{metric}_total"):
        assert f"`{series}`" in doc
        assert CONTRACT[series][0] == "counter"
