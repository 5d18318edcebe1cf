"""A worker's side of a live migration: the paused attempt it keeps, and taking layers over.

[Note: migration, worker side] When the coordinator moves layers it pauses the job at a
step boundary v and assigns every rank the new plan with attempt + 1 and a
`MigrationSource` (the paused attempt and its plan). Each worker first keeps its paused
assignment as a `Source`: its runtime (weights of version v, optimizer state) and, on a
forward rank, the weights of version v waiting in its inbox. Then it builds the new
runtime and takes every layer it holds under the new plan (`pipefb.plan.migration.takeover`):
from its own `Source` where it held the layer before, else from the old owner's `Source`
over the `Migrate` stream. Sources are served until the worker runs a step of a later
attempt, so a rollback (the coordinator assigning the old plan with attempt + 2 and the
same source) finds them all still there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from pipefb.errors import CodecError, ConfigError, WorkerFailed
from pipefb.plan.migration import Takeover
from pipefb.runtime.checkpoint import Part, as_part, layer_of
from pipefb.runtime.stage import StageRuntime
from protos import server, tensor_pb2, wire, worker_pb2, worker_pb2_grpc

MIGRATE_TIMEOUT_SECONDS = 120.0  # one peer's stream of layers, end to end


@dataclass
class Source:
    """A paused attempt this worker ran, kept while peers may take its layers."""

    job_id: str
    attempt: int
    step: int  # the step boundary it paused at
    runtime: StageRuntime
    forward: dict[str, torch.Tensor]  # a forward rank's weights of the version `step` uses

    def matches(self, job_id: str, attempt: int) -> bool:
        """Whether this is the paused attempt `attempt` of `job_id`."""
        return (self.job_id, self.attempt) == (job_id, attempt)

    def stream(self, request: worker_pb2.MigrateRequest) -> Iterator[tensor_pb2.TensorChunk]:
        """The `Migrate` answer: the asked layers' weights and optimizer state, or their
    buffers alone (`buffers_only`), chunked."""
        tensors = buffers_of(self.runtime, request.layers) if request.buffers_only else (
            self.runtime.layer_state(request.layers, request.optimizer_layers))
        yield from migrate_stream(self.job_id, self.attempt, self.step, tensors)


def buffers_of(runtime: StageRuntime, layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """The buffers of `layers` (a `buffers_only` Migrate): those of its forward layers.

    Raises:
        ConfigError: a layer whose forward does not run on this rank.
    """
    foreign = sorted(set(layers) - set(runtime.fwd_layers))
    if foreign:
        raise ConfigError(f"layers {foreign} do not run their forward on this rank")
    return runtime.state.buffers_of(sorted(layers))


def migrate_stream(job_id: str, attempt: int, step: int, tensors: dict[str, torch.Tensor]
                   ) -> Iterator[tensor_pb2.TensorChunk]:
    """A `Migrate` answer: `tensors`, chunked."""
    transfer = tensor_pb2.Transfer(job_id=job_id, attempt=attempt, step=step, microbatch=-1,
                                   kind="MIGRATE")
    yield from wire.encode_stream(transfer, tensors)


def local_part(source: Source | None, plan: Takeover) -> Part:
    """What the rank keeps of its own paused attempt: owned layers' weights and optimizer
    state, kept forward layers' weights, and an fp16 owner's loss scale (every owner's is
    the same, and an owner stays one: roles do not move).

    Raises:
        CodecError: the plan keeps layers but this worker has no paused attempt (it was
            restarted since).
    """
    scale = source.runtime.loss_scale_metadata() if source is not None else {}
    if not plan.owned and not plan.kept:
        return {}, {}, scale
    if source is None:
        raise CodecError("this worker holds no state of the paused attempt (restarted?)")
    weights, optim, _ = as_part(source.runtime.layer_state(plan.owned, plan.owned))
    weights.update({k: v for k, v in source.forward.items() if layer_of(k)[0] in plan.kept})
    weights.update(source.runtime.layer_state(plan.kept, ()))  # their buffers
    return weights, optim, scale


def pull(peers: Sequence[str], job_id: str, attempt: int, step: int, plan: Takeover,
         max_bytes: int) -> tuple[list[Part], int]:
    """Takes the layers `plan` pulls from each old owner, and the buffers of forward layers
    from their old forward ranks, over `Migrate`; returns the parts and the bytes received.

    Raises:
        CodecError: a peer sent a tensor that was not asked for.
        WorkerFailed: a peer failed or did not answer in time.
    """
    parts: list[Part] = []
    total = 0
    asks = [*((rank, (layers, optim, False)) for rank, (layers, optim) in plan.pulls.items()),
            *((rank, (layers, (), True)) for rank, layers in plan.buffers.items())]
    for rank, (layers, optimizer_layers, buffers_only) in asks:
        channel = server.channel(peers[rank])
        try:
            stub = worker_pb2_grpc.StageWorkerStub(channel)
            replies = stub.Migrate(worker_pb2.MigrateRequest(
                job_id=job_id, attempt=attempt, step=step, layers=layers,
                optimizer_layers=optimizer_layers, buffers_only=buffers_only),
                timeout=MIGRATE_TIMEOUT_SECONDS)
            _, tensors = wire.decode_stream(replies, max_bytes=max_bytes)
        except grpc.RpcError as error:
            raise WorkerFailed(f"rank {rank} at {peers[rank]} did not send layers "
                               f"{list(layers)}: {error.code().name}: {error.details()}"
                               ) from None
        finally:
            channel.close()
        parts.append(_split(tensors, layers, optimizer_layers, rank))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return parts, total


def _split(tensors: dict[str, torch.Tensor], layers: Sequence[int],
           optimizer_layers: Sequence[int], rank: int) -> Part:
    """A peer's answer as a Part, refusing any tensor of a layer it was not asked for."""
    for name in tensors:
        try:
            layer, is_state = layer_of(name)
        except ConfigError:
            layer, is_state = -1, False
        if layer not in (optimizer_layers if is_state else layers):
            raise CodecError(f"rank {rank} sent {name!r}, which was not asked for")
    return as_part(tensors)
