"""Dynamic loss scaling for `--precision fp16`, one scale agreed by every weight owner.

[Note: loss scaling] float16 gradients underflow, so an fp16 job multiplies the gradient
of the loss by a scale S before the backward passes (the last stage's output gradient is
S / micro-batches instead of 1 / micro-batches) and divides the float32 gradients by S
before the optimizer step, as `torch.amp.GradScaler` does in one process. S follows
GradScaler's rule: a step with a non-finite gradient anywhere in the model is skipped and
halves S; `growth_interval` finite steps in a row double it. A pipeline's gradients are
split over the weight owners of its stages, so each owner unscales its own gradients,
counts the non-finite ones, and one sum over the owners of its group (the same `Reducer`
as [Note: global norm] in pipefb.runtime.clipping: one number, after the groups'
all-reduce, which gives every group the same gradients) tells every owner whether the
step overflowed. Every owner then takes the same decision and keeps the same S without
sending it: S starts equal and changes only by that shared decision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipefb.runtime.allreduce import Reducer

# torch.amp.GradScaler's defaults
INIT_SCALE = 2.0**16  # the first step's scale
GROWTH_FACTOR = 2.0  # the scale's factor after growth_interval finite steps in a row
BACKOFF_FACTOR = 0.5  # the scale's factor after a step that overflowed
GROWTH_INTERVAL = 2000  # finite steps in a row before the scale grows


class LossScale:
    """One owner's copy of the job's loss scale ([Note: loss scaling])."""

    def __init__(self, device: torch.device, reducer: Reducer | None,
                 init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR,
                 growth_interval: int = GROWTH_INTERVAL) -> None:
        """
        Args:
            device: where the gradients live.
            reducer: sums over the owners of this group's stages; None when this owner
                holds every stage.
            init_scale, growth_factor, backoff_factor, growth_interval: as
                `torch.amp.GradScaler` takes them.
        """
        self.device, self.reducer = device, reducer
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # finite steps since the scale last changed

    def unscale_(self, params: Sequence[torch.Tensor]) -> bool:
        """Divides this owner's gradients by the scale (a multiplication by its float32
        reciprocal, as GradScaler's) and says whether any owner of the group found a
        non-finite gradient (a collective: every owner of the group calls it)."""
        inv_scale = torch.full((), self.scale, dtype=torch.float64).reciprocal().float()
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found,
                                                             inv_scale.to(self.device))
        if self.reducer is not None:
            self.reducer.sum_([found])
        return bool(found.item() > 0)

    def update(self, overflowed: bool) -> None:
        """The scale of the next step, after a step that `overflowed` or not."""
        if overflowed:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
