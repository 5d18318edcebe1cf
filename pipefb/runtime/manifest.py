"""Checkpoint manifests: what commits a checkpoint, whose it is, and whether it is intact.

[Note: manifests] The coordinator writes `step-NNNNNN/manifest.json` after every owner
rank wrote its file: the step, the job (its whole spec), the job's identity digest, the
plan, and each rank file's SHA-256 and size, as the rank that wrote it hashed it. A step
directory without a manifest is no checkpoint. A checkpoint is *intact* when its manifest
reads whole, names its own step, has the identity of the job that loads it, and every file
it lists has its size and SHA-256. Resume and replay take the newest intact checkpoint and
name each newer one they passed over (`newest_intact`); a worker checks the files it loads
against the same manifest (`verified_files`). The identity is every job field but those a
resumed job may change (`RESUME_MAY_CHANGE`: length, cadences, restarts, ids, where the
checkpoints live): model and its config, dataset, loss, optimizer and learning rate,
seed, batch, micro-batches, schedule, mode, policy, plan option, workers and groups. The
SHA-256 finds torn, truncated and altered files and another job's files copied in; it is
no signature: whoever may write the checkpoint root may write a manifest too.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipefb.errors import ConfigError
from pipefb.runtime.checkpoint import Digest, file_digest, step_dir, write_atomic

MANIFEST = "manifest.json"
FORMAT = 1  # the manifest layout's version; another is refused
_STEP_DIR = re.compile(r"step-(\d{6,})")
_RANK_FILE = re.compile(r"rank-(\d+)\.safetensors")
# job fields a resumed job may set otherwise than the checkpointed one: not its identity
RESUME_MAY_CHANGE = frozenset({"steps", "resume", "job_id", "checkpoint_every", "eval_every",
                               "max_restarts", "slowdown", "check_groups_every",
                               "checkpoint_dir"})


@dataclass(frozen=True)
class Manifest:
    """One committed checkpoint: its step, job spec, identity, plan and files (by name)."""

    step: int
    job: dict[str, Any]
    identity: str
    plan: dict[str, Any]
    files: dict[str, Digest]


def identity(job: Mapping[str, Any]) -> str:
    """The job's identity digest: SHA-256 of its fields a resume must keep, as JSON."""
    kept = {k: v for k, v in job.items() if k not in RESUME_MAY_CHANGE}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(root: Path, step: int, job: Mapping[str, Any], plan: Mapping[str, Any],
                   files: Mapping[str, Digest]) -> Path:
    """Commits the checkpoint of `step`: its manifest, written atomically after every file
    it lists."""
    path = step_dir(root, step) / MANIFEST
    data = {"format": FORMAT, "step": step, "identity": identity(job), "job": dict(job),
            "plan": dict(plan),
            "files": {n: {"sha256": d.sha256, "bytes": d.size} for n, d in sorted(files.items())}}
    text = json.dumps(data, indent=2) + "\n"

    def write(tmp: Path) -> None:
        tmp.write_text(text)

    write_atomic(path, write)
    return path


def read_manifest(root: Path, step: int) -> Manifest:
    """The manifest of the checkpoint of `step`.

    Raises:
        ConfigError: it is missing, not JSON, of another format or step, or malformed.
    """
    path = step_dir(root, step) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"step {step}: no manifest (never committed)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"step {step}: unreadable manifest ({error})") from None
    try:
        if data["format"] != FORMAT or data["step"] != step:
            raise ValueError(f"format {data['format']!r} step {data['step']!r}")
        files = {str(n): Digest(str(f["sha256"]), int(f["bytes"]))
                 for n, f in data["files"].items()}
        manifest = Manifest(step, dict(data["job"]), str(data["identity"]), dict(data["plan"]),
                            files)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ConfigError(f"step {step}: malformed manifest ({error})") from None
    if any(not _RANK_FILE.fullmatch(n) for n in files):
        raise ConfigError(f"step {step}: the manifest lists a file that is no rank file")
    return manifest


def check_owner(manifest: Manifest, job: Mapping[str, Any]) -> None:
    """Refuses a checkpoint of another job, naming the first field that differs.

    Raises:
        ConfigError: the manifest's identity or job differs from `job`'s.
    """
    for key in sorted(set(manifest.job) | set(job)):
        if key not in RESUME_MAY_CHANGE and manifest.job.get(key) != job.get(key):
            raise ConfigError(f"step {manifest.step} is of another job: {key} "
                              f"{manifest.job.get(key)!r} there, {job.get(key)!r} here")
    if manifest.identity != identity(job) or identity(manifest.job) != manifest.identity:
        raise ConfigError(f"step {manifest.step} is of another job: its identity differs")


def check_file(root: Path, manifest: Manifest, name: str) -> Path:
    """The path of one file the manifest lists, after checking its size and SHA-256.

    Raises:
        ConfigError: the file is missing, of another size (truncated or grown), or of
            another SHA-256 (torn, altered or another job's).
    """
    want = manifest.files[name]
    path = step_dir(root, manifest.step) / name
    try:
        got = file_digest(path)
    except OSError as error:
        raise ConfigError(f"step {manifest.step}: {name} is unreadable "
                          f"({error.strerror})") from None
    if got.size != want.size:
        raise ConfigError(f"step {manifest.step}: {name} has {got.size} bytes, its "
                          f"manifest says {want.size} (truncated or torn)")
    if got.sha256 != want.sha256:
        raise ConfigError(f"step {manifest.step}: {name} does not match the SHA-256 in its "
                          "manifest (altered or torn)")
    return path


def verified(root: Path, step: int, job: Mapping[str, Any]) -> Manifest:
    """The checkpoint of `step` if it is intact for `job` ([Note: manifests]).

    Raises:
        ConfigError: why it is not: no or a malformed manifest, another job's, a file
            missing, truncated or altered (the message starts with the step).
    """
    manifest = read_manifest(root, step)
    check_owner(manifest, job)
    for name in manifest.files:
        check_file(root, manifest, name)
    return manifest


def verified_files(root: Path, step: int, job: Mapping[str, Any]) -> dict[int, Path]:
    """Rank -> file of the checkpoint of `step`, each checked against its manifest, for
    a rank that resumes from it.

    Raises:
        ConfigError: the checkpoint is not intact for `job` (`verified`).
    """
    manifest = verified(root, step, job)
    return {int(m.group(1)): step_dir(root, step) / name for name in manifest.files
            if (m := _RANK_FILE.fullmatch(name))}


def steps(root: Path, at_most: int | None = None) -> list[int]:
    """The steps of the step directories under `root`, newest first (those <= `at_most`)."""
    found = (int(m.group(1)) for p in root.glob("step-*") if (m := _STEP_DIR.fullmatch(p.name))
             and p.is_dir())
    return sorted((s for s in found if at_most is None or s <= at_most), reverse=True)


def newest_intact(root: Path, job: Mapping[str, Any], at_most: int | None = None
                  ) -> tuple[Manifest | None, list[str]]:
    """The newest checkpoint under `root` that is intact for `job` (of a step <=
    `at_most`, when given), and why each newer step directory was passed over."""
    refused: list[str] = []
    for step in steps(root, at_most):
        try:
            return verified(root, step, job), refused
        except ConfigError as error:
            refused.append(str(error))
    return None, refused


def committed(root: Path) -> list[Manifest]:
    """Every readable manifest under `root`, newest first, without checking files."""
    out = []
    for step in steps(root):
        try:
            out.append(read_manifest(root, step))
        except ConfigError:
            continue
    return out
