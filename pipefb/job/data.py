"""Datasets by name, sampled deterministically in (seed, step, micro-batch) on any worker."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from pipefb.configparse import parse_config, require
from pipefb.errors import ConfigError
from pipefb.job.arrays import ArraysDataset
from pipefb.job.dataroots import Found, builtin_corpus
from pipefb.job.sampling import DataContext, Dataset, KnowsSpecs, sampler
from pipefb.job.sampling import check_request as _check_request
from pipefb.job.shapes import TensorSpec, spec_of
from pipefb.job.tokens import TokensDataset
from pipefb.plugins import find_builder, plugin_names
from pipefb.seeding import derive_seed

if TYPE_CHECKING:
    from pipefb.job.config import JobConfig

_DIGITS_SPLIT_SEED = 0x5EED_D161  # fixes the digits train/eval split for every job seed
_TEACHER_TAG = 0x7EAC  # separates the synthetic teacher's seed from sampling seeds


@dataclass(frozen=True)
class DigitsConfig:
    """Options of the `digits` dataset (scikit-learn's bundled 8x8 digits, 1797 images)."""

    eval_fraction: float = 0.2  # share of images held out as the eval split (fixed shuffle)

    def __post_init__(self) -> None:
        require(
            0.0 < self.eval_fraction < 1.0, "digits eval_fraction", self.eval_fraction, "in (0, 1)"
        )


@functools.cache
def _load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # imported lazily: sklearn is slow to import

    bunch = load_digits()
    inputs = torch.tensor(bunch.data, dtype=torch.float32) / 16.0  # (1797, 64) in [0, 1]
    return inputs, torch.tensor(bunch.target, dtype=torch.int64)  # (1797,)


class DigitsDataset:
    """8x8 digit images as (size, 64) float32 in [0, 1] with int64 labels (size,)."""

    splits: tuple[str, ...] = ("train", "eval")

    def __init__(self, config: dict[str, Any] | None, seed: int,
                 context: DataContext | None = None) -> None:
        cfg = parse_config(DigitsConfig, config, "dataset 'digits'")
        self.seed = seed
        inputs, targets = _load_digits()
        shuffle = torch.Generator().manual_seed(derive_seed(_DIGITS_SPLIT_SEED))
        order = torch.randperm(len(inputs), generator=shuffle)  # (1797,), same for every job
        n_eval = round(len(inputs) * cfg.eval_fraction)
        self.index = {"train": order[n_eval:], "eval": order[:n_eval]}
        self.data = {s: (inputs[i], targets[i]) for s, i in self.index.items()}

    def microbatch(
        self, step: int, microbatch: int, size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `size` images of `split` with replacement."""
        _check_request(self.splits, split, size)
        inputs, targets = self.data[split]
        gen = sampler(self.seed, step, microbatch, split)
        pick = torch.randint(len(inputs), (size,), generator=gen)  # (size,)
        return inputs[pick], targets[pick]

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every held-out image, once."""
        return self.data["eval"]


@dataclass(frozen=True)
class TextConfig:
    """Options of the `text` dataset: byte-level windows over a directory of text files."""

    path: str | None = None  # directory relative to a data root; None: this Python's
    # standard library (the built-in corpus)
    block_size: int = 32  # window length T
    max_bytes: int = 2_000_000  # stop reading files once the corpus has this many bytes
    eval_fraction: float = 0.1  # the last share of the corpus is the eval split
    pattern: str = "*.py"  # file-name glob, matched in every subdirectory

    def __post_init__(self) -> None:
        require(self.block_size > 0, "text block_size", self.block_size, "positive")
        require(self.max_bytes > 0, "text max_bytes", self.max_bytes, "positive")
        require(
            0.0 <= self.eval_fraction < 1.0, "text eval_fraction", self.eval_fraction, "in [0, 1)"
        )


def read_corpus(found: Found, pattern: str, max_bytes: int) -> bytes:
    """Concatenates the files matching `pattern` under `found`, in sorted path order,
    stopping at `max_bytes` (files whose real path leaves the root are never read)."""
    parts: list[bytes] = []
    total = 0
    for path in found.files(pattern):
        try:
            data = path.read_bytes()[: max_bytes - total]
        except OSError:
            continue  # unreadable file: skip it, like a missing one
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(parts)


class TextDataset:
    """Windows of T bytes as int64 (size, T); targets are the windows shifted by one byte."""

    def __init__(self, config: dict[str, Any] | None, seed: int, context: DataContext) -> None:
        cfg = parse_config(TextConfig, config, "dataset 'text'")
        if cfg.path is None:
            found = builtin_corpus()
        else:
            found = context.roots.find(cfg.path, "text dataset path")
            if not found.path.is_dir():
                raise ConfigError(f"text dataset path {cfg.path!r} is not a directory")
        label = "the built-in corpus" if cfg.path is None else repr(cfg.path)
        corpus = read_corpus(found, cfg.pattern, cfg.max_bytes)
        if not corpus:
            raise ConfigError(f"text dataset path {label} has no {cfg.pattern!r} text")
        self.seed, self.block_size = seed, cfg.block_size
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)  # (N,)
        n_eval = int(len(tokens) * cfg.eval_fraction)
        self.data = {"train": tokens[: len(tokens) - n_eval]}
        if n_eval:
            self.data["eval"] = tokens[len(tokens) - n_eval :]
        for split, part in self.data.items():
            if len(part) < cfg.block_size + 1:
                raise ConfigError(f"text {split} split of {label} is shorter than "
                                  f"block_size + 1 = {cfg.block_size + 1} bytes")
        self.splits = tuple(self.data)

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None: evaluation samples the eval split."""
        return None

    def microbatch(
        self, step: int, microbatch: int, size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `size` random windows of `split`."""
        _check_request(self.splits, split, size)
        tokens, t = self.data[split], self.block_size
        gen = sampler(self.seed, step, microbatch, split)
        starts = torch.randint(len(tokens) - t, (size, 1), generator=gen)  # (size, 1)
        windows = tokens[starts + torch.arange(t + 1)].long()  # (size, T + 1)
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class SyntheticConfig:
    """Options of the `synthetic` dataset: random inputs labelled by a seeded teacher."""

    task: Literal["regression", "classification", "tokens"] = "regression"  # target kind
    in_features: int = 64  # input width (regression, classification)
    out_features: int = 10  # target width (regression) or class count (classification)
    vocab_size: int = 256  # token range (tokens)
    block_size: int = 32  # sequence length T (tokens)

    def __post_init__(self) -> None:
        for key in ("in_features", "out_features", "vocab_size", "block_size"):
            require(getattr(self, key) > 0, f"synthetic {key}", getattr(self, key), "positive")


class SyntheticDataset:
    """Gaussian inputs through a random two-layer teacher, or tokens of a random bigram chain."""

    splits: tuple[str, ...] = ("train", "eval")

    def __init__(self, config: dict[str, Any] | None, seed: int,
                 context: DataContext | None = None) -> None:
        self.cfg = parse_config(SyntheticConfig, config, "dataset 'synthetic'")
        self.seed = seed
        gen = torch.Generator().manual_seed(derive_seed(seed, _TEACHER_TAG))
        cfg = self.cfg
        self.w1 = torch.randn(cfg.in_features, cfg.in_features, generator=gen)  # (in, in)
        self.w2 = torch.randn(cfg.in_features, cfg.out_features, generator=gen)  # (in, out)
        self.next_token = torch.randperm(cfg.vocab_size, generator=gen)  # (vocab,)

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None: evaluation samples the eval split."""
        return None

    def microbatch(
        self, step: int, microbatch: int, size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `size` fresh examples of the configured task."""
        _check_request(self.splits, split, size)
        gen = sampler(self.seed, step, microbatch, split)
        if self.cfg.task == "tokens":
            return self._tokens(gen, size)
        x = torch.randn(size, self.cfg.in_features, generator=gen)  # (size, in)
        hidden = torch.tanh(x @ self.w1 / self.cfg.in_features**0.5)  # (size, in)
        y = hidden @ self.w2 / self.cfg.in_features**0.5  # (size, out)
        if self.cfg.task == "classification":
            return x, y.argmax(dim=1)  # (size,) int64
        return x, y

    def _tokens(self, gen: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, vocab = self.cfg.block_size, self.cfg.vocab_size
        noise = torch.randint(vocab, (size, t + 1), generator=gen)  # (size, T + 1)
        follow = torch.rand(size, t + 1, generator=gen) < 0.75  # teacher's bigram or noise
        seq = noise.clone()
        for i in range(1, t + 1):
            seq[:, i] = torch.where(follow[:, i], self.next_token[seq[:, i - 1]], noise[:, i])
        return seq[:, :-1], seq[:, 1:]  # (size, T) int64 each


Builder = Callable[[dict[str, Any], int, DataContext], Dataset]

ENTRY_POINT_GROUP = "pipefb.datasets"
_DATASETS: dict[str, Builder] = {
    "digits": DigitsDataset,
    "text": TextDataset,
    "synthetic": SyntheticDataset,
    "tokens": TokensDataset,
    "arrays": ArraysDataset,
}
DATASETS: tuple[str, ...] = tuple(_DATASETS)


def build_dataset(name: str, config: dict[str, Any] | None, seed: int,
                  context: DataContext | None = None) -> Dataset:
    """Builds dataset `name`; every process with the same arguments samples the same data.

    Args:
        name: one of `DATASETS` or an entry point of group `pipefb.datasets`, which loads
            a callable `(config: dict, seed: int, context: DataContext) -> Dataset`.
        config: JSON-able overrides of the dataset's config defaults.
        seed: the job seed; sampling is deterministic in (seed, step, micro-batch).
        context: what the job and process tell the dataset (data roots, the model's
            block and vocabulary sizes); None: this process's data roots alone.

    Returns:
        A `Dataset`.

    Raises:
        ConfigError: an unknown name, a bad config, a path not readable under the data
            roots (pipefb.job.dataroots), or data that cannot make a sample.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"dataset seed {seed!r} is not an int")
    builder: Builder = find_builder("dataset", name, _DATASETS, ENTRY_POINT_GROUP,
                                    known_datasets())
    try:
        dataset = builder(dict(config or {}), seed, context or DataContext())
    except ConfigError:
        raise
    except Exception as exc:  # a plugin's own failure, as one line
        raise ConfigError(f"dataset {name!r} failed to build: {type(exc).__name__}") from exc
    if not isinstance(dataset, Dataset):
        raise ConfigError(f"dataset {name!r} returned a {type(dataset).__name__}, which has "
                          "no microbatch, held_out and splits")
    return dataset


def known_datasets() -> tuple[str, ...]:
    """The built-in dataset names followed by the installed plugins' names."""
    return DATASETS + tuple(plugin_names(ENTRY_POINT_GROUP, _DATASETS))


def job_context(job: JobConfig, check_all: bool = False) -> DataContext:
    """A job's `DataContext`: this process's data roots, the job's batch size and the
    model's block and vocabulary sizes (`pipefb.models.sequence_sizes`)."""
    from pipefb.models import sequence_sizes

    block_size, vocab_size = sequence_sizes(job.model, job.model_config)
    return DataContext(batch_size=job.batch_size, block_size=block_size,
                       vocab_size=vocab_size, check_all=check_all)


def job_dataset(job: JobConfig, check_all: bool = False) -> Dataset:
    """The job's dataset as every process of the job builds it (`check_all`: at submit,
    check every sample too, e.g. token ids against the model's vocabulary)."""
    return build_dataset(job.dataset, job.dataset_config, job.seed, job_context(job, check_all))


def microbatch_specs(dataset: Dataset, size: int) -> tuple[TensorSpec, TensorSpec]:
    """(inputs, targets) specs of a micro-batch: from the dataset's headers where it knows
    them (`KnowsSpecs`: nothing read), else from micro-batch 0 of step 0."""
    if isinstance(dataset, KnowsSpecs):
        return dataset.specs(size)
    x, y = dataset.microbatch(0, 0, size)
    return spec_of(x), spec_of(y)


__all__ = ["DATASETS", "ENTRY_POINT_GROUP", "DataContext", "Dataset", "build_dataset",
           "job_dataset", "known_datasets", "microbatch_specs", "read_corpus", "sampler"]
