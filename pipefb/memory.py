"""Memory accounting by kind of the tensors a stage runtime holds, with a per-step peak."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

#: What a rank's memory is made of. `activations`: tensors in flight between actions (stage
#: inputs and outputs, gradients); `stashed`: saved tensors held in the worker for a later
#: backward (policy keep, and the inputs of recomputed runs); `weight_versions`: old
#: weight versions kept for weight stashing; `stash_in_flight`: stashes handed to the
#: store's I/O thread and not yet written ([Note: background stash] in offload_store/writer.py);
#: `node_tier`: the rank's files in the node-local tier (segments it wrote and no rank took
#: yet, spares kept for its next writes: `StashStore.node_bytes`), host memory shared on
#: the node, outside the rank's own total (`OUTSIDE_TOTAL`).
KINDS = ("parameters", "gradients", "optimizer_state", "weight_versions", "activations",
         "stashed", "stash_in_flight", "node_tier")
#: Kinds reported beside the rank's memory, not in its total: a stash in the store is no
#: rank's memory, as the planner and the simulator count it.
OUTSIDE_TOTAL = ("node_tier",)


#: (data pointer, bytes) of one storage: what the counting below dedupes and sums
Storage = tuple[int, int]


def storages(tensors: Iterable[torch.Tensor]) -> list[Storage]:
    """The storage each tensor reaches, in order, read once: a holder of many long-lived
    tensors (the runtime's kept saved tensors) notes them when it takes them, so counting
    after every action sums integers instead of asking every tensor again."""
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        out.append((storage.data_ptr(), storage.nbytes()))
    return out


def storage_bytes(found: Iterable[Storage], exclude: Iterable[int] = (),
                  seen: set[int] | None = None) -> int:
    """Bytes of the storages (a storage found twice is counted once).

    Args:
        found: (data pointer, bytes) pairs, as `storages` gives them.
        exclude: storage data pointers already counted elsewhere (e.g. the parameters,
            which autograd also saves for backward).
        seen: if given, the storages counted so far, updated in place, so that one storage
            reached by two calls counts once.
    """
    if seen is None:
        seen = set()
    seen.update(exclude)
    total = 0
    for key, nbytes in found:
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def tensor_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[int] = (),
                 seen: set[int] | None = None) -> int:
    """Bytes of the storage the tensors reach (a shared storage is counted once); `exclude`
    and `seen` as in `storage_bytes`."""
    return storage_bytes(storages(tensors), exclude, seen)


ACTIVATION_KINDS = ("activations", "stashed")  # what activation policies trade


@dataclass
class MemoryAccount:
    """Current bytes by kind; since the last `reset_peak`: the peak of their sum (but
    `OUTSIDE_TOTAL`; with every kind at that moment), each kind's own peak, and the peak
    of activation memory."""

    current: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak_total: int = 0
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak_each: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak_activation: int = 0  # of activations + stashed

    def set(self, values: Mapping[str, int]) -> None:
        """Records the current bytes of some kinds and updates the peaks."""
        self.current.update(values)
        total = _total(self.current)
        if total > self.peak_total:
            self.peak_total = total
            self.peak = dict(self.current)
        for kind, value in self.current.items():
            self.peak_each[kind] = max(self.peak_each.get(kind, 0), value)
        self.peak_activation = max(self.peak_activation,
                                   sum(self.current.get(k, 0) for k in ACTIVATION_KINDS))

    def total_besides(self, *kinds: str) -> int:
        """The rank's current total (`OUTSIDE_TOTAL` aside) less the bytes of `kinds`."""
        return _total(self.current) - sum(self.current.get(k, 0) for k in kinds
                                          if k not in OUTSIDE_TOTAL)

    def reset_peak(self) -> None:
        """Starts a new peak window (each step) from the current bytes."""
        self.peak_total = _total(self.current)
        self.peak = dict(self.current)
        self.peak_each = dict(self.current)
        self.peak_activation = sum(self.current.get(k, 0) for k in ACTIVATION_KINDS)


def _total(kinds: Mapping[str, int]) -> int:
    """The rank's own bytes: every kind but `OUTSIDE_TOTAL`."""
    return sum(v for k, v in kinds.items() if k not in OUTSIDE_TOTAL)


#: The CUDA caching allocator's statistics that a step reports (`DeviceMemory.snapshot`).
DEVICE_STATS = ("allocated_peak", "allocated", "reserved_peak")


@dataclass
class DeviceMemory:
    """This process's CUDA allocator statistics per step; nothing on the cpu.

    They complement `MemoryAccount`: the account counts the tensors the runtime holds by
    kind, the allocator counts every byte the process allocated on the device (temporaries
    inside a layer's forward or backward, workspaces, block rounding), so the account's
    peak is at most `allocated_peak`. Each worker process has its own allocator, also when
    several share one GPU.
    """

    device: torch.device

    def reset_peak(self) -> None:
        """Starts a new peak window (each step)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        """Waits for the device's queued work, so wall-clock times cover it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def snapshot(self) -> dict[str, int]:
        """allocated_peak and reserved_peak since `reset_peak`, allocated now; {} on cpu."""
        if self.device.type != "cuda":
            return {}
        return {"allocated_peak": torch.cuda.max_memory_allocated(self.device),
                "allocated": torch.cuda.memory_allocated(self.device),
                "reserved_peak": torch.cuda.max_memory_reserved(self.device)}
