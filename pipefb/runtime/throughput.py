"""Training speed a person can trust: samples per second and time left from a moving
median over recent steps.

A pipeline's steps overlap (a rank starts step v+1 the moment it ends v), so the gap
between two step reports says little: replies come in bursts, a few milliseconds apart,
then one long gap (after an evaluation, a checkpoint). The figure shown is the median,
over the last `WINDOW` steps, of the seconds of the `SPAN` steps ending at each, so one
burst or one stall moves it by at most one rank of the median.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

WINDOW = 20  # steps the median runs over
SPAN = 4  # steps each sample of the median spans (a burst of replies stays inside one)


class StepRate:
    """The moving median of a job's step times."""

    def __init__(self, batch_size: int, steps: Iterable[float] = ()) -> None:
        """`steps`: the seconds of the steps reported before, oldest first."""
        self.batch_size = batch_size
        self._seconds: deque[float] = deque(maxlen=WINDOW + SPAN - 1)
        for seconds in steps:
            self.add(seconds)

    def add(self, seconds: float) -> None:
        """Takes the seconds of the next step."""
        self._seconds.append(seconds)

    def step_seconds(self) -> float:
        """The median seconds of one step (0 before any step)."""
        times = list(self._seconds)
        if not times:
            return 0.0
        span = min(SPAN, len(times))
        sums = [sum(times[i - span:i]) for i in range(span, len(times) + 1)]
        return statistics.median(sums[-WINDOW:]) / span

    def samples_per_second(self) -> float:
        """Batch size over the median step seconds (0 before any step or at 0 seconds)."""
        seconds = self.step_seconds()
        return self.batch_size / seconds if seconds > 0 else 0.0

    def seconds_left(self, steps_left: int) -> float:
        """The median step seconds times `steps_left`."""
        return self.step_seconds() * max(0, steps_left)
