"""The local tier: stashes a rank takes back itself (a combined rank's `offload` layers) stay
in this process's host memory, in front of the shared store.

[Note: local tier] A combined rank that offloads is both the producer and the consumer
of its stash, so the stash need not cross a socket: `put` keeps each micro-batch's saved
tensors in host memory and `take` hands them back. On CUDA the tensors are copied into
pinned host memory on a copy stream of their own, after an event recorded on the compute
stream, so the compute stream never waits for the copy; `take` copies them back on that
stream and makes the compute stream wait for it with an event (the `save_on_cpu`
pattern, asynchronous), a layer's tensors of one dtype in one pinned buffer on the host
([Note: coalesced copies] in offload_store/coalesce.py). On the CPU the host is the device: the
tensors are kept as they are and the runtime counts them as its own memory, which is why
the CPU default is no local tier (`local_tier_cap`). A cap bounds the tier: a stash that
does not fit goes to the shared store as before, so nothing is ever dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from offload_store.coalesce import (
    Group,
    Layout,
    copy_into,
    hand_to,
    layout_of,
    to_device,
    unpack,
)

# The default cap of a rank's local tier on CUDA (worker --local-stash-bytes); on the CPU the
# default is 0 (off): there the host is the device, so a stash kept in the process saves no
# memory, and `offload` means the shared store
LOCAL_STASH_BYTES = 1 << 30


def local_tier_cap(requested: int, device: torch.device) -> int:
    """The local tier's cap: `requested`, or (-1) the device's default."""
    if requested >= 0:
        return requested
    return LOCAL_STASH_BYTES if device.type == "cuda" else 0
LayerTensors = dict[int, dict[str, torch.Tensor]]
Key = tuple[int, int]  # (step, micro-batch)
# what a stash is kept as: its tensors (the CPU), or pinned buffers and their layout (CUDA)
Kept = LayerTensors | tuple[dict[Group, torch.Tensor], Layout]


class LocalTier:
    """Micro-batch stashes held in this process, up to `cap_bytes`."""

    def __init__(self, device: torch.device, cap_bytes: int) -> None:
        self.device, self.cap_bytes = device, cap_bytes
        self._held: dict[Key, tuple[Kept, int, object | None]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._stream = (torch.cuda.Stream(device) if device.type == "cuda"  # type: ignore[no-untyped-call]
                        else None)

    @property
    def held_bytes(self) -> int:
        """Bytes of the stashes held now."""
        return self._bytes

    def put(self, step: int, microbatch: int, tensors: Mapping[int, Mapping[str, torch.Tensor]]
            ) -> int | None:
        """Keeps one micro-batch's stash; returns its bytes, or None when it would pass the
        cap (the caller puts it into the shared store instead)."""
        size = sum(t.nelement() * t.element_size() for named in tensors.values()
                   for t in named.values())
        with self._lock:
            if self._bytes + size > self.cap_bytes:
                return None
            self._bytes += size
        held, done = self._to_host(tensors)
        with self._lock:
            self._held[(step, microbatch)] = (held, size, done)
        return size

    def holds(self, step: int, microbatch: int) -> bool:
        """Whether the stash of (step, micro-batch) is kept here."""
        with self._lock:
            return (step, microbatch) in self._held

    def take(self, step: int, microbatch: int, names: Mapping[int, Sequence[str]]
             ) -> LayerTensors | None:
        """Hands back a kept stash (on the device) and forgets it; None if not kept here."""
        with self._lock:
            entry = self._held.pop((step, microbatch), None)
            if entry is None:
                return None
            held, size, done = entry
            self._bytes -= size
        return self._to_device(held, done, names)

    def _to_host(self, tensors: Mapping[int, Mapping[str, torch.Tensor]]
                 ) -> tuple[Kept, object | None]:
        if self._stream is None:
            return {i: dict(named) for i, named in tensors.items()}, None
        layout = layout_of(tensors)
        flats = {group: torch.empty(layout.numel(group), dtype=group[1], pin_memory=True)
                 for group in layout.groups}
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            copy_into(tensors, layout, flats, non_blocking=True)
            for named in tensors.values():
                for t in named.values():
                    t.record_stream(self._stream)  # its memory is reused only after the copy
        return (flats, layout), self._stream.record_event()

    def _to_device(self, held: Kept, done: object | None, names: Mapping[int, Sequence[str]]
                   ) -> LayerTensors:
        if isinstance(held, dict):  # the CPU: the tensors themselves
            return {i: {n: held[i][n] for n in names[i]} for i in names}
        assert self._stream is not None and isinstance(done, torch.cuda.Event)
        flats, layout = held
        views = unpack(flats, layout)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(done)
            out = to_device({i: {n: views[i][n] for n in names[i]} for i in names},
                            self.device)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self._stream.record_event())
        return hand_to(out, compute)

    def clear(self) -> None:
        """Forgets every kept stash."""
        with self._lock:
            self._held.clear()
            self._bytes = 0
