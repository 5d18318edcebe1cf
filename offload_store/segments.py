"""Shared-memory segments of the node-local tier: one file per layer of a micro-batch's
stash in a tmpfs directory, written with one copy and taken back with none (`lend`) or
one (`read`).

[Note: segment layout] A segment is ``MAGIC``, the header's length (u64, little-endian),
a JSON header listing each tensor's layer, name, dtype, shape, offset and byte count, then
the tensors' bytes, each at an offset aligned to `ALIGN` (so the views a reader makes are
aligned for every dtype). A reader trusts nothing of it: the file must be a regular file
of this user (no symlink), of the size its index entry names, with a header that parses,
names exactly the tensors asked for, and places every tensor inside the file after the
header; each tensor's dtype and shape pass the codec's header check (the header is read
with bounded `pread`s, nothing is mapped before it passed). Only then does each tensor
view its bytes in a private mapping of the file (`lend`, no copy, [Note: segment
mappings] in `offload_store.mapped`) or get them read into a new tensor (`read`, one
copy, `os.preadv` straight into its memory).

[Note: spare segments] A read segment's file is not unlinked but renamed to a spare in
its directory (a lent one, ``lent-<segment name>``, once its consumer's tensors are gone),
and the directory's producer writes its next segment of the same size into a spare
(`write` claims one by renaming it), so a stash is copied into tmpfs pages that already
exist, mapped in the producer, instead of pages the kernel must allocate and zero, and
freed again, on every micro-batch (a training step's stashes repeat the same sizes; a
size no spare has gets a new file). Spares and lent files count toward the tier's cap; a
write that would pass it removes the tier's spares first, and a worker's spares go when
it drops the job. A lent file whose consumer died stays until its job
is cleared, as a segment does ([Note: tier leases] in `offload_store.shm`).

[Note: tier directory] ``<base>/<job>+<token>/`` holds a producer's segments of one job
(`job_dir`): the base directory is this user's alone (0700) and the token is random, so
only the job's ranks, which read segment paths from the job's own index keys, find them.
``+`` is no job id character, so ``<job>+*`` matches one job's directories only.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import stat
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from offload_store.mapped import SegmentMaps
from pipefb.codec import DTYPES, check_header, raw_view
from pipefb.errors import CodecError

MAGIC = b"PFBSEG01"
_LENGTH = struct.Struct("<Q")
ALIGN = 64  # bytes: every tensor's data starts at a multiple of this
MAX_HEADER_BYTES = 1 << 20  # a header longer than this is refused before it is read
SUFFIX = ".seg"
OFFSET_BYTES = 40  # the most bytes ``, "offset": N`` adds to one header entry
NODE_FILE = "node-id"  # the base directory's id: directories with the same id are one tier
SPARE_PREFIX = "spare-"  # a read segment's file, kept for the directory's next write
LENT_PREFIX = "lent-"  # a taken segment's file while its consumer's tensors view it
OWN_PREFIX = "own-"  # a private store's slot file ([Note: own slots] in offload_store.ownslots)
LOCK_FILE = "lock"  # flock'ed while a producer checks the cap and reserves its segment
_SEGMENT_NAME = re.compile(r"(\d+)-\d+-\d+-\d+-\d+-[0-9a-f]+\.seg")
_OWN_NAME = re.compile(r"own-(\d+)-[0-9a-f]+\.seg")
_DIR_NAME = re.compile(r"[A-Za-z0-9_.-]+\+[0-9a-f]{32}")

LayerTensors = dict[int, dict[str, torch.Tensor]]
Checked = tuple[str, list[int], int, int]  # a tensor's dtype, shape, offset and byte count
# Headers that passed `_entries`' checks, by (header bytes, file size, names asked for): a
# rank's stashes repeat a few headers, so each is parsed and checked once (at most
# `CHECKED_HEADERS` kept; the callers only read the result)
CHECKED_HEADERS = 256
_CHECKED_HEADERS: dict[tuple[bytes, int, frozenset[tuple[int, str]]],
                       dict[int, dict[str, Checked]]] = {}


class SegmentError(CodecError):
    """A segment that fails validation (tampered, truncated, foreign); names the file."""


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def layout(tensors: Mapping[int, Mapping[str, torch.Tensor]]
           ) -> tuple[bytes, list[tuple[int, memoryview]], int]:
    """Plans a segment (see [Note: segment layout]).

    Returns:
        The bytes before the data (magic, length, header, padding), each tensor's
        (offset, data view), and the segment's total size.

    Raises:
        CodecError: a dtype the codec does not allow.
    """
    signature, views = [], []
    for layer, named in tensors.items():
        for name, tensor in named.items():
            dtype, shape, view = raw_view(tensor)
            signature.append((layer, name, dtype, shape, view.nbytes))
            views.append(view)
    head, offsets, size = _planned(tuple(signature))
    return head, list(zip(offsets, views, strict=True)), size


@functools.lru_cache(maxsize=64)  # a rank's stashes repeat a few signatures, step after step
def _planned(signature: tuple[tuple[int, str, str, tuple[int, ...], int], ...]
             ) -> tuple[bytes, tuple[int, ...], int]:
    """The head bytes, each tensor's offset and the total size of a segment of tensors
    with this (layer, name, dtype, shape, byte count) each, in order."""
    entries = [{"layer": layer, "name": name, "dtype": dtype, "shape": list(shape),
                "nbytes": nbytes} for layer, name, dtype, shape, nbytes in signature]
    text = json.dumps(entries).encode()
    # each entry's offset adds at most `OFFSET_BYTES` to the header once it is written
    offset = aligned(len(MAGIC) + _LENGTH.size + len(text) + OFFSET_BYTES * len(entries))
    offsets = []
    for entry, (*_, nbytes) in zip(entries, signature, strict=True):
        entry["offset"] = offset
        offsets.append(offset)
        offset = aligned(offset + nbytes)
    header = json.dumps(entries).encode()
    head = MAGIC + _LENGTH.pack(len(header)) + header
    assert not offsets or len(head) <= offsets[0]
    return head, tuple(offsets), max(offset, len(head))


def write(path: Path, tensors: Mapping[int, Mapping[str, torch.Tensor]], cap_bytes: int,
          maps: SegmentMaps | None = None) -> int | None:
    """Writes a segment at `path` (mode 0600, never over an existing file), copying each
    tensor's bytes once, into a spare file of the same directory where there is one
    ([Note: spare segments]), if the tier under ``path.parent.parent`` stays within
    `cap_bytes` with it; a failed write removes it. With `maps`, a spare's bytes are
    copied through its kept mapping ([Note: segment mappings]); a new file's (whose pages
    the write allocates, which `pwrite` does faster than faults do) are written with
    `pwrite`, as without `maps`.

    Returns:
        The segment's size; None when it would pass the cap (nothing is written).

    Raises:
        FileNotFoundError: the job's directory is gone (a clear of the job removed it).
        CodecError: a dtype the codec does not allow.
    """
    head, placed, size = layout(tensors)
    base = path.parent.parent
    with open(base / LOCK_FILE, "a") as lock:  # the check and the reservation are one step
        fcntl.flock(lock, fcntl.LOCK_EX)
        used, spare = used_bytes(base), _claim_spare(path, size)
        if used - spare + size > cap_bytes:
            used -= drop_spares(base, "*+*/")
            if used + size > cap_bytes:
                path.unlink(missing_ok=True)
                return None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                     | (0 if path.exists() else os.O_EXCL), 0o600)
        try:
            os.ftruncate(fd, size)  # counts in `used_bytes` from here on
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
    try:
        if maps is not None and spare:
            maps.copy_into(fd, size, [(0, memoryview(bytearray(head))), *placed])
        else:
            _pwrite_all(fd, memoryview(head), 0)
            for offset, view in placed:
                _pwrite_all(fd, view, offset)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return size


def _claim_spare(path: Path, size: int) -> int:
    """Renames a spare file of `size` bytes in `path`'s directory to `path` (its pages,
    and the mappings of it, are reused as they are: resizing a file costs its mappings);
    returns its size (0: none)."""
    for spare in path.parent.glob(f"{SPARE_PREFIX}*{SUFFIX}"):
        try:
            if spare.stat().st_size != size:
                continue
            os.rename(spare, path)
        except FileNotFoundError:  # taken or cleared meanwhile
            continue
        return size
    return 0


def drop_spares(folder: Path, pattern: str = "") -> int:
    """Removes the spare files in `folder` (with `pattern` ``*+*/``: in every job
    directory under it); returns their bytes."""
    freed = 0
    for spare in folder.glob(f"{pattern}{SPARE_PREFIX}*{SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            freed += spare.stat().st_size
            spare.unlink()
    return freed


def segment_size(tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int:
    """The size `write` gives the segment of these tensors."""
    return layout(tensors)[2]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    view = view.cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def read(path: Path, size: int, names: Mapping[int, Sequence[str]]) -> LayerTensors:
    """Reads the segment at `path` into new tensors (one copy each), after checking it
    (see [Note: segment layout]), and gives the file back to its directory's spares.

    Args:
        path: the segment, named by its index entry.
        size: the segment's size, as its index entry names it.
        names: layer -> tensor names to return; the segment must hold exactly these.

    Raises:
        SegmentError: a segment that fails a check; it is unlinked.
        FileNotFoundError: no segment at `path`.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        _check_file(path, fd, size)
        out = {layer: {name: _read_tensor(path, fd, *checked) for name, checked in named.items()}
               for layer, named in _entries(path, fd, size, names).items()}
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    _give_back(path)
    return out


