"""The Redis backend's `StoreAdmin`: the coordinator's liveness, identity, memory and job-key
calls, with every Redis failure turned into `StoreUnavailable`."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from offload_store import acl
from offload_store.api import AdminLimits, StoreUnavailable
from offload_store.shm import clear_tier_job, tier_used_bytes
from offload_store.store import clear_job_keys, connect, count_job_keys

T = TypeVar("T")


class RedisAdmin:
    """A `StoreAdmin` over one pooled redis-py client."""

    def __init__(self, address: str, client: redis.Redis) -> None:
        """Wraps `client`, a client of the Redis at `address` (see `open_redis_admin`)."""
        self.address = address
        self._client = client

    def _call(self, request: Callable[[], T]) -> T:
        """Runs one request; a Redis error, or a reply without the field asked for,
        raises StoreUnavailable naming the store."""
        try:
            return request()
        except (RedisError, KeyError) as error:
            raise StoreUnavailable(self.address, error) from None

    def ping(self) -> None:
        """Returns once Redis answers PING; raises StoreUnavailable otherwise."""
        self._call(self._client.ping)

    def instance(self) -> str:
        """Redis's run id (INFO server), new at every start of the server."""
        return self._call(lambda: str(self._client.info("server")["run_id"]))

    def used_memory(self) -> int:
        """INFO memory's used_memory plus the bytes of this host's local tier (where
        ``$PIPEFB_LOCAL_TIER_DIR`` names one): the store's memory, both tiers."""
        return self._call(lambda: int(self._client.info("memory")["used_memory"])) + (
            tier_used_bytes())

    def count_keys(self, job: str) -> int:
        """The number of keys of `job`, any attempt (SCAN)."""
        return self._call(lambda: count_job_keys(self._client, job))

    def clear_job(self, job: str) -> int:
        """Deletes every key of `job`, any attempt (SCAN + UNLINK), and its segments in
        this host's local tier ([Note: tier leases]); returns how many."""
        return self._call(lambda: clear_job_keys(self._client, job)) + clear_tier_job(job)

    def grant_job(self, job: str) -> tuple[str, str]:
        """Makes (or resets) `job`'s store user with a fresh password (ACL SETUSER)."""
        user, password = acl.job_user(job), secrets.token_hex(16)
        rule = acl.job_rule(job, password)
        self._call(lambda: self._client.execute_command("ACL", "SETUSER", user, *rule))
        return user, password

    def revoke_job(self, job: str) -> None:
        """Drops `job`'s store user (ACL DELUSER), which closes its connections."""
        user = acl.job_user(job)
        self._call(lambda: self._client.execute_command("ACL", "DELUSER", user))

    def close(self) -> None:
        """Closes the client's connections."""
        self._client.close()


def open_redis_admin(address: str, limits: AdminLimits) -> RedisAdmin:
    """The Redis backend's `AdminFactory`: a client with the limits' timeouts and, when
    `limits.retries` is set, that many immediate resends (none waited for); unset values
    keep `connect`'s defaults and redis-py's retry with backoff.

    Raises:
        ValueError: a bad address.
    """
    options: dict[str, Any] = {}
    if limits.timeout_seconds is not None:
        options["socket_timeout"] = limits.timeout_seconds
    if limits.connect_timeout_seconds is not None:
        options["socket_connect_timeout"] = limits.connect_timeout_seconds
    if limits.retries is not None:
        options["retry"] = Retry(NoBackoff(), limits.retries)
    return RedisAdmin(address, connect(address, **options))
