"""Device <-> host copies of stashes for the background writer and the prefetch, on CUDA: pinned,
reused staging buffers and a copy stream ordered by events.

[Note: staging] Not run on a GPU in this repository's tests (its machines have none): the
CPU path of `offload_store.writer` and the prefetch are what the tests exercise; this
module is kept to the few calls `torch.cuda` documents for the pattern of
`torch.autograd.graph.save_on_cpu(pin_memory=True)`, made asynchronous:

- device to host (`HostStaging.to_host`, on the compute thread): an event recorded on the
  compute stream, the copy stream waits for it, every tensor is copied into its place in
  a pinned buffer per layer and dtype ([Note: coalesced copies] in
  offload_store/coalesce.py: one `_foreach_copy_`), each buffer taken from a free list by
  its byte size (allocated once, reused for every later stash of that size),
  `record_stream` keeps the device tensors' memory from reuse until the copy ran, and an
  event recorded after the copies is what the I/O thread waits for
  (`Event.synchronize`) before it writes the buffers; the compute stream never waits;
- the buffers return to the free list once the write is done (`release`), never earlier;
- host to device (`to_device`, on the prefetch thread): the taken host tensors are packed
  into a pinned buffer per layer and dtype (one `torch.cat` each), and each tensor is
  copied from its place there to the device on the copy stream; the compute stream waits
  for the copies' event only when the backward takes the tensors (`Arrival.wait`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from offload_store.api import LayerTensors
from offload_store.coalesce import copy_into, hand_to, layout_of, pack_into, to_device, unpack


class HostStaging:
    """Pinned host buffers reused across stashes, and the copy stream that fills them."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"staging copies a CUDA device's stash, not {device}")
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._free: dict[int, list[torch.Tensor]] = {}  # byte size -> pinned uint8 buffers
        self._lock = threading.Lock()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                self._free.setdefault(buffer.nbytes, []).append(buffer)

    def to_host(self, tensors: LayerTensors
                ) -> tuple[LayerTensors, Callable[[], None], Callable[[], None]]:
        """Starts copying a stash into pinned buffers; returns (host tensors, wait for the
        copy, give the buffers back). Call on the compute thread."""
        layout = layout_of(tensors)
        buffers = {group: self._buffer(layout.numel(group) * group[1].itemsize)
                   for group in layout.groups}
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = copy_into(tensors, layout, {group: buffer.view(group[1])
                                              for group, buffer in buffers.items()},
                            non_blocking=True)
            for named in tensors.values():
                for t in named.values():
                    t.record_stream(self.stream)
        copied = self.stream.record_event()
        return out, copied.synchronize, lambda: self._give_back(list(buffers.values()))

    def to_device(self, tensors: LayerTensors) -> tuple[LayerTensors, Arrival]:
        """Starts copying taken host tensors to the device on the copy stream. Call on the
        prefetch thread; the consumer calls `Arrival.wait` before it uses them."""
        layout = layout_of(tensors)
        pinned = {group: torch.empty(layout.numel(group), dtype=group[1], pin_memory=True)
                  for group in layout.groups}
        pack_into(tensors, layout, pinned)
        with torch.cuda.stream(self.stream):
            out = to_device(unpack(pinned, layout), self.device)
        return out, Arrival(self.stream.record_event(), self.device)


class Arrival:
    """The event of a host-to-device copy; the compute stream waits for it once."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self, tensors: LayerTensors) -> LayerTensors:
        """Makes the compute stream wait for the copy; the tensors' memory is the compute
        stream's from then on."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.event)
        return hand_to(tensors, compute)
