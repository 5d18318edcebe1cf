"""`--schedule single`: the same micro-batches in one process with eager autograd, the reference.

Every pipeline schedule in `sync` mode must reproduce these losses and weights: same data
(seeded by (seed, step, micro-batch)), same random ops (seeded by (seed, step,
micro-batch, layer)), loss averaged over micro-batches, one optimizer step per step,
with torch's learning-rate scheduler and `clip_grad_norm_` (pipefb.job.lr,
pipefb.runtime.clipping). With `staleness` S > 0 it is the reference of async PipeFB
instead: step k's gradient is taken at weight version k - S and applied to the newest
weights; with `job.staleness_microbatches` K only the step's first K micro-batches take it
at k - S, the rest at k - S + 1 ([Note: micro-batch staleness] in pipefb.runtime.place).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pipefb.job.config import JobConfig, build_layers, job_device
from pipefb.job.data import job_dataset
from pipefb.job.lr import lr_scheduler
from pipefb.job.optim import build_optimizer, optimizer_state_bytes
from pipefb.job.precision import autocast
from pipefb.memory import DeviceMemory, tensor_bytes
from pipefb.runtime.state import persistent_buffers
from pipefb.seeding import derive_seed, seed_random_ops


@dataclass
class SingleStep:
    """One step of the reference run."""

    step: int
    loss: float  # mean over micro-batches
    seconds: float
    samples_per_second: float
    peak_memory_bytes: int  # parameters + gradients + optimizer state after the step
    device_memory_bytes: dict[str, int]  # CUDA allocator statistics of the step; {} on cpu
    lr: float = 0.0  # the learning rate of the step's update
    grad_norm: float | None = None  # with clipping: the gradient norm clip_grad_norm_ took
    skipped: bool = False  # the norm was not finite (or fp16 overflowed): no update
    loss_scale: float = 0.0  # fp16: GradScaler's scale for the next step; else 0


class SingleProcess:
    """The whole layer sequence in one process, trained with gradient accumulation."""

    def __init__(self, job: JobConfig, staleness: int = 0) -> None:
        self.job, self.staleness = job, staleness
        self.device = job_device(job)
        self.device_memory = DeviceMemory(self.device)
        self.layers = [layer.to(self.device) for layer in build_layers(job)]
        self.dataset = job_dataset(job)
        # each parameter once: a parameter shared by two layers is updated once a step
        self.params = list({id(p): p for layer in self.layers for p in layer.parameters()
                            }.values())
        self.optimizer = build_optimizer(job.optimizer, self.params, job.lr, job.optimizer_config)
        # torch's own scheduler, stepped after every step ([Note: learning-rate schedules])
        self.scheduler = lr_scheduler(self.optimizer, job.lr_schedule, job.lr, job.steps,
                                      job.warmup_steps, job.min_lr)
        # fp16: torch's own loss scaler ([Note: loss scaling] in pipefb.runtime.lossscale)
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=job.initial_loss_scale,
                                            growth_interval=job.loss_scale_window)
                       if job.precision == "fp16" else None)
        # the last `staleness` versions before the newest, oldest first
        self.history: list[list[torch.Tensor]] = []

    def loss(self, step: int, microbatch: int) -> torch.Tensor:
        """Forward of one micro-batch through every layer, loss layer last."""
        x, targets = self.dataset.microbatch(step, microbatch, self.job.microbatch_size)
        x, targets = x.to(self.device), targets.to(self.device)
        last = len(self.layers) - 1
        with autocast(self.job.precision, self.device):  # [Note: mixed precision]
            for i, layer in enumerate(self.layers):
                seed_random_ops(derive_seed(self.job.seed, step, microbatch, i))
                x = layer(x, targets) if i == last else layer(x)
        return x

    def step(self, step: int) -> SingleStep:
        """Runs one optimizer step over `microbatches` accumulated micro-batches."""
        started = time.perf_counter()
        self.device_memory.reset_peak()
        live: list[torch.Tensor] | None = None  # the newest weights while older ones run
        installed, losses = step, []
        for m in range(self.job.microbatches):
            version = self._version_of(step, m)
            if version != installed and version == step:  # back to the newest
                assert live is not None
                self._swap_in(live)
                live = None
            elif version != installed:
                held = self._swap_in(self._history_of(step, version))
                live = held if live is None else live
            installed = version
            loss = self.loss(step, m)
            loss_part = loss / self.job.microbatches
            torch.autograd.backward(self.scaler.scale(loss_part) if self.scaler else loss_part)
            losses.append(loss.item())
        if live is not None:
            self._swap_in(live)
        grads = [p.grad for p in self.params if p.grad is not None]
        memory = tensor_bytes(self.params) + tensor_bytes(grads)
        if self.staleness:
            self.history = [*self.history, [p.detach().clone() for p in self.params]]
            self.history = self.history[-self.staleness:]
        lr, grad_norm = float(self.optimizer.param_groups[0]["lr"]), None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.job.clip_grad_norm:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params,
                                                             self.job.clip_grad_norm))
        skipped = grad_norm is not None and not math.isfinite(grad_norm)
        if self.scaler is not None:
            # GradScaler decides: after an overflow its update halves the scale and the
            # step is skipped. The optimizer steps only when it is not, rather than through
            # GradScaler.step: torch's fused SGD, handed an overflow on its first step,
            # leaves its momentum buffers uninitialised, where a skipped step must leave the
            # optimizer as it was (as every pipeline owner does)
            before = self.scaler.get_scale()
            self.scaler.update()
            skipped = self.scaler.get_scale() < before
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped step still advances the schedule: the
            # step number decides the lr, which torch warns of when it is the first step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step",
                                    UserWarning)
            self.scheduler.step()
        memory += optimizer_state_bytes(self.optimizer)
        self.device_memory.synchronize()
        seconds = time.perf_counter() - started
        return SingleStep(step, sum(losses) / len(losses), seconds,
                          self.job.batch_size / seconds, memory, self.device_memory.snapshot(),
                          lr, grad_norm, skipped,
                          self.scaler.get_scale() if self.scaler is not None else 0.0)

    def _version_of(self, step: int, m: int) -> int:
        """The version micro-batch m of `step` runs on: k - S for the first K micro-batches,
        k - S + 1 for the rest, at least 0 (k: `step`, the newest)."""
        if not self.staleness:
            return step
        return max(0, step - self.staleness + (m >= self.job.stale_microbatches()))

    def _history_of(self, step: int, version: int) -> list[torch.Tensor]:
        """An older version's weights: history holds step - len(history) .. step - 1."""
        return self.history[version - (step - len(self.history))]

    def _swap_in(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Puts `values` into the parameters; returns what they held."""
        held = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                p.copy_(v)
        return held

    def run(self) -> Iterator[SingleStep]:
        """Runs every step of the job, yielding each step's report."""
        for step in range(self.job.steps):
            yield self.step(step)

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights and persistent buffers, named `layers.{i}.{name}`."""
        return {f"layers.{i}.{name}": t.detach().cpu().clone()
                for i, layer in enumerate(self.layers)
                for name, t in [*layer.named_parameters(), *persistent_buffers(layer)]}
