"""How a planning result is shown: rich tables of group counts and candidates, timelines."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.table import Table

from pipefb.planner.groups import GroupSearch
from pipefb.planner.job import label


def groups_table(result: GroupSearch, batch_size: int) -> Table:
    """Every group count: the training-time model's time and, where searched, the
    simulated one."""
    table = Table(title="pipeline groups (data-parallel across groups)")
    for name in ("groups", "each group", "model ms", "simulated ms", "samples/s", "note"):
        table.add_column(name, justify="right" if "ms" in name or name in (
            "groups", "samples/s") else "left")
    for c in result.choices:
        row = c.row(batch_size)
        done = math.isfinite(c.step_seconds)
        table.add_row(str(c.groups), row["per_group"], f"{row['model_ms']:.2f}",
                      f"{row['simulated_ms']:.2f}" if done else "-",
                      f"{row['samples_per_second']:.1f}" if done else "-",
                      "chosen" if c.groups == result.best.groups else c.note or "slower")
    return table


def candidates_table(result: GroupSearch, batch_size: int, limit: int = 12) -> Table:
    """The chosen group count's candidates for one group as a rich table; the chosen one
    first (samples/s per group: `batch_size` is the group's share)."""
    table = Table(title=f"plans considered for one of {result.best.groups} group(s) "
                        "(simulated; best first)")
    for name in ("candidate", "step ms", "samples/s", "peak MiB", "bubble", "partition",
                 "policy", "note"):
        table.add_column(name, justify="right" if name in ("step ms", "samples/s",
                                                           "peak MiB", "bubble") else "left")
    for c in result.search.candidates[:limit]:
        done = math.isfinite(c.step_seconds)
        row = c.row()
        parts = (str(row["forward_partition"]) if row["forward_partition"] ==
                 row["backward_partition"] else
                 f"F{row['forward_partition']} B{row['backward_partition']}")
        table.add_row(c.label, f"{c.step_seconds * 1e3:.2f}" if done else "-",
                      f"{batch_size / c.step_seconds:.1f}" if done else "-",
                      f"{row['peak_memory_bytes'] / 2**20:.1f}" if done else "-",
                      f"{c.bubble_fraction:.0%}" if done else "-", parts, row["policy"],
                      c.note or "chosen")
    return table


def write_timeline(result: GroupSearch, path: Path, measured: dict[str, Any] | None = None
                   ) -> Path:
    """The simulated timeline of the chosen plan (its first group), beside a measured one
    when given."""
    from pipefb.app.report import plot_timelines

    panels = [(f"simulated: {label(result)}, "
               f"{result.best.step_seconds * 1e3:.1f} ms/step", result.simulation.timeline())]
    if measured is not None:
        panels.append((f"measured: step {measured['step']}", measured))
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_timelines(panels, path)
    return path
