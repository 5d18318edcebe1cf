"""The offload store: stashed tensors put by forward workers and taken by backward ones,
behind one interface (`offload_store.api`) with its backends chosen by address
(`offload_store.backends`; Redis is the default)."""

from offload_store.api import (
    AdminLimits,
    StashFullError,
    StashStore,
    StoreAdmin,
    StoreStats,
    StoreUnavailable,
)
from offload_store.backends import open_admin, open_store
from offload_store.keys import job_pattern, stash_key
from offload_store.server import RedisServer, find_redis_server
from offload_store.store import OffloadStore, connect, parse_address

__all__ = [
    "AdminLimits",
    "OffloadStore",
    "RedisServer",
    "StashFullError",
    "StashStore",
    "StoreAdmin",
    "StoreStats",
    "StoreUnavailable",
    "connect",
    "find_redis_server",
    "job_pattern",
    "open_admin",
    "open_store",
    "parse_address",
    "stash_key",
]
