"""Gradient all-reduce across pipeline groups (group hybrid parallelism).

With G pipeline groups, the G ranks that hold the same backward stage (one per group) form
one torch.distributed process group: gloo on the CPU, NCCL on CUDA where every member has a
GPU of its own ([Note: shared GPU]). Before each optimizer
step they sum their stage's gradients, so every group applies the same update and keeps the
same weights. The rendezvous is a `torch.distributed.TCPStore` that the coordinator hosts
and names in the assignment; each stage's group lives under its own key prefix there.

Process groups are built as objects, not through `init_process_group`, so one process may
hold several over its life (one per job) and nothing global is left behind.

[Note: shared GPU] NCCL refuses two ranks on one GPU ("invalid usage"), and the workers of
a one-GPU machine share it. So the members of a CUDA group first publish their GPU's UUID
under the group's prefix; where two are the same, the group runs gloo instead and each
sum is staged through host memory. Every member reads the same UUIDs, so all choose alike.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipefb.errors import ConfigError

TIMEOUT_SECONDS = 60.0  # rendezvous and each collective; a dead peer fails the step by then


class Reducer(Protocol):
    """Sums tensors in place across the ranks holding the same stage in every group."""

    def sum_(self, tensors: Sequence[torch.Tensor]) -> int:
        """Replaces each tensor by its sum over the group; returns the bytes reduced."""
        ...

    def close(self) -> None:
        """Releases the process group (aborting a collective in progress)."""
        ...


def rendezvous_key(job_id: str, attempt: int, stage: int) -> str:
    """The TCPStore prefix of one stage's process group in one attempt of a job."""
    return f"pipefb/{job_id}/{attempt}/stage{stage}/"


def norm_rendezvous_key(job_id: str, attempt: int, group: int) -> str:
    """The TCPStore prefix of one group's gradient-norm exchange among the owners of its
    stages (pipefb.runtime.clipping), in one attempt of a job."""
    return f"pipefb/{job_id}/{attempt}/norm{group}/"


def tie_rendezvous_key(job_id: str, attempt: int, group: int) -> str:
    """The TCPStore prefix of one group's exchange of tied parameters' gradients among the
    stages that own a use (pipefb.runtime.tied), in one attempt of a job."""
    return f"pipefb/{job_id}/{attempt}/tied{group}/"


def stats_rendezvous_key(job_id: str, attempt: int, stage: int) -> str:
    """The TCPStore prefix of one forward stage's exchange of BatchNorm statistics across
    the groups (pipefb.runtime.groupstats), in one attempt of a job."""
    return f"pipefb/{job_id}/{attempt}/stats{stage}/"


def parse_address(address: str) -> tuple[str, int]:
    """Splits `host:port`.

    Raises:
        ConfigError: no port, or a port outside 1..65535; names the address.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"rendezvous address {address!r} must be host:port")
    return host, int(port)


class GroupAllReduce:
    """One stage's process group over its G replicas, joined through the rendezvous store."""

    def __init__(self, address: str, key: str, rank: int, size: int, device: torch.device,
                 bind_host: str = "127.0.0.1", timeout_seconds: float = TIMEOUT_SECONDS
                 ) -> None:
        """Joins the group; blocks until all `size` members have joined (or times out).

        Args:
            address: host:port of the rendezvous store.
            key: this group's prefix in the store (`rendezvous_key`).
            rank: this replica's index, its pipeline group.
            size: the number of groups.
            device: where the gradients live (cuda: NCCL, else gloo).
            bind_host: the address gloo listens on for its peers: this worker's own
                advertised host, so nothing listens beyond it.
            timeout_seconds: for the rendezvous and for each collective.

        Raises:
            ConfigError: a bad address, or `rank` outside 0..size-1.
        """
        if not 0 <= rank < size:
            raise ConfigError(f"group rank {rank} is outside 0..{size - 1}")
        host, port = parse_address(address)
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = dist.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                              timeout=timeout)
        prefixed = dist.PrefixStore(key, store)  # type: ignore[attr-defined]
        self.group: Any  # ProcessGroupGloo or ProcessGroupNCCL (torch's stubs type them apart)
        #: sums go through host memory: a CUDA group whose members share a GPU
        self.staged = device.type == "cuda" and not own_gpus(prefixed, rank, size, device)
        if device.type == "cuda" and not self.staged:
            nccl: Any = dist.ProcessGroupNCCL  # type: ignore[attr-defined,unused-ignore]
            self.group = nccl(prefixed, rank, size, nccl.Options())
        else:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            self.group = dist.ProcessGroupGloo(prefixed, rank, size, options)

    def sum_(self, tensors: Sequence[torch.Tensor]) -> int:
        """Sums the tensors across the group in place: one flat buffer per dtype, so the
        whole stage goes in as few collectives as it has dtypes."""
        total = 0
        for bucket in _by_dtype(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            if self.staged:  # [Note: shared GPU]: through host memory, back in one copy
                host = flat.cpu()
                self.group.allreduce([host]).wait()
                flat = host.to(flat.device)
            else:
                self.group.allreduce([flat]).wait()
            offset = 0
            with torch.no_grad():
                for t in bucket:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
            total += flat.numel() * flat.element_size()
        return total

    def close(self) -> None:
        """Aborts the process group: a peer blocked in a collective with us fails at once."""
        abort = getattr(self.group, "abort", None)
        if abort is not None:
            abort()


def own_gpus(store: Any, rank: int, size: int, device: torch.device) -> bool:
    """Whether every member of a group is on a GPU of its own ([Note: shared GPU]): each
    publishes its device's UUID under the group's prefix and reads everyone's."""
    store.set(f"gpu-{rank}", str(torch.cuda.get_device_properties(device).uuid))
    keys = [f"gpu-{r}" for r in range(size)]
    store.wait(keys)
    return distinct([store.get(k).decode() for k in keys])


def distinct(ids: Sequence[str]) -> bool:
    """Whether no two of `ids` are the same."""
    return len(set(ids)) == len(ids)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault(t.dtype, []).append(t)
    return list(buckets.values())
