"""Learning-rate schedules by name, as torch's own schedulers compute them.

[Note: learning-rate schedules] A job's learning rate at step k is a function of k alone:
`lr_schedule` (`constant`, `cosine`, `linear`), `warmup_steps` W, `min_lr` and the job's
`lr` and `steps`. Steps 0..W-1 warm up linearly, lr * (k + 1) / (W + 1) (torch's
`LinearLR` from 1 / (W + 1)); from step W, `constant` keeps lr, `cosine` anneals from lr
to `min_lr` over the remaining steps - W steps (`CosineAnnealingLR`, eta_min = min_lr),
and `linear` decays to `min_lr` over them (`LinearLR` to min_lr / lr); the warm-up and
the decay are chained by `SequentialLR`. The floor is reached after the last step.

The single process attaches this scheduler to its optimizer and steps it after every
optimizer step. Every weight owner of a pipeline instead reads `LearningRates.at(k)`,
the same scheduler stepped k times over a parameter-free optimizer, and sets it on its
optimizer before step k's update: the same float operations in the same order, so each
owner of every stage and group uses bit for bit the learning rate the single process
uses, and a resumed, recovered or migrated rank gets it from the step number alone.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
)

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str, lr: float, steps: int,
                 warmup_steps: int, min_lr: float) -> LRScheduler:
    """torch's scheduler of a job's schedule over `optimizer` (built with learning rate
    `lr`); the arguments are a `JobConfig`'s, already checked by it.

    Raises:
        ValueError: an unknown schedule name.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {LR_SCHEDULES}")
    decay_steps = steps - warmup_steps
    decay: LRScheduler
    if schedule == "cosine":
        decay = CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=min_lr)
    elif schedule == "linear":
        decay = LinearLR(optimizer, start_factor=1.0, end_factor=min_lr / lr,
                         total_iters=decay_steps)
    else:
        decay = ConstantLR(optimizer, factor=1.0, total_iters=0)
    if not warmup_steps:
        return decay
    warmup = LinearLR(optimizer, start_factor=1.0 / (warmup_steps + 1), end_factor=1.0,
                      total_iters=warmup_steps)
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])


class LearningRates:
    """A job's learning rate by step, from its torch scheduler stepped that many times."""

    def __init__(self, schedule: str, lr: float, steps: int, warmup_steps: int,
                 min_lr: float) -> None:
        self._args = (schedule, lr, steps, warmup_steps, min_lr)
        self._start()

    def _start(self) -> None:
        """A fresh scheduler at step 0."""
        self._optimizer = torch.optim.SGD([torch.zeros(0, requires_grad=True)],
                                          lr=self._args[1])
        self._scheduler = lr_scheduler(self._optimizer, *self._args)
        self._step = 0

    def at(self, step: int) -> float:
        """The learning rate of step `step` (0-based). Steps the scheduler forward to it
        (a resumed rank replays the steps before its first, a few microseconds each);
        an earlier step starts over."""
        if step < self._step:
            self._start()
        while self._step < step:
            self._optimizer.step()  # torch warns when a scheduler steps before its optimizer
            self._scheduler.step()
            self._step += 1
        return float(self._optimizer.param_groups[0]["lr"])
