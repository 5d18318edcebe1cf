"""A stash's tensors laid out in one flat host buffer per layer and dtype.

[Note: coalesced copies] A stash holds tens of tensors, and each copy between a CUDA
device and host memory cost a few Python-level torch calls (a pinned allocation, a host
copy, the device copy, a `record_stream`) whose CPU time a launch-bound model's step pays
in full. With one pinned buffer per layer and dtype, the host side takes a few calls per
stash: into host memory, one `_foreach_copy_` copies every tensor into its place
(`copy_into`: its loop runs in C++, one device copy per tensor still); out of host
memory, the tensors taken from the store are packed into the buffers (`pack_into`: one
`torch.cat` per buffer). `unpack` gives a buffer's tensors as views (one
`split_with_sizes` per buffer, then a `view` per tensor). Each tensor still goes to the
device on its own (`to_device`), never as a view of one device buffer: the backward frees
a layer's saved tensors one by one (a deferred weight half keeps only those it reads), and
a view would keep the whole buffer. Tensors come back contiguous in their own shapes, as
a copy through `torch.empty` and `copy_` gives them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from offload_store.api import LayerTensors

Group = tuple[int, torch.dtype]  # (layer, dtype): the tensors of one flat buffer


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a stash lies: per group, in buffer order, its name and shape;
    and each layer's names in the stash's order (the order `unpack` gives them back in)."""

    groups: dict[Group, list[tuple[str, torch.Size]]]
    order: dict[int, list[str]]

    def numel(self, group: Group) -> int:
        """The elements of one group's buffer."""
        return sum(math.prod(shape) for _, shape in self.groups[group])


def layout_of(tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> Layout:
    """The layout of `tensors`: per (layer, dtype), in the stash's order."""
    groups: dict[Group, list[tuple[str, torch.Size]]] = {}
    for layer, named in tensors.items():
        for name, t in named.items():
            groups.setdefault((layer, t.dtype), []).append((name, t.shape))
    return Layout(groups, {layer: list(named) for layer, named in tensors.items()})


def unpack(flats: Mapping[Group, torch.Tensor], layout: Layout) -> LayerTensors:
    """The stash's tensors as views of the flat buffers, one per group of `layout`."""
    views: dict[int, dict[str, torch.Tensor]] = {}
    for group, entries in layout.groups.items():
        layer, _ = group
        pieces = flats[group].split_with_sizes([math.prod(shape) for _, shape in entries])
        named = views.setdefault(layer, {})
        for (name, shape), piece in zip(entries, pieces, strict=True):
            named[name] = piece.view(shape)
    return {layer: {name: views[layer][name] for name in names}
            for layer, names in layout.order.items()}


def copy_into(tensors: Mapping[int, Mapping[str, torch.Tensor]], layout: Layout,
              flats: Mapping[Group, torch.Tensor], non_blocking: bool = False
              ) -> LayerTensors:
    """Copies every tensor into its place in `flats` (any device: one `_foreach_copy_`);
    returns the views of `flats` that hold them."""
    out = unpack(flats, layout)
    targets = [t for named in out.values() for t in named.values()]
    sources = [tensors[layer][name] for layer, names in layout.order.items()
               for name in names]
    if targets:
        with torch.no_grad():  # a copy, not an autograd node
            torch._foreach_copy_(targets, sources, non_blocking=non_blocking)
    return out


def pack_into(tensors: Mapping[int, Mapping[str, torch.Tensor]], layout: Layout,
              flats: Mapping[Group, torch.Tensor]) -> None:
    """Fills each of `flats` (on the tensors' device) with its group's tensors, flattened
    in layout order: one `torch.cat` per buffer."""
    with torch.no_grad():  # a copy, not an autograd node
        for group, entries in layout.groups.items():
            layer, _ = group
            torch.cat([tensors[layer][name].reshape(-1) for name, _ in entries],
                      out=flats[group])


def to_device(host: LayerTensors, device: torch.device) -> LayerTensors:
    """Each of `host`'s tensors copied to `device` on the current stream (asynchronous
    from pinned memory), as tensors of their own."""
    return {layer: {name: t.to(device, non_blocking=True) for name, t in named.items()}
            for layer, named in host.items()}


def hand_to(tensors: LayerTensors, stream: torch.cuda.Stream) -> LayerTensors:
    """Marks every tensor's memory as `stream`'s from now on (the caching allocator reuses
    it only after that stream's work), once the stream waited for their copies."""
    for named in tensors.values():
        for t in named.values():
            t.record_stream(stream)
    return tensors
