"""Times a rank's layers for the re-planner and stretches its compute by the job's
injected slowdown (`JobConfig.slowdown`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from pipefb.job.config import JobConfig, slowdowns
from pipefb.memory import DeviceMemory


class LayerClock:
    """Per-layer seconds of the running step, and the slowdown of each compute action."""

    def __init__(self, job: JobConfig, rank: int, device_memory: DeviceMemory) -> None:
        self._slowdown = slowdowns(job.slowdown).get(rank, (1.0, 0))  # fault injection
        self._layer_slowdown = slowdowns(job.slowdown, layers=True)
        self._time_layers = job.replan  # the re-planner reads per-layer seconds
        self._device_memory = device_memory
        self.layer_seconds: dict[int, float] = {}  # this step's, while it runs
        self.in_layers = 0.0  # seconds the running action spent in `layer` bodies

    def start_step(self) -> None:
        """Forgets the previous step's per-layer seconds."""
        self.layer_seconds = {}

    def start_action(self) -> None:
        """Starts counting the seconds the next action spends in its layers."""
        self.in_layers = 0.0

    def factor(self, step: int, layer: int | None = None) -> float:
        """Fault injection (the job's `slowdown`): how many times as long compute takes at
        `step` on this rank, as on a slower or shared device, times, for `layer`, that
        layer's own factor, as when its input grew (1: not slowed)."""
        factor, start = self._slowdown
        rank = factor if step >= start else 1.0
        if layer is None:
            return rank
        factor, start = self._layer_slowdown.get(layer, (1.0, 0))
        return rank * (factor if step >= start else 1.0)

    @contextmanager
    def layer(self, step: int, layer: int) -> Iterator[None]:
        """Runs the body (a layer's forward or backward), stretches it by `factor` and,
        for the re-planner, adds its seconds to the layer's."""
        factor = self.factor(step, layer)
        if not self._time_layers and factor == 1.0:
            yield
            return
        started = time.perf_counter()
        yield
        self._device_memory.synchronize()
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - started))
        elapsed = time.perf_counter() - started
        self.in_layers += elapsed
        if self._time_layers:
            self.layer_seconds[layer] = self.layer_seconds.get(layer, 0.0) + elapsed

    def slow_rest(self, step: int, seconds: float) -> None:
        """Stretches the `seconds` of a compute action spent outside its layers (the
        optimizer step) by the rank's `factor`; the layers were stretched as they ran."""
        factor = self.factor(step)
        if factor > 1.0:
            time.sleep((factor - 1.0) * seconds)
