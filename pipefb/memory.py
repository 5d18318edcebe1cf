"""Memory accounting by kind of the tensors a stage runtime holds, with a per-step peak."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

KINDS = ("parameters", "gradients", "optimizer_state", "weight_versions", "activations")


def tensor_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[int] = ()) -> int:
    """Bytes of the storage the tensors reach (a shared storage is counted once).

    Args:
        tensors: the tensors to count.
        exclude: storage data pointers already counted elsewhere (e.g. the parameters,
            which autograd also saves for backward).
    """
    seen: set[int] = set(exclude)
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@dataclass
class MemoryAccount:
    """Current bytes by kind and the peak of their sum since the last `reset_peak`."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak_total: int = 0
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def set(self, values: Mapping[str, int]) -> None:
        """Records the current bytes of some kinds and updates the peak."""
        self.current.update(values)
        total = sum(self.current.values())
        if total > self.peak_total:
            self.peak_total = total
            self.peak = dict(self.current)

    def reset_peak(self) -> None:
        """Starts a new peak window (each step) from the current bytes."""
        self.peak_total = sum(self.current.values())
        self.peak = dict(self.current)
