"""What every dataset shares: the `Dataset` protocol, what a dataset may know of its job
(`DataContext`), per-micro-batch generators, and epoch orders over finite sample sets."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from pipefb.errors import ConfigError
from pipefb.job.dataroots import DataRoots, current
from pipefb.job.shapes import TensorSpec
from pipefb.seeding import derive_seed

SPLIT_CODES = {"train": 0, "eval": 1}  # folded into the sampling seed of non-train splits
_EPOCH_TAG = 0xE90C  # separates epoch permutations' seeds from micro-batch seeds
_UNKNOWN_BATCH_STRIDE = 4096  # micro-batches a step may hold (JobConfig's maximum)


@runtime_checkable
class Dataset(Protocol):
    """What workers sample from: the same (step, microbatch, size, split) gives the same data."""

    splits: tuple[str, ...]

    def microbatch(
        self, step: int, microbatch: int, size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (inputs, targets) of `size` samples, deterministic in (seed, step, mb)."""
        ...

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole eval split when it is a finite set of samples, else None (evaluation
        then samples it with `microbatch`)."""
        ...


@runtime_checkable
class KnowsSpecs(Protocol):
    """A dataset that tells a micro-batch's shapes and dtypes without reading samples, so
    the ranks that take neither inputs nor targets never read the data."""

    def specs(self, size: int) -> tuple[TensorSpec, TensorSpec]:
        """(inputs, targets) specs of a micro-batch of `size` samples."""
        ...


@dataclass(frozen=True)
class DataContext:
    """What a dataset builder may know beyond its own config, from the job and process."""

    roots: DataRoots = field(default_factory=current)  # where it may read files
    batch_size: int = 0  # samples per step (positions in an epoch order); 0: unknown
    block_size: int | None = None  # the model's context length, where it has one
    vocab_size: int | None = None  # the model's vocabulary size, where it has one
    check_all: bool = False  # at submit: check every sample (token ids in the vocabulary)


def sampler(seed: int, step: int, microbatch: int, split: str) -> torch.Generator:
    """Returns the CPU generator of one micro-batch of `split`.

    It is seeded with `derive_seed(seed, step, microbatch)` for "train" and with the split's
    code appended for the other splits, so eval draws differ from train draws.
    """
    parts: tuple[int, ...] = (seed, step, microbatch)
    if split != "train":
        parts += (SPLIT_CODES[split],)
    return torch.Generator().manual_seed(derive_seed(*parts))


def check_request(splits: tuple[str, ...], split: str, size: int) -> None:
    """Refuses a split the dataset lacks or a size that is not a positive int."""
    if split not in splits:
        raise ConfigError(f"unknown split {split!r}; this dataset has {list(splits)}")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"micro-batch size {size!r} must be a positive int")


class EpochOrder:
    """Samples 0..n-1 of a split in a fresh seeded order each epoch.

    [Note: epoch order] Micro-batch m of step k takes the `size` samples at positions
    `k * batch_size + m * size` onwards of the endless sequence epoch 0, epoch 1, ...,
    each epoch a permutation seeded by (seed, split, epoch). So a step's micro-batches
    never share a sample, nor do the pipeline groups that run them (group g runs the
    step's micro-batches `g * M / G` onwards), every sample is seen once per epoch, and
    the draws are a pure function of (seed, step, micro-batch): a resumed job draws
    exactly what the uninterrupted one would.
    """

    def __init__(self, n: int, seed: int, split: str, batch_size: int) -> None:
        self.n, self.seed, self.split, self.batch_size = n, seed, split, batch_size

    def indices(self, step: int, microbatch: int, size: int) -> torch.Tensor:
        """The sample indices (size,) int64 of one micro-batch."""
        stride = self.batch_size or size * _UNKNOWN_BATCH_STRIDE
        start = step * stride + microbatch * size
        parts, at = [], start
        while at < start + size:
            epoch, offset = divmod(at, self.n)
            take = min(self.n - offset, start + size - at)
            parts.append(self._permutation(epoch)[offset:offset + take])
            at += take
        return torch.cat(parts)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return _permutation(self.n, derive_seed(self.seed, _EPOCH_TAG, SPLIT_CODES[self.split],
                                                epoch))


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int) -> torch.Tensor:
    """A seeded permutation of 0..n-1 (n,) int64; the last few are kept (a step's
    micro-batches share one epoch but at its end)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))
