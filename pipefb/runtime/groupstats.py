"""BatchNorm's running statistics across pipeline groups: one process's, on every copy.

[Note: group statistics] With G groups, group g's forward ranks run micro-batches
g*M .. g*M + M - 1 of each step, so each copy of a BatchNorm layer would see only its own
group's micro-batches, where one process updates its statistics with every micro-batch,
in order. So each rank that runs such a layer's forward records, before each
micro-batch's forward, that micro-batch's batch mean and unbiased variance: the new
running statistics of a second `native_batch_norm` of the same input with momentum 1 and
zero statistics (the kernel's own values; momentum 1 makes its update `1 * stat + 0`,
exact). Once the step's forwards ran (at OPT where the rank steps the optimizer, before
it keeps a copy for the held-out evaluation; else after the step's last action), the
ranks of the same forward stage in every group sum one slot per (micro-batch, layer)
over gloo, each slot filled by its group alone (the float32 values as int32 bit
patterns, so zeros add exactly, signs of zero included); then each rank puts back its
buffers as they were before the step and replays the G * M updates in one process's
order: group 0's micro-batches, then group 1's. The CPU kernel's update, in float32, is
`mean' = m * mean + (1 - m) * mean_run` and `var' = fma(m, u, (1 - m) * var_run)`, with
`m` the momentum rounded to float32 (with momentum None, `1 / num_batches_tracked` after
its increment) and `1 - m` taken in float32; `replay` computes exactly that, checked bit
for bit against the kernel (tests/test_group_statistics.py). Only a float32 BatchNorm of
torch's own forward computed on the CPU at fp32 precision in a sync schedule is
replayed (`pipefb.job.shapes.replays_statistics`, `replays_on`); any other
buffer-writing layer keeps its group's statistics and the submit check says so
(`pipefb.job.checks.group_statistics_warning`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pipefb.runtime.allreduce import Reducer

# (running_mean, running_var, num_batches_tracked or None) of one layer
Statistics = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def replays_on(device: torch.device, mode: str, precision: str, lead_forwards: bool) -> bool:
    """Whether a job's ranks replay one process's statistics: on the CPU (the kernel whose
    update `replay` matches), in a sync schedule without forwards of the next step before
    the boundary (PipeDream's), at fp32 precision (no autocast of the layer's input)."""
    return device.type == "cpu" and mode == "sync" and precision == "fp32" and not lead_forwards


def batch_statistics(layer: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor
                     ) -> torch.Tensor:
    """One micro-batch's (batch mean, unbiased variance) per channel, `(2, C)`, as the
    kernel computes them for its running statistics."""
    channels = x.shape[1]
    mean = torch.zeros(channels, dtype=x.dtype, device=x.device)
    var = torch.zeros(channels, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        torch.native_batch_norm(x.detach().contiguous(), None, None, mean, var, True, 1.0,
                                layer.eps)
    return torch.stack([mean, var])


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 `a * b + c` rounded once: in float64 (the product is exact there), the sum
    rounded to odd (its exact error from TwoSum decides), then to float32, which is then
    the correctly rounded result."""
    a64, b64, c64 = a.double(), b.double(), c.double()
    p = a64 * b64
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    s = torch.where((err != 0) & even, torch.nextafter(s, s + err), s)
    return s.float()


def replay(stats: Statistics, batch: torch.Tensor, momentum: float | None) -> Statistics:
    """The running statistics after one micro-batch's update, as the CPU kernel makes it.

    Args:
        stats: the running mean and variance (float32) and the batch count.
        batch: the micro-batch's (mean, unbiased variance), `(2, C)` (`batch_statistics`).
        momentum: the layer's; None: the cumulative average, `1 / count` after the
            increment, as `nn.BatchNorm` computes its factor.
    """
    mean, var, count = stats
    if count is not None:
        count = count + 1
    if momentum is None and count is None:
        raise ValueError("a BatchNorm with momentum None has no num_batches_tracked")
    factor = momentum if momentum is not None else 1.0 / float(count)  # type: ignore[arg-type]
    m = torch.tensor(factor, dtype=torch.float32, device=mean.device)
    keep = 1 - m  # in float32, as the kernel takes it
    return (m * batch[0] + keep * mean,
            fma32(m.expand_as(var), batch[1], keep * var), count)


class GroupStatistics:
    """One rank's BatchNorm layers whose forward it runs, with the step's records."""

    def __init__(self, layers: Mapping[int, torch.nn.Module], replayed: Sequence[int],
                 microbatches: int, groups: int, offset: int) -> None:
        """`replayed`: the layers of `layers` to replay (forward layers of this rank that
        `replays_statistics` accepts); `offset`: the step's index of this group's first
        micro-batch (`group * microbatches`)."""
        self.norms = {i: _batchnorm(layers[i]) for i in replayed} if groups > 1 else {}
        self.microbatches, self.groups, self.offset = microbatches, groups, offset
        self.reducer: Reducer | None = None  # the same forward stage in every group
        self.before: dict[int, Statistics] = {}  # the buffers before the step's first forward
        self.records: dict[int, torch.Tensor] = {}  # layer -> (G * M, 2, C), this group's rows

    @property
    def holds_any(self) -> bool:
        """Whether this rank replays any layer's statistics (and joins the exchange)."""
        return bool(self.norms)

    def record(self, i: int, m: int, x: torch.Tensor) -> None:
        """Records micro-batch m's batch statistics of layer i from its input `x`, before
        its forward updates the buffers (a no-op for a layer not replayed)."""
        layer = self.norms.get(i)
        if layer is None:
            return
        if i not in self.before:
            self.before[i] = _buffers(layer)
        rows = self.records.get(i)
        if rows is None:
            rows = torch.zeros(self.groups * self.microbatches, 2, x.shape[1],
                               dtype=torch.float32, device=x.device)
            self.records[i] = rows
        rows[self.offset + m] = batch_statistics(layer, x)

    def reduce_(self) -> int:
        """Exchanges the step's records with the other groups and replays every
        micro-batch's update in one process's order; returns the bytes exchanged."""
        if not self.records:
            return 0
        if self.reducer is None:
            raise RuntimeError("group statistics have no exchange to join")
        order = sorted(self.records)
        bits = [self.records[i].view(torch.int32) for i in order]
        sent = self.reducer.sum_(bits)
        for i in order:
            layer, stats = self.norms[i], self.before[i]
            for batch in self.records[i]:
                stats = replay(stats, batch, layer.momentum)
            _put(layer, stats)
        self.records.clear()
        self.before.clear()
        return sent


def _batchnorm(layer: torch.nn.Module) -> torch.nn.modules.batchnorm._BatchNorm:
    if not isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
        raise TypeError(f"layer {type(layer).__name__} is not a BatchNorm")
    return layer


def _buffers(layer: torch.nn.modules.batchnorm._BatchNorm) -> Statistics:
    assert layer.running_mean is not None and layer.running_var is not None
    count = layer.num_batches_tracked
    return (layer.running_mean.clone(), layer.running_var.clone(),
            None if count is None else count.clone())


def _put(layer: torch.nn.modules.batchnorm._BatchNorm, stats: Statistics) -> None:
    assert layer.running_mean is not None and layer.running_var is not None
    mean, var, count = stats
    with torch.no_grad():
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
        if count is not None and layer.num_batches_tracked is not None:
            layer.num_batches_tracked.copy_(count)