def lend(path: Path, size: int, names: Mapping[int, Sequence[str]], maps: SegmentMaps
         ) -> LayerTensors:
    """The tensors of the segment at `path` viewing its mapping in `maps` (no copy), after
    the same checks as `read`; the file is lent to them (renamed ``lent-...``) and becomes
    a spare of its directory once none is left ([Note: segment mappings]). The tensors are
    writable, and nobody else reads or writes their bytes while they live.

    Raises:
        SegmentError: a segment that fails a check; it is unlinked.
        FileNotFoundError: no segment at `path`.
    """
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    lent = path.with_name(f"{LENT_PREFIX}{path.name}")
    try:
        _check_file(path, fd, size)
        entries = _entries(path, fd, size, names)
        os.rename(path, lent)  # the index key is gone: no one else names this file
        data = maps.view(fd, size, lambda: _give_back(lent))  # (size,) uint8
        out: LayerTensors = {}
        for layer, named in entries.items():
            for name, (dtype, shape, offset, nbytes) in named.items():
                tensor = data[offset:offset + nbytes].view(DTYPES[dtype]).view(shape)
                _check_bool(path, dtype, tensor)
                out.setdefault(layer, {})[name] = tensor
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        lent.unlink(missing_ok=True)
        raise
    os.close(fd)
    return out


