"""Where a bench's results go: `results.json` and its chart in the `--out` folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_results(out: Path | None, results: dict[str, Any],
                  chart: Callable[[dict[str, Any], Path], None] | None = None,
                  png: str = "chart.png") -> None:
    """Writes `out/results.json` and, with a `chart`, `out/<png>`; nothing when `out` is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if chart is not None:
        chart(results, out / png)
