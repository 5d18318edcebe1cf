"""Datasets by name, sampled deterministically in (seed, step, micro-batch) on any worker."""

from __future__ import annotations

import fnmatch
import functools
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from pipefb.configparse import parse_config, require
from pipefb.errors import ConfigError
from pipefb.seeding import derive_seed

_SPLIT_CODES = {"train": 0, "eval": 1}  # folded into the sampling seed of non-train splits
_DIGITS_SPLIT_SEED = 0x5EED_D161  # fixes the digits train/eval split for every job seed
_TEACHER_TAG = 0x7EAC  # separates the synthetic teacher's seed from sampling seeds


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


def sampler(seed: int, step: int, microbatch: int, split: str) -> torch.Generator:
    """Returns the CPU generator of one micro-batch of `split`.

    It is seeded with `derive_seed(seed, step, microbatch)` for "train" and with the split's
    code appended for the other splits, so eval draws differ from train draws.
    """
    parts: tuple[int, ...] = (seed, step, microbatch)
    if split != "train":
        parts += (_SPLIT_CODES[split],)
    return torch.Generator().manual_seed(derive_seed(*parts))


def _check_request(splits: tuple[str, ...], split: str, size: int) -> None:
    if split not in splits:
        raise ConfigError(f"unknown split {split!r}; this dataset has {list(splits)}")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"micro-batch size {size!r} must be a positive int")


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

    def __init__(self, config: dict[str, Any] | None, seed: int) -> None:
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

    path: str | None = None  # directory to read; None = this Python's standard library
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


def _walk_sorted(root: Path, pattern: str) -> Iterator[Path]:
    """Yields files matching `pattern` under `root`, lazily, in sorted path order."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk_sorted(Path(entry.path), pattern)
        elif entry.is_file() and fnmatch.fnmatchcase(entry.name, pattern):
            yield Path(entry.path)


def read_corpus(root: Path, pattern: str, max_bytes: int) -> bytes:
    """Concatenates matching files in sorted order, stopping at `max_bytes`."""
    parts: list[bytes] = []
    total = 0
    for path in _walk_sorted(root, pattern):
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

    def __init__(self, config: dict[str, Any] | None, seed: int) -> None:
        cfg = parse_config(TextConfig, config, "dataset 'text'")
        root = Path(cfg.path if cfg.path is not None else sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise ConfigError(f"text dataset path {str(root)!r} is not a directory")
        corpus = read_corpus(root, cfg.pattern, cfg.max_bytes)
        if not corpus:
            raise ConfigError(f"text dataset path {str(root)!r} has no {cfg.pattern!r} text")
        self.seed, self.block_size = seed, cfg.block_size
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)  # (N,)
        n_eval = int(len(tokens) * cfg.eval_fraction)
        self.data = {"train": tokens[: len(tokens) - n_eval]}
        if n_eval:
            self.data["eval"] = tokens[len(tokens) - n_eval :]
        for split, part in self.data.items():
            if len(part) < cfg.block_size + 1:
                raise ConfigError(
                    f"text {split} split of {str(root)!r} has {len(part)} bytes, "
                    f"fewer than block_size + 1 = {cfg.block_size + 1}"
                )
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

    def __init__(self, config: dict[str, Any] | None, seed: int) -> None:
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


_DATASETS: dict[str, Callable[[dict[str, Any] | None, int], Dataset]] = {
    "digits": DigitsDataset,
    "text": TextDataset,
    "synthetic": SyntheticDataset,
}
DATASETS: tuple[str, ...] = tuple(_DATASETS)


def build_dataset(name: str, config: dict[str, Any] | None, seed: int) -> Dataset:
    """Builds dataset `name`; every process with the same arguments samples the same data.

    Args:
        name: one of `DATASETS`.
        config: JSON-able overrides of the dataset's config defaults.
        seed: the job seed; sampling is deterministic in (seed, step, micro-batch).

    Returns:
        A `Dataset`.

    Raises:
        ConfigError: an unknown name, a bad config, or a missing or empty text corpus.
    """
    if name not in _DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; known datasets: {list(DATASETS)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"dataset seed {seed!r} is not an int")
    return _DATASETS[name](config, seed)
