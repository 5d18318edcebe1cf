"""Weight stashing: the old weight versions a rank keeps for backwards whose forward used them.

A rank that owns weights updates them in place at OPT. A backward must use the weights its
forward used (PipeDream's weight stashing; async PipeFB's stale forwards), so before an
update the runtime keeps a copy of the version some later backward still needs, and drops
it right after its last use. The live parameters are the newest version and are never
copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from pipefb.memory import tensor_bytes


class WeightVersions:
    """Copies of old weight versions, by version and layer (params in module order)."""

    def __init__(self) -> None:
        self._kept: dict[int, dict[int, list[torch.Tensor]]] = {}
        self.nbytes = 0  # bytes of every kept copy, updated where the copies change

    def keep(self, version: int, layers: Mapping[int, torch.nn.Module]) -> None:
        """Copies the current parameters of `layers` as `version` (before an update)."""
        self._kept[version] = {i: [p.detach().clone() for p in layer.parameters()]
                               for i, layer in layers.items()}
        self._count()

    def put(self, version: int, params: Mapping[int, list[torch.Tensor]]) -> None:
        """Keeps `params` (by layer, in module order) as `version`: a checkpoint's copy."""
        self._kept[version] = {i: list(ts) for i, ts in params.items()}
        self._count()

    def params(self, version: int, layer: int) -> list[torch.Tensor]:
        """The parameters of `layer` at a kept `version`.

        Raises:
            KeyError: the version was never kept or was already dropped.
        """
        if version not in self._kept:
            raise KeyError(f"weight version {version} is not kept (kept: {sorted(self._kept)})")
        return self._kept[version][layer]

    def prune(self, needed: Iterable[int]) -> None:
        """Drops every kept version not in `needed`."""
        wanted = set(needed)
        dropped = [v for v in self._kept if v not in wanted]
        for version in dropped:
            del self._kept[version]
        if dropped:
            self._count()

    def versions(self) -> list[int]:
        """The kept versions, ascending."""
        return sorted(self._kept)

    def _count(self) -> None:
        self.nbytes = tensor_bytes(t for layers in self._kept.values()
                                   for ts in layers.values() for t in ts)
