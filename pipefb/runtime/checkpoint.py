"""Checkpoints: what a job needs to go on from a step, written so that a crash leaves either
the old checkpoint or the new one, and read without unpickling anything.

Layout of a checkpoint directory (one per job; by default `checkpoints/{job id}`)::

    step-000006/rank-1.safetensors   # an owner rank's weights and optimizer state
    step-000006/manifest.json        # written last: the checkpoint of step 6 is complete

A rank file holds `layers.{i}.{param}` (the weights of the layers the rank owns) and
`optimizer.{layer}.{param}.{key}` (each parameter's optimizer state tensors); its metadata
holds the optimizer's param groups as JSON, with parameters named instead of numbered,
and an fp16 owner's loss scale and growth tracker (`loss_scale`, JSON; [Note: loss
scaling] in pipefb.runtime.lossscale).
The manifest (`pipefb.runtime.manifest`, [Note: manifests]) holds the job, its identity,
the plan, the step to resume at (every step before it is in the weights) and each rank
file's SHA-256. Every file is written to a temporary name in the same directory, fsynced,
renamed over the final name, and the directory fsynced; a write that fails (a full disk)
raises `FileWriteError` naming the file and leaves no temporary file behind.

Data and random ops are pure functions of (seed, step, micro-batch, layer) (see
`pipefb.seeding`), so the step is the whole data position and RNG state.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pipefb.errors import ConfigError, DiskFullError, FileWriteError

#: One piece of a job's state, as a rank file holds it: (weights `layers.i.p`, optimizer
#: tensors `optimizer.i.p.key`, metadata with the param groups).
Part = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]
OPTIMIZER_PREFIX = "optimizer."  # names of optimizer state tensors in rank files
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1}  # safetensors dtype names


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust I/O errors end
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Digest:
    """A file's SHA-256 (hex) and size in bytes."""

    sha256: str
    size: int


