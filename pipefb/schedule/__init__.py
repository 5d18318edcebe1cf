"""The schedule IR: actions, topologies, kinds and their generators, lowering, validation
and dry run."""

from pipefb.schedule.generators.gpipe import gpipe
from pipefb.schedule.generators.one_f_one_b import one_f_one_b
from pipefb.schedule.generators.pipedream import pipedream
from pipefb.schedule.generators.pipefb import pipefb
from pipefb.schedule.grid import Trace, format_grid, format_table
from pipefb.schedule.ir import Action, Kind, Schedule, Topology, iteration
from pipefb.schedule.kinds import (
    KINDS,
    SCHEDULES,
    ScheduleKind,
    generate,
    runs_in_process,
    schedule_kind,
)
from pipefb.schedule.lowering import lower
from pipefb.schedule.validate import dry_run, validate

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleKind",
    "Topology",
    "Trace",
    "dry_run",
    "format_grid",
    "format_table",
    "generate",
    "gpipe",
    "iteration",
    "lower",
    "one_f_one_b",
    "pipedream",
    "pipefb",
    "runs_in_process",
    "schedule_kind",
    "validate",
]
