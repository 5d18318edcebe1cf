"""Memory of the baselines, counted as pipefb's workers count theirs: parameters, gradients,
optimizer state, and the peak of the tensors autograd saves for backward.

pipefb's ranks account their memory by kind (`pipefb.memory`); `single` and the
torch.distributed.pipelining ranks have no such accounting, so the matrix bench measures
them with `SavedTensorMeter`, a `saved_tensors_hooks` pair that counts every storage
autograd saves (once, however many tensors view it; parameters left out) from the moment
it is saved until autograd frees it after its backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import TracebackType

import torch


class _Held:
    """What the pack hook hands autograd: the saved tensor, watched by a finalizer."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter:
    """Live and peak bytes of the tensors autograd saves while the meter is entered.

    Args:
        exclude: tensors whose storages are not activations (the parameters, which
            autograd saves too).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        """Starts a new peak from what is live now."""
        self.peak = self.current

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return tensor
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[return-value]

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, tb)
