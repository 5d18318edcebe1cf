"""Gradient clipping by the global norm of every stage's gradients.

[Note: global norm] `torch.nn.utils.clip_grad_norm_` in one process takes the 2-norm of
each parameter's gradient, stacks those norms in parameter order and takes their 2-norm;
every gradient is then scaled by min(1, max_norm / (norm + 1e-6)). A pipeline's
parameters are split over the weight owners of its backward stages, so before `OPT`
(after the groups' all-reduce, which gives every group the same gradients) each owner
computes the norms of its own parameters' gradients and writes them, with a presence
flag, at their places in the model's parameter order into a vector of zeros; one sum
over the owners of its group (`Reducer.sum_`, a gloo or NCCL all-reduce of 2 x
parameter-count numbers) gives every owner the whole vector. Each place holds one
owner's value plus zeros, which adds exactly, so every owner takes the same norm as the
one process does, of the same numbers in the same order, and clips with torch's own
`clip_grads_with_norm_`. A non-finite norm is the same on every owner, so every owner
skips the update of that step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pipefb.runtime.allreduce import Reducer


class GlobalNormClip:
    """Clips one owner's gradients by the norm of the whole model's."""

    def __init__(self, max_norm: float, places: Sequence[int], total: int,
                 dtype: torch.dtype, device: torch.device, reducer: Reducer | None) -> None:
        """
        Args:
            max_norm: the largest global norm left unscaled, > 0.
            places: each owned parameter's index in the model's parameter order, in the
                order the owner passes them to `clip_`; -1: a tied parameter's later copy,
                scaled but not counted ([Note: tied parameters] in pipefb.runtime.tied).
            total: the model's trainable parameter count.
            dtype: the parameters' dtype (that of torch's per-parameter norms).
            device: where the gradients live.
            reducer: sums over the owners of this group's stages; None when this owner
                holds every stage.
        """
        self.max_norm, self.places, self.total = max_norm, list(places), total
        self.dtype, self.device, self.reducer = dtype, device, reducer

    def norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global gradient norm, from this owner's `params` (in `places` order) and
        every other owner's (a collective: every owner of the group calls it)."""
        norms = torch.zeros(2 * self.total, dtype=self.dtype, device=self.device)
        for place, p in zip(self.places, params, strict=True):
            # torch's norm leaves out parameters without a gradient; a tied parameter's
            # later copies (place -1) are counted at its first use
            if place >= 0 and p.grad is not None:
                norms[place] = torch.linalg.vector_norm(p.grad, 2.0)
                norms[self.total + place] = 1.0
        if self.reducer is not None:
            self.reducer.sum_([norms])
        present = norms[self.total:] > 0
        total_norm: torch.Tensor = torch.linalg.vector_norm(norms[:self.total][present], 2.0)
        return total_norm

    def clip_(self, params: Sequence[torch.Tensor]) -> float:
        """Scales this owner's gradients by the global norm; returns the norm (a
        non-finite one leaves them as they are: the step is skipped)."""
        total_norm = self.norm(params)
        value = float(total_norm)
        if math.isfinite(value):
            grads = [p for p in params if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(grads, self.max_norm, total_norm)
        return value


def parameter_places(layers: Sequence[torch.nn.Module]) -> dict[str, int]:
    """`{layer}.{param}` of every trainable parameter of the whole layer sequence -> its
    index in the model's parameter order (each parameter once, under its first name, as
    the single process and `RankState` list them)."""
    seen: set[int] = set()
    places: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                places[f"{i}.{name}"] = len(places)
    return places
