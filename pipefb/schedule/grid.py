"""ASCII worker x step grids of schedules and dry-run traces, with marked cells."""

from __future__ import annotations

from collections.abc import Iterable, Set

from pipefb.schedule.ir import Action, Schedule

#: (worker, time, action) rows of a dry run, in execution order.
Trace = list[tuple[int, int, Action]]
#: (worker, column) cells to mark: a list index for schedules, a time tick for traces.
Cells = Set[tuple[int, int]]


def _rows(schedule_or_trace: Schedule | Trace) -> dict[int, dict[int, str]]:
    rows: dict[int, dict[int, str]] = {}
    if isinstance(schedule_or_trace, dict):
        for worker, actions in schedule_or_trace.items():
            rows[worker] = {i: str(a) for i, a in enumerate(actions)}
    else:
        for worker, time, action in schedule_or_trace:
            rows.setdefault(worker, {})[time] = str(action)
    return dict(sorted(rows.items()))


def _line(cells: Iterable[str], width: int) -> str:
    return " ".join(c.ljust(width) for c in cells).rstrip()


def format_grid(schedule_or_trace: Schedule | Trace, mark: Cells = frozenset()) -> str:
    """Renders rows = workers, columns = list index (schedule) or time tick (trace).

    Marked cells read `>1B0<`, so an error points at the action at fault::

        worker | 0     1     2
        -------+--------------
        w0     | 0F0   >0B0< 0OPT

    Args:
        schedule_or_trace: a schedule, or the trace `dry_run` returns.
        mark: (worker, column) cells to mark.

    Returns:
        The table, lines joined by newlines, no trailing spaces.
    """
    rows = _rows(schedule_or_trace)
    for worker, column in mark:
        row = rows.setdefault(worker, {})
        row[column] = f">{row.get(column, '')}<"
    n_cols = max((max(r) + 1 for r in rows.values() if r), default=0)
    width = max([len(str(n_cols))] + [len(c) for r in rows.values() for c in r.values()])
    label = max([len("worker")] + [len(f"w{w}") for w in rows])
    header = f"{'worker'.ljust(label)} | " + _line((str(i) for i in range(n_cols)), width)
    lines = [header.rstrip(), "-" * (label + 1) + "+" + "-" * (len(header) - label - 2)]
    for worker, row in rows.items():
        cells = (row.get(i, "") for i in range(n_cols))
        lines.append(f"{f'w{worker}'.ljust(label)} | {_line(cells, width)}".rstrip())
    return "\n".join(lines)


def format_table(schedule: Schedule) -> str:
    """Renders a schedule as a Markdown table (one row per worker) for docs.

    Returns:
        `| worker | actions |` rows, actions separated by spaces.
    """
    lines = ["| worker | actions |", "| --- | --- |"]
    for worker, actions in sorted(schedule.items()):
        lines.append(f"| {worker} | {' '.join(map(str, actions))} |")
    return "\n".join(lines)
