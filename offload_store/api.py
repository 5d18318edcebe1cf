"""The offload store's interface: what a rank does with its stash, what the coordinator
asks of a store, and the errors and counters both share. No backend code lives here.

[Note: store interface] A rank holds one `StashStore` per job attempt, opened by
`offload_store.open_store` from the address the coordinator assigns; the coordinator holds
a `StoreAdmin` per purpose (liveness watch, memory gauge, clearing a job), opened by
`offload_store.open_admin`. A backend implements both protocols and registers itself once
in `offload_store.backends`; nothing outside `offload_store/` knows which backend runs.
Every backend keeps the same contract: a put is all or nothing, a full store applies
back-pressure (`StashFullError` once it gives up), nothing a backward still needs is
evicted, and a take consumes what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pipefb.errors import StoreFullError

LayerTensors = dict[int, dict[str, torch.Tensor]]  # layer -> tensor name -> tensor


class StashFullError(StoreFullError):
    """A put the store refused for longer than `max_wait_seconds`; carries the numbers."""

    def __init__(
        self, job: str, step: int, microbatch: int, nbytes: int, used: int, maxmemory: int
    ) -> None:
        super().__init__(
            f"offload store full: job {job!r} step {step} microbatch {microbatch} could not "
            f"write {nbytes} bytes (server used_memory {used} of maxmemory {maxmemory})"
        )
        self.job, self.step, self.microbatch = job, step, microbatch
        self.nbytes, self.used_memory, self.maxmemory = nbytes, used, maxmemory


class StoreUnavailable(ConnectionError):
    """The store does not answer (down, unreachable, refusing the client); carries the
    store's address and the backend's own reason."""

    def __init__(self, address: str, reason: object) -> None:
        super().__init__(f"the offload store at {address} does not answer: {reason}")
        self.address = address
        self.reason = str(reason)


@dataclass
class StoreStats:
    """Byte and key counts of one store object's own puts and takes (exact value bytes)."""

    bytes_put: int = 0
    bytes_taken: int = 0
    keys_put: int = 0
    keys_taken: int = 0
    retries: int = 0  # backoff sleeps after the store refused a write

    @property
    def live_bytes(self) -> int:
        """Bytes put and not yet taken through this store object."""
        return self.bytes_put - self.bytes_taken

    @property
    def live_keys(self) -> int:
        """Keys put and not yet taken through this store object."""
        return self.keys_put - self.keys_taken


@dataclass(frozen=True)
class AdminLimits:
    """How long and how often a `StoreAdmin` tries; None leaves the backend's default."""

    timeout_seconds: float | None = None  # the wait for one reply
    connect_timeout_seconds: float | None = None  # the wait to open a connection
    retries: int | None = None  # immediate resends of a failed request (no backoff)


class StashStore(Protocol):
    """One job attempt's stash as a rank uses it: tensors keyed by (step, micro-batch,
    weight version, layer, name). Safe to share between threads."""

    @property
    def stats(self) -> StoreStats:
        """A consistent snapshot of this object's counters."""
        ...

    def put(
        self, step: int, microbatch: int, version: int,
        tensors: Mapping[int, Mapping[str, torch.Tensor]],
    ) -> int:
        """Stashes one micro-batch's saved tensors, all or nothing.

        Args:
            step: training step.
            microbatch: micro-batch index within the step.
            version: weight version the forward pass used.
            tensors: layer -> name -> tensor.

        Returns:
            The value bytes written.

        Raises:
            StashFullError: the store stayed full past the backend's wait; nothing of this
                put remains stored.
            CodecError: a dtype the tensor codec does not allow.
            ValueError: a bad index or name.

        A store that does not answer raises the backend client's own error (the worker
        reports it as a failed step); so do `take`, `release` and `clear_job`.
        """
        ...

    def take(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> LayerTensors:
        """Fetches and consumes stashed tensors: each requested one is gone from the store
        afterwards, even when another one is missing or corrupt.

        Args:
            step: training step.
            microbatch: micro-batch index within the step.
            version: weight version the forward pass used.
            names: layer -> tensor names to take.

        Returns:
            layer -> name -> tensor (writable, on the CPU).

        Raises:
            KeyError: a tensor the store does not hold; the argument names it.
            CodecError: a stored value that is not a valid tensor frame.
        """
        ...

    def prefetch(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> None:
        """Announces that `take` of these tensors comes next, so a backend may start moving
        them closer (a no-op where a take is already one round trip). Never blocks and
        never raises for a stash that is not there yet.

        Args:
            step: training step.
            microbatch: micro-batch index within the step.
            version: weight version the forward pass used.
            names: layer -> tensor names the take will ask for.
        """
        ...

    def release(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> int:
        """Frees whatever the store still holds of these tensors, read or not: a stash that
        will never be taken, or the buffers a backend keeps after a take.

        Args:
            step: training step.
            microbatch: micro-batch index within the step.
            version: weight version the forward pass used.
            names: layer -> tensor names to free.

        Returns:
            How many stored tensors it freed (0 for tensors a take already consumed).
        """
        ...

    def clear_job(self) -> int:
        """Deletes every stashed tensor of this job, any attempt.

        Returns:
            The number of stored tensors deleted.
        """
        ...

    def node_bytes(self) -> int:
        """Bytes of host memory on this node that the store holds for this object's own
        writes: the node-local tier's segments not yet taken and the spare files kept for
        the next writes; 0 for a store with no node-local memory. (A taken segment that
        tensors still view is the taker's memory, not counted here.)"""
        ...

    def close(self) -> None:
        """Releases the connections; the object is unusable afterwards."""
        ...


class StoreAdmin(Protocol):
    """The coordinator's handle on a store: liveness, identity, memory and a job's keys.
    Every call raises `StoreUnavailable` when the store does not answer."""

    address: str  # as given to `open_admin`

    def ping(self) -> None:
        """Returns once the store answers.

        Raises:
            StoreUnavailable: it does not.
        """
        ...

    def instance(self) -> str:
        """An id of the running store process: a restarted store, which has lost its
        stash, answers with another one.

        Raises:
            StoreUnavailable: the store does not answer.
        """
        ...

    def used_memory(self) -> int:
        """Bytes of memory the store uses now (the metrics gauge).

        Raises:
            StoreUnavailable: the store does not answer.
        """
        ...

    def count_keys(self, job: str) -> int:
        """The number of stored tensors of `job`, any attempt.

        Raises:
            StoreUnavailable: the store does not answer.
            ValueError: a bad job id.
        """
        ...

    def clear_job(self, job: str) -> int:
        """Deletes every stored tensor of `job`, any attempt.

        Returns:
            The number deleted.

        Raises:
            StoreUnavailable: the store does not answer.
            ValueError: a bad job id.
        """
        ...

    def grant_job(self, job: str) -> tuple[str, str]:
        """Makes (or resets) `job`'s own store user, allowed only that job's keys, with
        a fresh password ([Note: job store users] in `offload_store.acl`).

        Returns:
            The user's name and password, for the job's ranks.

        Raises:
            StoreUnavailable: the store does not answer or refuses.
            ValueError: a bad job id.
        """
        ...

    def revoke_job(self, job: str) -> None:
        """Drops `job`'s store user and its connections (none: nothing happens).

        Raises:
            StoreUnavailable: the store does not answer or refuses.
            ValueError: a bad job id.
        """
        ...

    def close(self) -> None:
        """Releases the connections."""
        ...
