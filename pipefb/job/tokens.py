"""The `tokens` dataset: memory-mapped flat token shards (nanoGPT's `train.bin` layout).

A shard is a file of little-endian uint16 or uint32 token ids, nothing else. A sample is a
window of `block_size + 1` tokens inside one shard; the windows of a shard start every
`block_size` tokens (they share their last token with the next one's first), its inputs
are the first `block_size` tokens and its targets the last `block_size`. Samples are drawn
in epoch order ([Note: epoch order] in pipefb.job.sampling).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from pipefb.configparse import parse_config, require
from pipefb.errors import ConfigError
from pipefb.job.dataroots import Found
from pipefb.job.sampling import DataContext, EpochOrder, check_request
from pipefb.job.shapes import TensorSpec

_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SCAN_TOKENS = 1 << 24  # tokens per chunk of the submit-time vocabulary scan
_scanned: dict[tuple[str, int, int, str], int] = {}  # shard identity -> its largest token


@dataclass(frozen=True)
class TokensConfig:
    """Options of the `tokens` dataset."""

    path: str = ""  # a shard, or a directory of shards, relative to a data root
    dtype: Literal["uint16", "uint32"] = "uint16"  # token width (nanoGPT writes uint16)
    pattern: str = "*.bin"  # shard file names in a directory (every subdirectory too)
    eval_path: str = ""  # held-out shard(s); "": the last eval_fraction of the windows
    eval_fraction: float = 0.05  # without eval_path: share of the windows held out
    block_size: int = 0  # window length T; 0: the model's block_size

    def __post_init__(self) -> None:
        require(self.block_size >= 0, "tokens block_size", self.block_size, ">= 0")
        require(0.0 <= self.eval_fraction < 1.0, "tokens eval_fraction", self.eval_fraction,
                "in [0, 1)")


class Shards:
    """Windows of T + 1 tokens over memory-mapped shards, numbered shard by shard."""

    def __init__(self, found: Found, cfg: TokensConfig, block_size: int, what: str) -> None:
        self.t, self.dtype = block_size, _DTYPES[cfg.dtype]
        self.files = list(found.files(cfg.pattern))
        if not self.files:
            raise ConfigError(f"{what} has no {cfg.pattern!r} shard")
        self.names = [str(p.relative_to(found.root)) for p in self.files]
        self.maps: list[np.memmap[Any, np.dtype[Any]]] = []
        self.starts = [0]  # first window number of each shard, then the total
        for path, name in zip(self.files, self.names, strict=True):
            nbytes = path.stat().st_size
            if nbytes % self.dtype.itemsize:
                raise ConfigError(f"tokens shard {name!r} is not a whole number of "
                                  f"{cfg.dtype} tokens")
            windows = (nbytes // self.dtype.itemsize - 1) // block_size if nbytes else 0
            if windows < 1:
                raise ConfigError(f"tokens shard {name!r} is shorter than one window of "
                                  f"block_size + 1 = {block_size + 1} tokens")
            self.maps.append(np.memmap(path, dtype=self.dtype, mode="r"))
            self.starts.append(self.starts[-1] + windows)

    @property
    def windows(self) -> int:
        """How many windows the shards hold."""
        return self.starts[-1]

    def read(self, numbers: torch.Tensor) -> torch.Tensor:
        """The windows `numbers` (size,) as int64 (size, T + 1)."""
        rows = []
        for w in numbers.tolist():
            s = bisect.bisect_right(self.starts, w) - 1
            at = (w - self.starts[s]) * self.t
            rows.append(np.asarray(self.maps[s][at:at + self.t + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuses a shard holding a token id >= `vocab_size` (every token read once per
        shard version, in chunks; the result is kept by path, size and mtime)."""
        for path, name, tokens in zip(self.files, self.names, self.maps, strict=True):
            stat = path.stat()
            key = (str(path), stat.st_size, stat.st_mtime_ns, str(self.dtype))
            if key not in _scanned:
                _scanned[key] = max(int(tokens[i:i + _SCAN_TOKENS].max())
                                    for i in range(0, len(tokens), _SCAN_TOKENS))
            if _scanned[key] >= vocab_size:
                raise ConfigError(f"tokens shard {name!r} holds token ids outside the "
                                  f"model's vocabulary (vocab_size {vocab_size})")


class TokensDataset:
    """Windows of token shards: inputs and targets int64 (size, T), targets shifted by one."""

    def __init__(self, config: dict[str, Any] | None, seed: int, context: DataContext) -> None:
        cfg = parse_config(TokensConfig, config, "dataset 'tokens'")
        t = cfg.block_size or context.block_size
        if not t:
            raise ConfigError("dataset 'tokens' needs a block_size: the model declares none")
        if context.block_size and t > context.block_size:
            raise ConfigError(f"tokens block_size {t} is longer than the model's "
                              f"block_size {context.block_size}")
        if not cfg.path:
            raise ConfigError("dataset 'tokens' needs a path (a shard or a directory of "
                              "shards, relative to a data root)")
        self.seed, self.block_size, self.vocab_size = seed, t, context.vocab_size
        train = Shards(context.roots.find(cfg.path, "tokens dataset path"), cfg, t,
                       f"tokens dataset path {cfg.path!r}")
        self.parts: dict[str, tuple[Shards, int, int]] = {}  # split -> shards, first, count
        if cfg.eval_path:
            held = Shards(context.roots.find(cfg.eval_path, "tokens dataset eval_path"), cfg,
                          t, f"tokens dataset eval_path {cfg.eval_path!r}")
            self.parts = {"train": (train, 0, train.windows), "eval": (held, 0, held.windows)}
        else:
            n_eval = int(train.windows * cfg.eval_fraction)
            if train.windows - n_eval < 1:
                raise ConfigError(f"tokens dataset path {cfg.path!r} leaves no training "
                                  f"window after eval_fraction {cfg.eval_fraction}")
            self.parts = {"train": (train, 0, train.windows - n_eval)}
            if n_eval:
                self.parts["eval"] = (train, train.windows - n_eval, n_eval)
        if context.check_all and self.vocab_size:
            for shards, _, _ in self.parts.values():
                shards.check_vocab(self.vocab_size)
        self.splits = tuple(self.parts)
        self.orders = {s: EpochOrder(n, seed, s, context.batch_size)
                       for s, (_, _, n) in self.parts.items()}

    def specs(self, size: int) -> tuple[TensorSpec, TensorSpec]:
        """Inputs and targets (size, T) int64."""
        spec = TensorSpec((size, self.block_size), torch.int64)
        return spec, spec

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None: evaluation samples the eval split."""
        return None

    def microbatch(
        self, step: int, microbatch: int, size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `size` windows of this micro-batch in the split's epoch order."""
        check_request(self.splits, split, size)
        shards, first, _ = self.parts[split]
        windows = shards.read(first + self.orders[split].indices(step, microbatch, size))
        if self.vocab_size and int(windows.max()) >= self.vocab_size:
            raise ConfigError(f"a tokens shard holds token ids outside the model's "
                              f"vocabulary (vocab_size {self.vocab_size})")
        return windows[:, :-1], windows[:, 1:]  # (size, T) each