def _give_back(path: Path) -> None:
    """Renames a read segment's file to a spare of its directory ([Note: spare
    segments]); removes it where that fails (its directory was cleared)."""
    try:
        os.rename(path, path.with_name(f"{SPARE_PREFIX}{secrets.token_hex(8)}{SUFFIX}"))
    except OSError:
        path.unlink(missing_ok=True)


def _check_file(path: Path, fd: int, size: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise SegmentError(f"segment {path} is not a regular file of this user")
    if info.st_size != size:
        raise SegmentError(f"segment {path} holds {info.st_size} bytes; its index "
                           f"entry says {size}")


def _entries(path: Path, fd: int, size: int, names: Mapping[int, Sequence[str]]
             ) -> dict[int, dict[str, Checked]]:
    """The segment's header, checked: layer -> name -> where its tensor lies."""
    start = len(MAGIC) + _LENGTH.size
    if size < start:
        raise SegmentError(f"segment {path} of {size} bytes is shorter than its header")
    lead = os.pread(fd, start, 0)
    if lead[:len(MAGIC)] != MAGIC:
        raise SegmentError(f"segment {path} does not start with {MAGIC!r}")
    (length,) = _LENGTH.unpack_from(lead, len(MAGIC))
    if length > min(MAX_HEADER_BYTES, size - start):
        raise SegmentError(f"segment {path}: header of {length} bytes does not fit")
    header = os.pread(fd, length, start)
    want = {(int(i), str(n)) for i, ns in names.items() for n in ns}
    key = (header, size, frozenset(want))
    known = _CHECKED_HEADERS.get(key)
    if known is not None:  # these very bytes passed every check below before
        return known
    try:
        entries = json.loads(header)
        found = {(e["layer"], e["name"]) for e in entries}
    except (ValueError, TypeError, KeyError) as error:
        raise SegmentError(f"segment {path}: header does not parse: {error}") from None
    if found != want or len(entries) != len(want):
        raise SegmentError(f"segment {path} holds {sorted(found)}, not {sorted(want)}")
    out: dict[int, dict[str, Checked]] = {}
    for entry in entries:
        out.setdefault(entry["layer"], {})[entry["name"]] = _checked(path, size, entry,
                                                                     start + length)
    if len(_CHECKED_HEADERS) >= CHECKED_HEADERS:
        _CHECKED_HEADERS.clear()
    _CHECKED_HEADERS[key] = out
    return out


def _checked(path: Path, size: int, entry: dict[str, object], data_start: int) -> Checked:
    """One tensor's header entry, checked against the codec and the file's bounds."""
    dtype, shape, offset, nbytes = (entry.get(k) for k in ("dtype", "shape", "offset",
                                                            "nbytes"))
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in (offset, nbytes)):
        raise SegmentError(f"segment {path}: a bad entry {entry}")
    assert isinstance(offset, int) and isinstance(nbytes, int)
    try:
        expected = check_header(dtype, shape, size)
    except CodecError as error:
        raise SegmentError(f"segment {path}: {error}") from None
    if nbytes != expected or offset % ALIGN or offset < data_start or offset + nbytes > size:
        raise SegmentError(f"segment {path}: tensor {entry.get('name')!r} of {nbytes} bytes "
                           f"at {offset} lies outside the data of a {size}-byte file")
    return dtype, shape, offset, nbytes


