"""Where tensors that peers stream in wait until the runtime's receive action takes them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import torch

from pipefb.errors import Aborted

Tensors = dict[str, torch.Tensor]
RECENT = 1024  # taken keys remembered for `arrived` (a prefetch waits a few actions ahead)


class Inbox:
    """A keyed rendezvous: `put` by the gRPC handler threads, blocking `take` by the runtime.

    `abort` wakes every waiter with `Aborted`; an inbox stays aborted (each job gets a new
    one).
    """

    def __init__(self, timeout_seconds: float = 300.0) -> None:
        self._items: dict[Hashable, Tensors] = {}
        self._taken: OrderedDict[Hashable, None] = OrderedDict()  # the last RECENT taken
        self._cond = threading.Condition()
        self._aborted: str | None = None
        self.timeout_seconds = timeout_seconds

    def put(self, key: Hashable, tensors: Tensors) -> None:
        """Delivers tensors under `key` (a duplicate key is an error of the sender)."""
        with self._cond:
            if key in self._items:
                raise ValueError(f"duplicate delivery for {key}")
            self._items[key] = tensors
            self._cond.notify_all()

    def take(self, key: Hashable) -> Tensors:
        """Waits for `key` and removes it.

        Raises:
            Aborted: the inbox was aborted, or nothing arrived within the timeout.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._items or self._aborted is not None,
                                     timeout=self.timeout_seconds)
            if self._aborted is not None:
                raise Aborted(self._aborted)
            if not ok:
                raise Aborted(f"nothing arrived for {key} in {self.timeout_seconds:.0f} s")
            self._taken[key] = None
            if len(self._taken) > RECENT:
                self._taken.popitem(last=False)
            return self._items.pop(key)

    def arrived(self, key: Hashable, timeout: float) -> bool:
        """Waits up to `timeout` seconds for `key` without taking it; whether it is there
        or was taken already (among the last `RECENT` keys taken).

        Raises:
            Aborted: the inbox was aborted.
        """
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._items or key in self._taken
                                     or self._aborted is not None, timeout=timeout)
            if self._aborted is not None:
                raise Aborted(self._aborted)
            return ok

    def abort(self, reason: str) -> None:
        """Wakes every waiter with `Aborted(reason)` and drops pending items."""
        with self._cond:
            self._aborted = reason
            self._items.clear()
            self._cond.notify_all()

    @property
    def aborted(self) -> str | None:
        """Why the inbox was aborted, or None."""
        return self._aborted

    def pending(self) -> int:
        """How many deliveries are waiting to be taken."""
        with self._cond:
            return len(self._items)
