"""The offload store: stashed tensors in Redis, put by forward workers, taken by backward ones."""

from offload_store.keys import job_pattern, stash_key
from offload_store.server import RedisServer, find_redis_server
from offload_store.store import OffloadStore, StashFullError, StoreStats, connect, parse_address

__all__ = [
    "OffloadStore",
    "RedisServer",
    "StashFullError",
    "StoreStats",
    "connect",
    "find_redis_server",
    "job_pattern",
    "parse_address",
    "stash_key",
]
