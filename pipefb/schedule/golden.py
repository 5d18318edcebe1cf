"""Golden schedule files for tests: `python -m pipefb.schedule.golden tests/golden`."""

from __future__ import annotations

import sys
from pathlib import Path

from pipefb.schedule.grid import format_grid, format_table
from pipefb.schedule.ir import Topology
from pipefb.schedule.kinds import generate
from pipefb.schedule.lowering import lower
from pipefb.schedule.validate import dry_run

REGENERATE = "python -m pipefb.schedule.golden tests/golden"

#: name -> (schedule kind, topology, micro-batches)
CASES: dict[str, tuple[str, Topology, int]] = {
    "gpipe_2x4": ("gpipe", Topology.combined((0, 1, 2)), 4),
    "gpipe_4x4": ("gpipe", Topology.combined((0, 1, 2, 3, 4)), 4),
    "1f1b_2x4": ("1f1b", Topology.combined((0, 1, 2)), 4),
    "1f1b_4x4": ("1f1b", Topology.combined((0, 1, 2, 3, 4)), 4),
    "1f1b_4x8": ("1f1b", Topology.combined((0, 1, 2, 3, 4)), 8),
    "pipefb_2f2b_4": ("pipefb", Topology((0, 2, 4), (0, 1, 4), (0, 1), (2, 3)), 4),
}


def render(name: str) -> str:
    """The golden text of case `name`: compute-only and lowered tables, one-step trace."""
    kind, topology, microbatches = CASES[name]
    compute = generate(kind, topology, microbatches)
    lowered = lower(compute, topology)
    return (
        "\n\n".join(
            [
                f"# {name}: {kind}, {topology}, {microbatches} micro-batches",
                f"# regenerate: {REGENERATE}",
                "## compute-only\n" + format_table(compute),
                "## lowered\n" + format_table(lowered),
                "## dry run, one step (column = tick)\n"
                + format_grid(dry_run(lowered, topology, 1)),
            ]
        )
        + "\n"
    )


def main(argv: list[str]) -> int:
    """Writes one `<case>.txt` per case into the directory argv[0]."""
    if len(argv) != 1:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        (out / f"{name}.txt").write_text(render(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