def file_digest(path: Path) -> Digest:
    """SHA-256 and size of a file, read in chunks."""
    with open(path, "rb") as handle:
        sha = hashlib.file_digest(handle, "sha256")
        return Digest(sha.hexdigest(), handle.tell())


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint taken after `step` steps."""
    return root / f"step-{step:06d}"


def rank_file(root: Path, step: int, rank: int) -> Path:
    """One owner rank's file in the checkpoint of `step`."""
    return step_dir(root, step) / f"rank-{rank}.safetensors"


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Calls `write(tmp)` on a temporary file beside `path`, fsyncs it, renames it over
    `path` and fsyncs the directory: a crash leaves the old file or the new one.

    Raises:
        DiskFullError: the disk (or quota) is full; FileWriteError: another write
            failure. Either names the file (its step directory and name) and the cause.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            write(tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except (OSError, SafetensorError) as error:
        raise _write_error(path, error) from None


def _write_error(path: Path, error: Exception) -> FileWriteError:
    """A failed write as one line naming the file; errno from an OSError, or from the
    "(os error N)" that ends a safetensors I/O error."""
    code = error.errno if isinstance(error, OSError) else None
    if code is None and (m := _OS_ERROR.search(str(error))):
        code = int(m.group(1))
    cause = os.strerror(code) if code is not None else str(error)
    kind = DiskFullError if code in _FULL else FileWriteError
    failed = kind(f"cannot write {path.parent.name}/{path.name}: {cause}")
    failed.errno = code or errno.EIO
    return failed


def layer_of(name: str) -> tuple[int, bool]:
    """The layer a rank-file tensor belongs to, and whether it is optimizer state:
    `layers.{i}.{param}` gives (i, False), `optimizer.{i}.{param}.{key}` (i, True).

    Raises:
        ConfigError: a name of neither form.
    """
    state = name.startswith(OPTIMIZER_PREFIX)
    prefix = OPTIMIZER_PREFIX if state else "layers."
    head = name.removeprefix(prefix).split(".", 1)[0]
    if not name.startswith(prefix) or not head.isdigit():
        raise ConfigError(f"tensor {name!r} is neither layers.I.* nor {OPTIMIZER_PREFIX}I.*")
    return int(head), state


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The optimizer's state as named tensors and its param groups as metadata.

    Args:
        optimizer: a torch optimizer over the parameters named by `names`, in order.
        names: `{layer}.{param}` of each parameter, in the optimizer's order.
    """
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{OPTIMIZER_PREFIX}{names[index]}.{key}"] = tensor.detach().cpu().contiguous()
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return tensors, {"param_groups": json.dumps(groups)}


def load_optimizer(optimizer: torch.optim.Optimizer, names: list[str],
                   tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Restores `optimizer_tensors` output into an optimizer over the same parameters.

    Raises:
        ConfigError: the groups name other parameters, or a state tensor belongs to none.
    """
    index = {name: i for i, name in enumerate(names)}
    try:
        groups = json.loads(metadata["param_groups"])
        for g in groups:
            g["params"] = [index[name] for name in g["params"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"checkpoint optimizer groups do not match this rank's "
                          f"parameters: {error}") from None
    for group, current in zip(groups, optimizer.param_groups, strict=False):
        for key, value in group.items():  # JSON made tuples (AdamW's betas) lists
            if isinstance(current.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, field = key[len(OPTIMIZER_PREFIX):].rpartition(".")
        if name not in index:
            raise ConfigError(f"checkpoint optimizer state {key!r} names no parameter here")
        state.setdefault(index[name], {})[field] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def optimizer_share(files: Sequence[tuple[dict[str, torch.Tensor], dict[str, str]]],
                    names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The optimizer state of the parameters `names` gathered from several ranks' files
    (optimizer tensors, metadata), as `load_optimizer` takes it: a rank that now owns
    layers another rank saved (a new partition) gets their state. Every pipefb rank has
    one param group, and all ranks' hyper-parameters are the job's: the first file's
    group is kept, with `names` as its parameters.

    Raises:
        ConfigError: no file has a param group.
    """
    wanted = set(names)
    tensors = {k: v for optim, _ in files for k, v in optim.items()
               if k[len(OPTIMIZER_PREFIX):].rpartition(".")[0] in wanted}
    for _, metadata in files:
        try:
            groups = json.loads(metadata["param_groups"])
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(groups, list) and groups and isinstance(groups[0], dict):
            return tensors, {"param_groups": json.dumps([{**groups[0], "params": names}])}
    raise ConfigError("no checkpoint file holds the optimizer's param group")


def save_rank(path: Path, weights: Mapping[str, torch.Tensor],
              optimizer: torch.optim.Optimizer | None, names: list[str],
              extra_metadata: Mapping[str, str] | None = None) -> Digest:
    """Writes one owner rank's weights and optimizer state (and `extra_metadata`: fp16's
    loss scale) atomically; returns the file's digest, hashed before the rename (what the
    checkpoint's manifest records)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    metadata: dict[str, str] = dict(extra_metadata or {})
    if optimizer is not None:
        extra, groups = optimizer_tensors(optimizer, names)
        tensors.update(extra)
        metadata.update(groups)
    digest: list[Digest] = []

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)
        digest.append(file_digest(tmp))

    write_atomic(path, write)
    return digest[0]


def tensor_bytes(path: Path) -> dict[str, int]:
    """Name -> byte count of every tensor in a rank file, read from its header only.

    Raises:
        ConfigError: the file is missing or not a valid safetensors file.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {k: _nbytes(handle.get_slice(k)) for k in handle.keys()}
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise ConfigError(f"cannot read checkpoint file {str(path)!r}: {error}") from None


def _nbytes(view: Any) -> int:
    count = 1
    for dim in view.get_shape():
        count *= dim
    return count * _ITEMSIZE[view.get_dtype()]


def load_rank(path: Path) -> Part:
    """Reads a rank file: (weights, optimizer tensors, metadata). safetensors checks the
    header's offsets and sizes before it allocates; nothing is unpickled.

    Raises:
        ConfigError: the file is missing or not a valid safetensors file.
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        raise ConfigError(f"cannot read checkpoint file {str(path)!r}: {error}") from None
    return as_part(tensors, metadata)


def as_part(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
            ) -> Part:
    """Rank-file tensors (and metadata) as a `Part`: weights apart from optimizer state."""
    weights = {k: v for k, v in tensors.items() if not k.startswith(OPTIMIZER_PREFIX)}
    optim = {k: v for k, v in tensors.items() if k.startswith(OPTIMIZER_PREFIX)}
    return weights, optim, dict(metadata or {})


def resolve_under(root: str | Path | None, requested: str) -> Path:
    """`requested` as a path inside the process's checkpoint root: a service writes and
    reads checkpoints only where its operator allowed it, whatever a request names.

    Raises:
        PermissionError: no root is configured, or the path leaves it.
    """
    if not root:
        raise PermissionError("this process has no checkpoint root (--checkpoint-root or "
                              "PIPEFB_CHECKPOINT_ROOT); it writes and reads no checkpoints")
    base = Path(root).resolve()
    path = (base / requested).resolve()
    if path != base and base not in path.parents:
        raise PermissionError(f"checkpoint directory {requested!r} is outside the "
                              f"checkpoint root {str(base)!r}")
    return path


def add_root_flag(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint-root` (env PIPEFB_CHECKPOINT_ROOT) of the services."""
    parser.add_argument("--checkpoint-root", default=os.environ.get("PIPEFB_CHECKPOINT_ROOT", ""),
                        help="directory under which jobs may write and read checkpoints "
                             "(default: none, no checkpoints)")


def due(step: int, every: int, steps: int) -> bool:
    """Whether a cadence of `every` steps falls after step `step` (0-based): after every
    `every` steps and after the last; never when `every` is 0. Checkpoints and the groups'
    weight check (`JobConfig.check_groups_every`) keep it."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)
