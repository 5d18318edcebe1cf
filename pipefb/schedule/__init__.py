"""The schedule IR: actions, topologies, generators, lowering, validation and dry run."""

from pipefb.schedule.generators import KINDS, generate, gpipe, one_f_one_b, pipedream, pipefb
from pipefb.schedule.grid import Trace, format_grid, format_table
from pipefb.schedule.ir import Action, Kind, Schedule, Topology, iteration
from pipefb.schedule.lowering import lower
from pipefb.schedule.validate import dry_run, validate

__all__ = [
    "KINDS",
    "Action",
    "Kind",
    "Schedule",
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
    "validate",
]
