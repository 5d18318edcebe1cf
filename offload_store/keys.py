"""The one place offload-store key strings are built and their parts validated."""

from __future__ import annotations

import re

PREFIX = "pipefb"  # namespace of every pipefb key in a shared Redis

# Job ids and tensor names: no ':' (the key separator) and no glob characters (SCAN match).
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_name(kind: str, value: str) -> str:
    """Returns `value` if it is a valid job id or tensor name.

    Args:
        kind: what the value is ("job", "name"), for the error message.
        value: the candidate string.

    Raises:
        ValueError: empty, not a string, or a character outside ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be a non-empty string of [A-Za-z0-9_.-]")
    return value


def check_index(kind: str, value: int) -> int:
    """Returns `value` if it is a non-negative int (bools are refused).

    Raises:
        ValueError: not an int, a bool, or negative.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{kind} {value!r} must be a non-negative int")
    return value


def stash_key(
    job: str, attempt: int, step: int, microbatch: int, layer: int, version: int, name: str
) -> str:
    """Builds the key of one stashed tensor.

    Returns:
        ``pipefb:{job}:{attempt}:{step}:{microbatch}:{layer}:{version}:{name}``.

    Raises:
        ValueError: a bad job id or name, or a negative / non-int index; names the value.
    """
    parts = (
        check_name("job", job),
        check_index("attempt", attempt),
        check_index("step", step),
        check_index("microbatch", microbatch),
        check_index("layer", layer),
        check_index("version", version),
        check_name("name", name),
    )
    return ":".join([PREFIX, *map(str, parts)])


def chunk_key(key: str, index: int) -> str:
    """Builds the key of chunk `index` of the chunked value stored under `key` (a
    `stash_key`; [Note: chunked values] in `offload_store.chunks`).

    Returns:
        ``{key}:{index}``: under the job's pattern, and no other kind of key has as many
        parts.

    Raises:
        ValueError: a negative / non-int index.
    """
    return f"{key}:{check_index('chunk', index)}"


def job_pattern(job: str) -> str:
    """Returns the SCAN pattern matching every key of `job`, any attempt.

    Raises:
        ValueError: a bad job id.
    """
    return f"{PREFIX}:{check_name('job', job)}:*"


def segment_key(job: str, attempt: int, step: int, microbatch: int, layer: int,
                version: int) -> str:
    """Builds the index key of one layer's segment of a micro-batch's stash in the local
    tier ([Note: local tier index] in `offload_store.shm`).

    Returns:
        ``pipefb:{job}:{attempt}:{step}:{microbatch}:{layer}:{version}`` (no tensor name:
        a name never is empty, so no tensor's key is this).

    Raises:
        ValueError: a bad job id or index.
    """
    parts = (check_name("job", job), check_index("attempt", attempt),
             check_index("step", step), check_index("microbatch", microbatch),
             check_index("layer", layer), check_index("version", version))
    return ":".join([PREFIX, *map(str, parts)])


def tier_ranks_key(job: str, attempt: int) -> str:
    """Builds the key of the set of a job attempt's ranks that use a local tier, each as
    ``{tier id}/{rank token}``: ``pipefb:{job}:{attempt}:tier``.

    Raises:
        ValueError: a bad job id or attempt.
    """
    return f"{PREFIX}:{check_name('job', job)}:{check_index('attempt', attempt)}:tier"


TIER_RANKS_SUFFIX = b":tier"  # how every `tier_ranks_key` ends
