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
sending it: S starts equal and changes only by that shared decision. S and its growth
tracker are part of the job's state: a checkpoint's rank file holds them in its metadata
(`metadata`), and a resumed, recovered or migrated owner takes them from there or from
its paused attempt (`load`), so it goes on with the S the uninterrupted job would have.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import torch

from pipefb.errors import ConfigError
from pipefb.job.precision import INITIAL_LOSS_SCALE, LOSS_SCALE_WINDOW
from pipefb.runtime.allreduce import Reducer

# torch.amp.GradScaler's defaults
INIT_SCALE = INITIAL_LOSS_SCALE  # the first step's scale
GROWTH_FACTOR = 2.0  # the scale's factor after growth_interval finite steps in a row
BACKOFF_FACTOR = 0.5  # the scale's factor after a step that overflowed
GROWTH_INTERVAL = LOSS_SCALE_WINDOW  # finite steps in a row before the scale grows
METADATA_KEY = "loss_scale"  # a rank file's metadata: {"scale": S, "growth_tracker": n}


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

    def metadata(self) -> dict[str, str]:
        """The scale and its growth tracker as a rank file's metadata entry (JSON)."""
        return {METADATA_KEY: json.dumps({"scale": self.scale,
                                          "growth_tracker": self.growth_tracker})}

    def load(self, metadata: Mapping[str, str], source: str) -> None:
        """Takes the scale and growth tracker from a `metadata` entry.

        Raises:
            ConfigError: the entry is missing or malformed (the message names `source`).
        """
        try:
            saved = json.loads(metadata[METADATA_KEY])
            scale, tracker = saved["scale"], saved["growth_tracker"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{source} holds no fp16 loss scale") from None
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (
                math.isfinite(scale) and scale > 0):
            raise ConfigError(f"{source} holds the loss scale {scale!r}, not a finite "
                              "number > 0")
        if isinstance(tracker, bool) or not isinstance(tracker, int) or not (
                0 <= tracker < self.growth_interval):
            raise ConfigError(f"{source} holds the loss scale's growth tracker {tracker!r}, "
                              f"not an integer in 0..{self.growth_interval - 1}")
        self.scale, self.growth_tracker = float(scale), tracker
