"""The runtime's view of the outside world: peers, offload store and weight pushes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from pipefb.schedule import Kind

Tensors = dict[str, torch.Tensor]
LayerTensors = dict[int, dict[str, torch.Tensor]]


class Transport(Protocol):
    """What a stage runtime needs from its host; the worker implements it over gRPC streams
    and the offload store (`dataplane.grpc_transport`).

    [Note: transport ordering] `send` and `push_weights` are non-blocking and must deliver
    in the order they were called per destination; `recv` and `wait_weights` block until
    the data is there or the step is aborted (raising `Aborted`). `fetch` does not wait:
    the schedule only fetches after the loss hand-off, which follows every stash of that
    micro-batch, and a missing key raises `KeyError`; a host that writes stashes in the
    background sends a transfer only after every stash handed over before it is in the
    store ([Note: background stash] in `offload_store.writer`). `flush`
    waits for every send of the step and raises `WorkerFailed` naming a peer that failed.
    """

    def send(
        self, kind: Kind, rank: int, step: int, stage: int, microbatch: int, version: int,
        tensors: Tensors,
    ) -> None:
        """Sends tensors to `rank` for its receive action `kind` at `stage`."""
        ...

    def recv(self, kind: Kind, step: int, stage: int, microbatch: int) -> Tensors:
        """Blocks until the tensors of receive action `kind` at `stage` arrive."""
        ...

    def stash(self, step: int, microbatch: int, version: int, tensors: LayerTensors) -> int:
        """Puts saved tensors (layer -> name -> tensor) in the offload store; returns bytes."""
        ...

    def fetch(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> LayerTensors:
        """Takes (gets and deletes) saved tensors from the offload store."""
        ...

    def prefetch(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]],
        after: tuple[Kind, int, int, int] | None = None,
    ) -> None:
        """Starts the `fetch` of these tensors in the background; the next `fetch` of the
        same (step, microbatch) returns its result. With `after` (a receive action's kind,
        step, stage and micro-batch), the background fetch first waits until that transfer
        arrived: the stash of another rank is in the store once the transfer that follows
        it is ([Note: transport ordering])."""
        ...

    def push_weights(self, rank: int, version: int, tensors: Tensors) -> None:
        """Sends weight version `version` of some layers (names `{layer}.{param}`)."""
        ...

    def wait_weights(self, version: int, names: Sequence[str]) -> Tensors:
        """Blocks until weight version `version` of every name has arrived; returns them."""
        ...

    def held_bytes(self) -> int:
        """Bytes of stashes the host keeps in this process's memory for this rank."""
        ...

    def in_flight_bytes(self) -> int:
        """Bytes of stashes handed over to the store and not yet written."""
        ...

    def flush(self) -> int:
        """Waits for this step's sends; returns the bytes sent."""
        ...
