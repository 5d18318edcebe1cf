"""The tensors a rank holds between the actions of its list, keyed by step and micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipefb.memory import Storage, storages
from pipefb.runtime.layersplit import DeferredGrads

# Keys of in-flight tensors: (training step, stage, micro-batch) or (step, micro-batch, layer).
Key = tuple[int, int, int]


class SavedTensors(dict[Key, dict[str, torch.Tensor]]):
    """Saved tensors kept for a later backward, by (step, micro-batch, layer), with the
    storages of each entry noted when it is stored (see `pipefb.memory.storages`).

    Entries are only stored (`[key] = ...`) and taken (`pop`); a stored dict is not changed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[Key, list[Storage]] = {}

    def __setitem__(self, key: Key, stash: dict[str, torch.Tensor]) -> None:
        super().__setitem__(key, stash)
        self.storages[key] = storages(stash.values())

    def pop(self, key: Key, default: dict[str, torch.Tensor] | None = None  # type: ignore[override]
            ) -> dict[str, torch.Tensor]:
        """Takes the entry of `key`; `default` (when given) if there is none."""
        if default is not None and key not in self:
            return default
        del self.storages[key]
        return super().pop(key)


@dataclass
class InFlight:
    """Tensors between actions; they outlive an iteration when an action leads (PipeDream)."""

    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    saved: SavedTensors = field(default_factory=SavedTensors)  # (step, mb, layer)
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    losses: dict[tuple[int, int], float] = field(default_factory=dict)
    forward_version: dict[Key, int] = field(default_factory=dict)  # combined ranks
    stashed_here: set[tuple[int, int]] = field(default_factory=set)  # (step, mb) in the store
    # (step, mb) -> layer -> the weight-grad half of its backward, oldest first ([Note:
    # input grads first] in docs/architecture.md); changed through `defer` and `undefer` only
    deferred: dict[tuple[int, int], dict[int, DeferredGrads]] = field(default_factory=dict)
    _deferred_storages: dict[tuple[int, int], list[Storage]] = field(default_factory=dict)

    def live(self) -> list[torch.Tensor]:
        """The activations and gradients between actions (not the saved tensors)."""
        return [*self.inputs.values(), *self.outputs.values(), *self.grads.values(),
                *self.input_grads.values()]

    def defer(self, key: tuple[int, int], halves: dict[int, DeferredGrads]) -> None:
        """Keeps a micro-batch's waiting weight halves, noting their storages once (as
        `SavedTensors` does)."""
        self.deferred[key] = halves
        self._deferred_storages[key] = storages(t for d in halves.values() for t in d.args)

    def undefer(self) -> dict[int, DeferredGrads]:
        """Takes the oldest micro-batch's waiting weight halves."""
        key = next(iter(self.deferred))
        del self._deferred_storages[key]
        return self.deferred.pop(key)

    def held(self) -> list[Storage]:
        """Storages of the saved tensors, and of the waiting weight halves' arguments."""
        return [found for stashes in (self.saved.storages, self._deferred_storages)
                for stash in stashes.values() for found in stash]

    def take_losses(self, step: int) -> list[float]:
        """Removes and returns step `step`'s losses, in micro-batch order."""
        losses = sorted((m, v) for (t, m), v in self.losses.items() if t == step)
        for m, _ in losses:
            del self.losses[(step, m)]
        return [v for _, v in losses]
