"""The `arrays` dataset: samples as rows of memory-mapped arrays of inputs and targets.

A directory (relative to a data root) holds either `inputs.npy` and `targets.npy`, or
`train.safetensors` with tensors `inputs` and `targets`; row i of each is sample i. A
held-out split comes from `eval_inputs.npy` and `eval_targets.npy` or `eval.safetensors`
beside them, else from the last `eval_fraction` of the rows. Nothing is unpickled: `.npy`
files load with `allow_pickle=False` (an object array is refused) and safetensors holds
plain tensors. Samples are drawn in epoch order ([Note: epoch order] in
pipefb.job.sampling).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from pipefb.configparse import parse_config, require
from pipefb.errors import ConfigError
from pipefb.job.dataroots import Found, inside
from pipefb.job.sampling import DataContext, EpochOrder, check_request
from pipefb.job.shapes import TensorSpec

# the element types a sample may have, as numpy and safetensors name them
_NUMPY = {np.dtype(k): v for k, v in {
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool}.items()}
_SAFETENSORS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                "F64": torch.float64, "I8": torch.int8, "I16": torch.int16,
                "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}
_LAYOUTS = {"train": (("inputs.npy", "targets.npy"), "train.safetensors"),
            "eval": (("eval_inputs.npy", "eval_targets.npy"), "eval.safetensors")}


@dataclass(frozen=True)
class ArraysConfig:
    """Options of the `arrays` dataset."""

    path: str = ""  # the directory of the files, relative to a data root
    eval_fraction: float = 0.1  # without eval files: share of the rows held out

    def __post_init__(self) -> None:
        require(0.0 <= self.eval_fraction < 1.0, "arrays eval_fraction", self.eval_fraction,
                "in [0, 1)")


class Column:
    """One array of samples (rows), memory-mapped; reads only the rows asked for."""

    def __init__(self, rows: Any, shape: tuple[int, ...], dtype: torch.dtype,
                 numpy: bool) -> None:
        self.rows, self.shape, self.dtype, self.numpy = rows, shape, dtype, numpy

    def read(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (size,) as one tensor (size, ...)."""
        if self.numpy:
            return torch.from_numpy(np.ascontiguousarray(self.rows[index.numpy()]))
        return torch.cat([self.rows[i:i + 1] for i in index.tolist()])


def _npy(path: Path, name: str) -> Column:
    try:
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        raise ConfigError(f"arrays file {name!r} is not a .npy array of numbers") from None
    if rows.dtype not in _NUMPY or rows.ndim < 1:
        raise ConfigError(f"arrays file {name!r} is not an array of samples of one of "
                          f"{sorted(str(d) for d in _NUMPY)}")
    return Column(rows, tuple(rows.shape), _NUMPY[rows.dtype], True)


def _safetensors(path: Path, name: str) -> tuple[Column, Column]:
    try:
        handle = safe_open(str(path), framework="pt")
        names = handle.keys()  # type: ignore[no-untyped-call]
        slices = {k: handle.get_slice(k)  # type: ignore[no-untyped-call]
                  for k in ("inputs", "targets") if k in names}
    except (OSError, SafetensorError):
        raise ConfigError(f"arrays file {name!r} is not a safetensors file") from None
    if len(slices) != 2:
        raise ConfigError(f"arrays file {name!r} lacks a tensor named inputs or targets")
    columns = []
    for key, rows in slices.items():
        shape, dtype = tuple(rows.get_shape()), _SAFETENSORS.get(rows.get_dtype())
        if dtype is None or not shape:
            raise ConfigError(f"arrays file {name!r}: {key} is not a tensor of samples of "
                              f"one of {sorted(_SAFETENSORS)}")
        columns.append(Column(rows, shape, dtype, False))
    return columns[0], columns[1]


def _file(found: Found, name: str) -> Path | None:
    """`name` in the folder as a real path, if it is a regular file inside the root (a
    link out of the root counts as absent: [Note: data access] in pipefb.job.dataroots)."""
    real = Path(os.path.realpath(found.path / name))
    return real if inside(found.root, real) and real.is_file() else None


def _split(found: Found, split: str, label: str) -> tuple[Column, Column] | None:
    """The split's (inputs, targets) columns, or None when the folder has no files of it."""
    (inputs, targets), packed = _LAYOUTS[split]
    x, y, both = _file(found, inputs), _file(found, targets), _file(found, packed)
    if x is not None and y is not None:
        pair = _npy(x, inputs), _npy(y, targets)
    elif both is not None:
        pair = _safetensors(both, packed)
    else:
        return None
    if pair[0].shape[0] != pair[1].shape[0] or pair[0].shape[0] < 1:
        raise ConfigError(f"arrays dataset path {label!r}: the {split} inputs and targets "
                          "do not hold the same number of samples (at least one)")
    return pair


class ArraysDataset:
    """Rows of an inputs array and a targets array, in the files' dtypes."""

    def __init__(self, config: dict[str, Any] | None, seed: int, context: DataContext) -> None:
        cfg = parse_config(ArraysConfig, config, "dataset 'arrays'")
        if not cfg.path:
            raise ConfigError("dataset 'arrays' needs a path (a directory relative to a "
                              "data root)")
        found = context.roots.find(cfg.path, "arrays dataset path")
        if not found.path.is_dir():
            raise ConfigError(f"arrays dataset path {cfg.path!r} is not a directory")
        train = _split(found, "train", cfg.path)
        if train is None:
            raise ConfigError(f"arrays dataset path {cfg.path!r} holds neither inputs.npy "
                              "and targets.npy nor train.safetensors")
        n = train[0].shape[0]
        held = _split(found, "eval", cfg.path)
        self.parts: dict[str, tuple[tuple[Column, Column], int, int]] = {}
        if held is not None:
            for a, b in zip(train, held, strict=True):
                if (a.shape[1:], a.dtype) != (b.shape[1:], b.dtype):
                    raise ConfigError(f"arrays dataset path {cfg.path!r}: eval samples "
                                      "differ in shape or dtype from the training samples")
            self.parts = {"train": (train, 0, n), "eval": (held, 0, held[0].shape[0])}
        else:
            n_eval = int(n * cfg.eval_fraction)
            if n - n_eval < 1:
                raise ConfigError(f"arrays dataset path {cfg.path!r} leaves no training "
                                  f"sample after eval_fraction {cfg.eval_fraction}")
            self.parts = {"train": (train, 0, n - n_eval)}
            if n_eval:
                self.parts["eval"] = (train, n - n_eval, n_eval)
        self.columns = train
        self.splits = tuple(self.parts)
        self.orders = {s: EpochOrder(count, seed, s, context.batch_size)
                       for s, (_, _, count) in self.parts.items()}

    def specs(self, size: int) -> tuple[TensorSpec, TensorSpec]:
        """Inputs and targets of `size` rows, from the files' headers."""
        x, y = self.columns
        return TensorSpec((size, *x.shape[1:]), x.dtype), TensorSpec((size, *y.shape[1:]),
                                                                     y.dtype)

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None: evaluation samples the eval split in its epoch order."""
        return None

    def microbatch(
        self, step: int, microbatch: int, size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `size` rows of this micro-batch in the split's epoch order."""
        check_request(self.splits, split, size)
        (inputs, targets), first, _ = self.parts[split]
        index = first + self.orders[split].indices(step, microbatch, size)
        return inputs.read(index), targets.read(index)
