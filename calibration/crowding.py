"""The oversubscription probe: how fast the cores run with twice as many busy processes
as cores, relative to one per core.

It runs `cores` processes (`calibration.crowd`), then twice as many, each running one
`gpt` block's forward and backward (one torch thread) for `Settings.crowd_seconds`; the
runs of the second over the first are the host's `oversubscribed` speed ([Note:
oversubscribed cores] in pipefb.sim.hosts).
"""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Callable

from calibration.settings import PROBE_TIMEOUT_S, CalibrationError
from pipefb.processes import project_env
from pipefb.sim.cluster import MIN_OVERSUBSCRIBED


def _crowd_runs(processes: int, seconds: float) -> int:
    """Runs `processes` busy processes (`calibration.crowd`) at once for `seconds`;
    their runs, summed."""
    command = [sys.executable, "-m", "calibration.crowd", str(seconds)]
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=project_env()) for _ in range(processes)]
    try:
        for child in children:
            _expect_line(child, "ready".__eq__)
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        return sum(int(_expect_line(child, str.isdigit)) for child in children)
    finally:
        for child in children:
            child.kill()
            child.wait()


def _expect_line(child: subprocess.Popen[str], valid: Callable[[str], bool]) -> str:
    """The child's next stdout line, if `valid` and within `PROBE_TIMEOUT_S`;
    CalibrationError otherwise."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], PROBE_TIMEOUT_S)
    if not ready:
        raise CalibrationError(f"oversubscription probe process said nothing in "
                               f"{PROBE_TIMEOUT_S:.0f} s")
    line = child.stdout.readline().strip()
    if not valid(line):
        raise CalibrationError(f"oversubscription probe process said {line!r}")
    return line


def oversubscribed(cores: int, seconds: float) -> float:
    """The cores' speed with twice as many busy processes as cores, relative to one per
    core ([Note: oversubscribed cores] in pipefb.sim.hosts), within MIN_OVERSUBSCRIBED..1."""
    one_each = _crowd_runs(cores, seconds)
    twice = _crowd_runs(2 * cores, seconds)
    if not one_each:
        raise CalibrationError("the oversubscription probe ran nothing")
    return min(1.0, max(MIN_OVERSUBSCRIBED, twice / one_each))
