"""A worker call's caller, watched: once it gave up (its deadline passed, it cancelled, or
its channel went away) a long handler stops its work instead of finishing it for nobody.

[Note: callers that give up] gRPC runs `ServicerContext.add_callback` callbacks when an
RPC ends, however it ends. `Caller` turns that into `gone`, unless the handler said it
`finished` first (then the end is its own reply, not the caller leaving). A handler
registers what stops its work (`on_gone`: stop a running step before its next action and
end its waits, wake a wait at the step gate) and checks between phases (`check`: an
Assign installs nothing for a caller that left). Work is stopped at its next abort point:
an action of a step (one stage's forward or backward of one micro-batch), a receive, a
wait, a phase boundary, a Profile's timed call; the computation already running ends
first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from pipefb.errors import Aborted


class Caller:
    """The caller of one RPC, as its handler sees it (see the module docstring)."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.gone = threading.Event()  # set once the caller gave up
        self._lock = threading.Lock()
        self._finished = False
        self._on_gone: list[Callable[[], None]] = []
        if not context.add_callback(self._ended):  # the RPC already ended
            self.gone.set()

    def _ended(self) -> None:
        with self._lock:
            if self._finished or self.gone.is_set():
                return
            self.gone.set()
            actions = list(self._on_gone)
        for action in actions:
            action()

    def on_gone(self, action: Callable[[], None]) -> None:
        """Runs `action` when the caller gives up (at once if it has)."""
        with self._lock:
            if not self.gone.is_set():
                self._on_gone.append(action)
                return
        action()

    def finished(self) -> None:
        """The handler is done: the RPC's end from now on is its reply, not the caller
        giving up."""
        with self._lock:
            self._finished = True

    def check(self, what: str) -> None:
        """Raises Aborted if the caller gave up.

        Raises:
            Aborted: naming `what` was stopped.
        """
        if self.gone.is_set():
            raise Aborted(f"{what} stopped: its caller gave up (deadline passed or cancelled)")
