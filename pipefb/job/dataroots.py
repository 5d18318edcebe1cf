"""Data roots: the only directories a dataset reads, set by the operator of a process.

A job names its data by paths relative to a data root; the process resolves them here.
[Note: data access] What a request may name is refused with one message whatever the
reason: an absolute path, a `..` part, a link whose target leaves the root and a path
that does not exist all read "not readable under the data roots", so a submitter learns
nothing of the files around the roots, and no error carries a file's content or size.
Directory walks skip every entry whose real path leaves its root. The roots are the
services' `--data-root` (env PIPEFB_DATA_ROOT, several joined by the OS path separator);
a process that sets none reads no files but the default text corpus (this Python's
standard library, `BUILTIN_CORPUS`).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pipefb.errors import ConfigError

ENV = "PIPEFB_DATA_ROOT"  # the services' data roots, joined by os.pathsep
LOCAL_DATA_DIR = "data"  # `pipefb local`'s default root: this folder of the working directory
BUILTIN_CORPUS = Path(sysconfig.get_paths()["stdlib"])  # the default text corpus


class DataAccessError(ConfigError):
    """A dataset path that is not readable under the data roots ([Note: data access])."""

    def __init__(self, what: str, requested: object) -> None:
        super().__init__(
            f"{what} {requested!r} is not readable under the data roots (a path relative "
            "to a data root the services were given with --data-root; absolute paths, "
            "'..' and links out of the root are refused)")


@dataclass(frozen=True)
class Found:
    """A file or directory resolved inside a root: its real path and that root's."""

    root: Path
    path: Path

    def files(self, pattern: str) -> Iterator[Path]:
        """Regular files under `path` matching the name glob `pattern`, in sorted path
        order, lazily; entries whose real path leaves the root are skipped."""
        if self.path.is_file():
            yield self.path
            return
        yield from _walk(self.root, self.path, pattern)


def _walk(root: Path, folder: Path, pattern: str) -> Iterator[Path]:
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        real = Path(os.path.realpath(entry.path))
        if not inside(root, real):
            continue
        if real.is_dir():
            if not entry.is_symlink():  # a link to a folder of the root is walked there
                yield from _walk(root, real, pattern)
        elif real.is_file() and fnmatch.fnmatchcase(entry.name, pattern):
            yield real


def inside(root: Path, path: Path) -> bool:
    """Whether the real path `path` is `root` or below it."""
    return path == root or root in path.parents


@dataclass(frozen=True)
class DataRoots:
    """The directories datasets may read, as real paths; empty: none."""

    paths: tuple[Path, ...] = ()

    @classmethod
    def parse(cls, text: str) -> DataRoots:
        """Roots from `--data-root` / PIPEFB_DATA_ROOT: paths joined by os.pathsep; a root
        that does not exist is kept (a volume may be mounted later) and matches nothing."""
        parts = [p for p in text.split(os.pathsep) if p.strip()]
        return cls(tuple(Path(os.path.realpath(os.path.expanduser(p))) for p in parts))

    def find(self, requested: object, what: str) -> Found:
        """Resolves a dataset path inside the first root that holds it.

        Args:
            requested: the path a job names, relative to a root.
            what: what names it, for the error (e.g. "tokens dataset path").

        Raises:
            DataAccessError: the same one line for a path that is not a relative path of
                plain parts, leaves every root, or is missing ([Note: data access]).
        """
        if not isinstance(requested, str) or not _plain_relative(requested):
            raise DataAccessError(what, requested)
        for root in self.paths:
            real = Path(os.path.realpath(root / requested))
            if inside(root, real) and (real.is_file() or real.is_dir()):
                return Found(root, real)
        raise DataAccessError(what, requested)


def _plain_relative(text: str) -> bool:
    """A non-empty relative path without `..`, NUL or a leading `~`."""
    if not text or "\0" in text or text.startswith("~") or "\\" in text:
        return False
    path = PurePosixPath(text)
    return not path.is_absolute() and ".." not in path.parts


def builtin_corpus() -> Found:
    """The default text corpus, a root of its own that no job path reaches."""
    root = Path(os.path.realpath(BUILTIN_CORPUS))
    return Found(root, root)


_configured: DataRoots | None = None


def configure(roots: DataRoots) -> None:
    """Sets this process's data roots (a service's `--data-root`, the local CLI's default)."""
    global _configured
    _configured = roots


def current() -> DataRoots:
    """This process's data roots: those configured, else PIPEFB_DATA_ROOT, else none."""
    if _configured is not None:
        return _configured
    return DataRoots.parse(os.environ.get(ENV, ""))


def local_default() -> str:
    """`pipefb local`'s roots when PIPEFB_DATA_ROOT is unset: ./data of the working
    directory."""
    return os.environ.get(ENV) or str(Path.cwd() / LOCAL_DATA_DIR)


def add_data_root_flag(parser: argparse.ArgumentParser) -> None:
    """`--data-root` of the services; read it back with `configure_from_args`."""
    parser.add_argument("--data-root", default=os.environ.get(ENV, ""),
                        help="directories datasets may read, joined by "
                             f"{os.pathsep!r}; job paths are relative to them (default "
                             "PIPEFB_DATA_ROOT; none: only the built-in text corpus)")


def configure_from_args(args: argparse.Namespace) -> DataRoots:
    """Configures this process's roots from `--data-root` and returns them."""
    roots = DataRoots.parse(args.data_root)
    configure(roots)
    return roots
