"""The coordinator's own stalls: spans of time this process did not run, so silence
that falls inside them is not blamed on the workers.

[Note: own stalls] A worker counts as dead when the coordinator heard no heartbeat from
it for the heartbeat timeout. If the coordinator itself was stopped (SIGSTOP, a frozen
VM, a long swap-in), every worker looks silent for the whole stop once it runs again,
while their heartbeats were only waiting for it. A daemon thread ticks every
`TICK_SECONDS`; a tick that comes more than `STALL_SECONDS` late marks the gap as a
stall, and a worker's silence counts only the time outside stalls. A caller that runs
before the ticker after a stop sees the gap as well (`stalled`, the gap still open).
"""

from __future__ import annotations

import threading
import time
from collections import deque

TICK_SECONDS = 0.1  # how often the ticker looks at the clock
STALL_SECONDS = 1.0  # a tick later than this marks a stall (not scheduled, not running)
KEEP_STALLS = 1024  # stall spans remembered (older ones are far past every timeout)


class StallWatch:
    """Spans of `time.monotonic()` during which this process did not run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._spans: deque[tuple[float, float]] = deque(maxlen=KEEP_STALLS)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the ticker (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._tick, name="stall-watch",
                                                daemon=True)
                self._thread.start()

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_SECONDS)
            self.stalled(time.monotonic())

    def stalled(self, since: float) -> float:
        """Seconds this process spent stalled after `since` (the gap still open
        included, which is then recorded)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last > STALL_SECONDS + TICK_SECONDS:
                self._spans.append((self._last, now))
            self._last = now
            return sum(max(0.0, end - max(start, since)) for start, end in self._spans
                       if end > since)


WATCH = StallWatch()  # one per process: the stalls are the process's own


def silent_seconds(last_heard: float) -> float:
    """Seconds since `last_heard` (a `time.monotonic()` value) this process ran: the
    time elapsed less the stalls in it ([Note: own stalls])."""
    WATCH.start()
    return time.monotonic() - last_heard - WATCH.stalled(last_heard)