def _read_tensor(path: Path, fd: int, dtype: str, shape: list[int], offset: int, nbytes: int
                 ) -> torch.Tensor:
    """A checked tensor of a segment read into a new tensor (one copy)."""
    out = torch.empty(shape, dtype=DTYPES[dtype])
    if nbytes:
        _pread_all(fd, out.reshape(-1).view(torch.uint8).numpy().data, offset)
        _check_bool(path, dtype, out)
    return out


def _check_bool(path: Path, dtype: str, tensor: torch.Tensor) -> None:
    if dtype == "bool" and tensor.numel() and bool((tensor.view(torch.uint8) > 1).any()):
        raise SegmentError(f"segment {path}: bool tensor holds bytes other than 0 and 1")


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise SegmentError(f"segment ended {view.nbytes} bytes early")
        view, offset = view[n:], offset + n


def private_base(base: Path) -> Path:
    """Creates `base` (0700) if missing and returns it.

    Raises:
        PermissionError: it belongs to another user or others may enter it.
    """
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = base.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"local tier directory {base} must belong to this user with "
                              f"mode 0700 (it is {oct(info.st_mode & 0o777)}, uid "
                              f"{info.st_uid})")
    return base


def node_id(base: Path) -> str:
    """The id of the tier at `base`, made once by the first process that asks: processes
    that share the directory share the id (a link makes it appear whole or not at all)."""
    path = base / NODE_FILE
    if not path.exists():
        tmp = base / f".{NODE_FILE}.{secrets.token_hex(8)}"
        tmp.write_text(secrets.token_hex(16))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text()


def job_dir(base: Path, job: str) -> Path:
    """A new directory of `job` under `base` (see [Note: tier directory])."""
    path = base / f"{job}+{secrets.token_hex(16)}"
    path.mkdir(mode=0o700)
    return path


def segment_name(attempt: int, step: int, microbatch: int, layer: int, version: int) -> str:
    """A fresh file name of one layer's segment of a micro-batch's stash."""
    return f"{attempt}-{step}-{microbatch}-{layer}-{version}-{secrets.token_hex(8)}{SUFFIX}"


def own_name(attempt: int) -> str:
    """A fresh file name of a private store's slot ([Note: own slots])."""
    return f"{OWN_PREFIX}{attempt}-{secrets.token_hex(8)}{SUFFIX}"


def check_path(base: Path, job: str, path: str) -> Path:
    """`path` if it names a segment of `job` directly in one of its directories under
    `base`.

    Raises:
        SegmentError: any other path (outside the tier, another job's, not a segment).
    """
    candidate = Path(path)
    parent = candidate.parent
    if (parent.parent != base or not _DIR_NAME.fullmatch(parent.name)
            or parent.name.rpartition("+")[0] != job
            or not _SEGMENT_NAME.fullmatch(candidate.name)):
        raise SegmentError(f"index names {path!r}, not a segment of job {job!r} in {base}")
    return candidate


def used_bytes(base: Path) -> int:
    """Bytes of every segment under `base`, all jobs."""
    total = 0
    for folder in _job_dirs(base, "*"):
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX):
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # consumed meanwhile
                        pass
    return total


def own_bytes(folder: Path) -> int:
    """Bytes of the segments and spares in one job directory, not the lent files."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.endswith(SUFFIX) and not entry.name.startswith(LENT_PREFIX):
                with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def _job_dirs(base: Path, job: str) -> list[Path]:
    return [p for p in base.glob(f"{job}+*") if p.is_dir() and not p.is_symlink()]



def clear_job(base: Path, job: str, below_attempt: int | None = None) -> int:
    """Removes `job`'s segments under `base`: all of them, or (with `below_attempt`) those
    of earlier attempts only, keeping the directories; returns how many it removed."""
    removed = 0
    for folder in _job_dirs(base, job):
        for seg in folder.glob(f"*{SUFFIX}"):
            match = (_SEGMENT_NAME.fullmatch(seg.name.removeprefix(LENT_PREFIX))
                     or _OWN_NAME.fullmatch(seg.name))
            if match and (below_attempt is None or int(match[1]) < below_attempt):
                seg.unlink(missing_ok=True)
                removed += 1
        if below_attempt is None:
            shutil.rmtree(folder, ignore_errors=True)
    return removed
