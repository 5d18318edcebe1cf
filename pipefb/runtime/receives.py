"""What a rank expects from its peers, and the check of each transfer against it.

[Note: receive window] in worker/service.py checks every transfer with `check_received`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pipefb.errors import CodecError
from pipefb.job.shapes import TensorSpec
from pipefb.runtime.place import RankPlace
from pipefb.schedule import Kind

#: (receive kind, stage) -> tensor name -> spec: what a rank may receive
Receives = dict[tuple[str, int], dict[str, TensorSpec]]


def receive_specs(place: RankPlace, specs: list[list[TensorSpec]], loss: TensorSpec,
                  forward_params: Mapping[str, TensorSpec]) -> Receives:
    """What the rank at `place` may receive, from the input specs of the job's layers, the
    loss's spec, and the specs of its forward layers' parameters (`{layer}.{param}`)."""
    out: Receives = {}
    last_bwd = len(place.topology.backward_workers) - 1
    if place.fwd_stage is not None and place.fwd_stage > 0:
        out[(Kind.RECV_F, place.fwd_stage)] = {"x": specs[place.fwd_layers[0]][0]}
    if place.bwd_stage is not None and place.bwd_stage < last_bwd:
        out[(Kind.RECV_B, place.bwd_stage)] = {"g": specs[place.bwd_layers[-1] + 1][0]}
    if place.role == "backward" and place.bwd_stage == last_bwd:
        out[(Kind.RECV_L, place.bwd_stage)] = {"loss": loss}
    if place.role == "forward":
        out[(Kind.RECV_W, 0)] = dict(forward_params)
    return out


def check_received(receives: Receives, rank: int, kind: str, stage: int,
                   tensors: dict[str, torch.Tensor]) -> None:
    """Refuses a transfer rank `rank` does not expect, naming what is wrong.

    Weights may arrive in parts (one per overlapping backward stage); anything else
    must carry exactly the expected tensors.

    Raises:
        CodecError: an unexpected kind or stage, name, shape or dtype.
    """
    expected = receives.get((kind, stage))
    if expected is None:
        raise CodecError(f"rank {rank} receives no {kind} at stage {stage}")
    names = set(tensors)
    if names - set(expected) or (kind != Kind.RECV_W and names != set(expected)):
        raise CodecError(f"{kind} carries {sorted(names)}, expected {sorted(expected)}")
    for name, tensor in tensors.items():
        if not expected[name].matches(tensor):
            raise CodecError(f"{kind} tensor {name!r} is {list(tensor.shape)} "
                             f"{tensor.dtype}, expected {expected[name]}")
