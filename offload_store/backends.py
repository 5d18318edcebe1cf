"""The store backends by address scheme, and the two calls that open a store through them.

An address is ``SCHEME://REST`` or, for the default Redis backend, plain ``host:port``;
the backend receives ``REST``. Adding a backend means writing its `StashStore` and
`StoreAdmin` in `offload_store/` and one `register` line below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from offload_store.admin import open_redis_admin
from offload_store.api import AdminLimits, StashStore, StoreAdmin
from offload_store.shm import TIER_OPTIONS, with_local_tier
from offload_store.store import open_redis_store

DEFAULT_SCHEME = "redis"  # the backend of an address without ``SCHEME://``
SEPARATOR = "://"


class StoreFactory(Protocol):
    """Opens a backend's `StashStore` for one job attempt."""

    def __call__(self, address: str, job: str, attempt: int, /, **options: Any) -> StashStore:
        """Args: the backend's own address (scheme stripped), job id, attempt, options."""
        ...


class AdminFactory(Protocol):
    """Opens a backend's `StoreAdmin`."""

    def __call__(self, address: str, limits: AdminLimits, /) -> StoreAdmin:
        """Args: the backend's own address (scheme stripped) and the limits to apply."""
        ...


@dataclass(frozen=True)
class Backend:
    """One store implementation: how to open its stash and its admin handle."""

    open_store: StoreFactory
    open_admin: AdminFactory


_BACKENDS: dict[str, Backend] = {}


def register(scheme: str, backend: Backend) -> None:
    """Makes `backend` open the addresses ``scheme://...``.

    Raises:
        ValueError: the scheme is empty, not lower-case alphanumeric, or taken.
    """
    if not scheme.isalnum() or scheme != scheme.lower():
        raise ValueError(f"store scheme {scheme!r} must be lower-case letters and digits")
    if scheme in _BACKENDS:
        raise ValueError(f"store scheme {scheme!r} is registered already")
    _BACKENDS[scheme] = backend


def schemes() -> list[str]:
    """The registered schemes, sorted."""
    return sorted(_BACKENDS)


def resolve(address: str) -> tuple[Backend, str]:
    """The backend of `address` and the address it receives (the scheme stripped).

    Raises:
        ValueError: a scheme no backend registered; names it and the known ones.
    """
    scheme, sep, rest = address.partition(SEPARATOR)
    if not sep:
        scheme, rest = DEFAULT_SCHEME, address
    backend = _BACKENDS.get(scheme)
    if backend is None:
        raise ValueError(f"store address {address!r}: no backend for scheme {scheme!r} "
                         f"(known: {', '.join(schemes())})")
    return backend, rest


def open_store(address: str, job: str, attempt: int = 0, **options: Any) -> StashStore:
    """Opens the stash of one job attempt at `address`.

    Args:
        address: ``host:port`` (Redis) or ``SCHEME://...`` of a registered backend.
        job: job id, ``[A-Za-z0-9_.-]+``.
        attempt: restart count of the job; a new attempt never sees old stashes.
        **options: backend options (Redis: ``ttl_seconds``, ``max_wait_seconds`` and
            client arguments, see `offload_store.store.open_redis_store`), and the
            node-local tier's (``local_tier_dir``: its directory, empty: none;
            ``local_tier_bytes``: its cap; ``local_tier_ranks``: the job's rank count;
            ``local_tier_private``: the rank takes back every stash it puts;
            ``local_tier_rank``: the rank's index in the job; ``local_tier_consumers``:
            layer -> the rank that takes its stash; ``local_tier_producers``: layer -> the
            rank whose stash of it this rank takes; see `offload_store.shm.with_local_tier`).

    Raises:
        ValueError: an unknown scheme, a bad address, job id, attempt or option.
        PermissionError: a local tier directory that is another user's or open to others.
    """
    backend, rest = resolve(address)
    tier = {k: options.pop(k) for k in TIER_OPTIONS if k in options}
    return with_local_tier(backend.open_store(rest, job, attempt, **options), **tier)


def open_admin(
    address: str, *, timeout_seconds: float | None = None,
    connect_timeout_seconds: float | None = None, retries: int | None = None,
) -> StoreAdmin:
    """Opens the coordinator's handle on the store at `address`.

    Args:
        address: ``host:port`` (Redis) or ``SCHEME://...`` of a registered backend.
        timeout_seconds: the wait for one reply; None: the backend's default.
        connect_timeout_seconds: the wait to connect; None: the backend's default.
        retries: immediate resends of a failed request; None: the backend's own policy.

    Raises:
        ValueError: an unknown scheme or a bad address.
    """
    backend, rest = resolve(address)
    limits = AdminLimits(timeout_seconds, connect_timeout_seconds, retries)
    return backend.open_admin(rest, limits)


register(DEFAULT_SCHEME, Backend(open_redis_store, open_redis_admin))
