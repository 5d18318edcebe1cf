"""The Redis backend of the stash: pipelined put / take, backpressure on a full store, byte
accounting; `OffloadStore` is its `StashStore` (see [Note: store interface] in
`offload_store.api`)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.retry import Retry

from offload_store.acl import USER_ENV
from offload_store.api import LayerTensors, StashFullError, StoreStats
from offload_store.chunks import (
    CHUNK_BYTES,
    CONNECTIONS,
    MAX_HEADER_BYTES,
    ChunkIO,
    Value,
    chunk_bytes_from_env,
    named_chunks,
)
from offload_store.frames import Frame, FramePacker
from offload_store.keys import TIER_RANKS_SUFFIX, check_index, check_name, job_pattern, stash_key
from offload_store.receive import Taken, getdel_frames
from pipefb.codec import DEFAULT_MAX_BYTES, unpack, unpack_in_place

FIRST_DELAY_S = 0.02  # first backoff after the store refuses a write
MAX_DELAY_S = 1.0  # backoff doubles up to this
SCAN_COUNT = 1000  # keys per SCAN round trip
UNLINK_BATCH = 512  # keys per UNLINK command in clear_job
PASSWORD_ENV = "PIPEFB_STORE_PASSWORD"  # the store's AUTH password (Redis requirepass); unset: none
# the unix socket of the same Redis as the address (a store on this host): clients use it
# instead of TCP; unset or empty: TCP
SOCKET_ENV = "PIPEFB_STORE_SOCKET"
STORE_OPTIONS = ("ttl_seconds", "max_wait_seconds", "chunk_bytes",  # open_redis_store's
                 "chunk_connections")  # OffloadStore options

# Client defaults of `connect`; a stash value can be hundreds of MB, hence the long read timeout.
CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 30.0,  # seconds to wait for one reply
    "socket_connect_timeout": 5.0,  # seconds to open a connection
    "socket_keepalive": True,  # notice dead peers on idle pooled connections
    "health_check_interval": 15,  # PING a connection idle this many seconds before reuse
}


def parse_address(address: str) -> tuple[str, int]:
    """Splits ``host:port`` (``[v6]:port`` too) into host and port.

    Raises:
        ValueError: no host, no port, or a port outside 1..65535; names the address.
    """
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not host:port")
    return host, int(port)


def connect(address: str, **kw: Any) -> redis.Redis:
    """Opens a pooled client to the store at ``host:port``.

    hiredis parses replies when it is installed (redis-py picks it by itself). The AUTH
    password comes from ``$PIPEFB_STORE_PASSWORD`` (unset or empty: no AUTH) unless
    ``password`` is passed, the user from ``$PIPEFB_STORE_USER`` (unset: the default user)
    unless ``username`` is ([Note: store ACL] in `offload_store.acl`). Where
    ``$PIPEFB_STORE_SOCKET`` names the same server's unix socket (a store on this host),
    the client connects there instead of to `address`, unless ``unix_socket_path`` is
    passed.

    Args:
        address: ``host:port`` of the Redis server.
        **kw: overrides of `CLIENT_DEFAULTS` or any other redis-py connection argument.

    Raises:
        ValueError: a bad address, or ``decode_responses=True`` (values are raw bytes).
    """
    host, port = parse_address(address)
    options = {**CLIENT_DEFAULTS, "password": os.environ.get(PASSWORD_ENV) or None,
               "username": os.environ.get(USER_ENV) or None,
               "unix_socket_path": os.environ.get(SOCKET_ENV) or None, **kw}
    if options.get("decode_responses"):
        raise ValueError("decode_responses=True would decode tensor bytes as text")
    client = redis.Redis(host=host, port=port, **options)
    # every connection the pool opens writes stash frames without copying them
    client.connection_pool.connection_kwargs["command_packer"] = FramePacker()
    return client


def _is_oom(error: Exception) -> bool:
    """Whether a reply is the server refusing a write because it reached `maxmemory`."""
    return isinstance(error, OutOfMemoryError) or (
        isinstance(error, ResponseError) and str(error).startswith("OOM")
    )


def _batches(items: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    """Groups an iterable into lists of at most `size` items."""
    batch: list[bytes] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class OffloadStore:
    """One job attempt's stash in Redis: layer -> name -> tensor, keyed by step,
    micro-batch, version; a `StashStore`.

    [Note: delete on consume] `take` reads and deletes in one GETDEL per key, each value
    received from the socket into a buffer of its own, which its tensor views ([Note:
    values received in place] in `offload_store.receive`); the TTL only reclaims what a
    crashed job never takes. Redis must run with ``noeviction``: a full store refuses
    writes and `put` backs off until a `take` frees memory; nothing is evicted. A value
    over `chunk_bytes` goes as chunks, taken over several connections ([Note: chunked
    values] in `offload_store.chunks`); `stats` count it as one key of its frame's bytes,
    `count_keys` counts its chunk keys too. Safe to share between threads (each call uses
    its own pipelines).
    """

    def __init__(
        self,
        client: redis.Redis,
        job: str,
        attempt: int = 0,
        *,
        ttl_seconds: int = 3600,
        max_wait_seconds: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
        chunk_connections: int = CONNECTIONS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """Binds a client to one job attempt.

        Args:
            client: a client with ``decode_responses=False`` (see `connect`).
            job: job id, ``[A-Za-z0-9_.-]+``.
            attempt: restart count of the job; a new attempt never sees old keys.
            ttl_seconds: expiry of every key, a safety net only.
            max_wait_seconds: how long `put` backs off on a full store before giving up.
            chunk_bytes: values longer than this are chunked; 0: never.
            chunk_connections: connections a chunked take uses at once.
            max_bytes: the largest tensor data a take accepts in a value of one key (its
                frame may add a codec header); a longer value is refused unread.

        Raises:
            ValueError: a bad job id, attempt, TTL, wait, chunk size, connection count or
                `max_bytes`.
        """
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the client decodes responses; tensor values must stay bytes")
        if check_index("ttl_seconds", ttl_seconds) == 0:
            raise ValueError(f"ttl_seconds {ttl_seconds} must be positive")
        if not max_wait_seconds >= 0:
            raise ValueError(f"max_wait_seconds {max_wait_seconds!r} must be >= 0")
        self.max_bytes = check_index("max_bytes", max_bytes)
        self._chunks = ChunkIO(client.connection_pool, chunk_bytes, chunk_connections)
        self.job = check_name("job", job)
        self.attempt = check_index("attempt", attempt)
        self.ttl_seconds = ttl_seconds
        self.max_wait_seconds = max_wait_seconds
        self._client = client
        self._stats = StoreStats()
        self._lock = threading.Lock()

    @property
    def chunk_bytes(self) -> int:
        """Values longer than this are chunked; 0: none is."""
        return self._chunks.chunk_bytes

    @property
    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def key(self, step: int, microbatch: int, layer: int, version: int, name: str) -> str:
        """The Redis key of one stashed tensor of this job attempt."""
        return stash_key(self.job, self.attempt, step, microbatch, layer, version, name)

    def put(
        self,
        step: int,
        microbatch: int,
        version: int,
        tensors: Mapping[int, Mapping[str, torch.Tensor]],
    ) -> int:
        """Stashes tensors in one pipeline of ``SET key value EX ttl``, a value over the
        chunk size as its manifest and chunks ([Note: chunked values]).

        Args:
            step: training step.
            microbatch: micro-batch index within the step.
            version: weight version the forward pass used.
            tensors: layer -> name -> tensor.

        Returns:
            The value bytes written (a chunked value's frame bytes, not its manifest's).

        Raises:
            StashFullError: the store stayed full for `max_wait_seconds`; keys this put
                wrote (chunks too) are removed again, so a put is all or nothing.
            CodecError: a dtype the codec does not allow.
            ValueError: a bad index or name.
        """
        items = {  # see [Note: zero-copy put] in offload_store.frames
            self.key(step, microbatch, layer, version, name): Frame.of(tensor)
            for layer, named in tensors.items()
            for name, tensor in named.items()
        }
        if not items:
            return 0
        nbytes = sum(map(len, items.values()))
        stored = self._chunks.split(items)
        try:
            if not self._write_with_backoff(stored):
                raise self._full_error(step, microbatch, nbytes)
        except BaseException:
            with suppress(RedisError):
                self._client.unlink(*stored)
            raise
        self._count(bytes_put=nbytes, keys_put=len(items))
        return nbytes

    def take(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> LayerTensors:
        """Fetches and deletes stashed tensors in one pipeline of GETDEL, each value
        received into its own aligned buffer, which its tensor views after the codec's
        checks ([Note: values received in place] in `offload_store.receive`), then the
        chunks of chunked values over several connections ([Note: chunked values]).

        Every requested key is deleted even when another one is missing or corrupt, and
        every chunk of a chunked value whose manifest was found.

        Args:
            step: training step.
            microbatch: micro-batch index within the step.
            version: weight version the forward pass used.
            names: layer -> tensor names to take.

        Returns:
            layer -> name -> tensor.

        Raises:
            KeyError: a key that is not in the store, or a chunk of a chunked value that
                is not; the argument is the full key.
            CodecError: a value that is not a valid tensor frame, one longer than
                `max_bytes` and a header, or a chunk of the wrong length.
            redis.exceptions.ConnectionError, TimeoutError: the connection failed; the
                pipeline is not sent again ([Note: no resend]).
        """
        wanted = [(layer, name) for layer, layer_names in names.items() for name in layer_names]
        keys = [self.key(step, microbatch, layer, version, name) for layer, name in wanted]
        if not keys:
            return {}
        return self.decode_taken(wanted, keys, self.getdel(keys))

    def decode_taken(self, wanted: Sequence[tuple[int, str]], keys: Sequence[str],
                     values: Sequence[Any]) -> LayerTensors:
        """The tensors of a GETDEL pipeline's replies (counted as taken), as `take`
        returns them, with the chunks of chunked values fetched first; raises as `take`
        does. A reply is a frame in its own buffer (`receive.getdel_frames`), whose tensor
        views it, or bytes (redis-py's replies), which the tensor must not share: decoded
        into a new one."""
        frames, layouts = self._chunks.receive(keys, values)
        found = [i for i, value in enumerate(values)
                 if isinstance(value, bytes | torch.Tensor)]
        self._count(bytes_taken=sum(layouts[i].frame_bytes if i in layouts else len(values[i])
                                    for i in found), keys_taken=len(found))
        out: LayerTensors = {}
        for (layer, name), key, frame in zip(wanted, keys, frames, strict=True):
            if isinstance(frame, BaseException):
                raise frame
            if frame is None:
                raise KeyError(key)
            out.setdefault(layer, {})[name] = (
                unpack_in_place(frame, max_bytes=self.max_bytes)
                if isinstance(frame, torch.Tensor) else unpack(frame, max_bytes=self.max_bytes))
        return out

    def prefetch(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> None:
        """Does nothing: a `take` is already one pipelined round trip to Redis."""

    def release(
        self, step: int, microbatch: int, version: int, names: Mapping[int, Sequence[str]]
    ) -> int:
        """Deletes the keys of these tensors that are still stored (a taken key is gone)
        in one GETDEL pipeline, whose replies are dropped, then the chunks of the chunked
        ones its manifests name in one UNLINK ([Note: chunked values]).

        Returns:
            The number of tensors' keys deleted (chunks not counted).

        Raises:
            ValueError: a bad index or name.
        """
        keys = [self.key(step, microbatch, layer, version, name)
                for layer, layer_names in names.items() for name in layer_names]
        values = self.getdel(keys) if keys else []
        chunked = named_chunks(keys, values)
        if chunked:
            self._client.unlink(*chunked)
        return sum(1 for value in values if isinstance(value, bytes | torch.Tensor))

    def clear_job(self) -> int:
        """Deletes every key of this job, any attempt (SCAN + UNLINK).

        Returns:
            The number of keys deleted.
        """
        return clear_job_keys(self._client, self.job)

    def node_bytes(self) -> int:
        """0: Redis holds nothing in this node's shared memory for this store."""
        return 0

    def close(self) -> None:
        """Stops the chunk threads and closes the Redis client's connections."""
        self._chunks.close()
        self._client.close()

    def count_keys(self) -> int:
        """The number of keys of this job in the store, any attempt."""
        return count_job_keys(self._client, self.job)

    def _write_with_backoff(self, items: dict[str, Value]) -> bool:
        """Writes all items, re-sending those refused for OOM with exponential backoff.

        Returns:
            True once every item is written; False when `max_wait_seconds` ran out.
        """
        deadline = time.monotonic() + self.max_wait_seconds
        delay = FIRST_DELAY_S
        pending = self._set_all(items)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._count(retries=1)
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, MAX_DELAY_S)
            pending = self._set_all(pending)
        return True

    def _set_all(self, items: dict[str, Value]) -> dict[str, Value]:
        """Sends the items' SETs (idempotent) in one pipeline on the calling thread, chunks
        too ([Note: chunked values]); returns the items refused for OOM.

        Raises:
            RedisError: any error other than OOM.
        """
        pipe = self._client.pipeline(transaction=False)
        for key, value in items.items():
            pipe.set(key, value, ex=self.ttl_seconds)
        refused: dict[str, Value] = {}
        for (key, value), reply in zip(items.items(), pipe.execute(False), strict=True):
            if isinstance(reply, Exception):
                if not _is_oom(reply):
                    raise reply
                refused[key] = value
        return refused

    @property
    def client(self) -> redis.Redis:
        """The Redis client (the local tier sends its index with it)."""
        return self._client

    def getdel(self, keys: Sequence[str]) -> list[Taken]:
        """Sends one GETDEL pipeline exactly once; returns its replies, each value received
        into a buffer of its own ([Note: values received in place] in
        `offload_store.receive`), errors included, a value longer than `max_bytes` and a
        header as a `CodecError`.

        [Note: no resend] redis-py re-sends a command after a connection error or timeout;
        a re-sent GETDEL whose first reply was lost would find nothing and lose the values.
        So the pipeline is sent once on a pooled connection, which a failure disconnects.

        Raises:
            redis.exceptions.ConnectionError, TimeoutError: the connection failed.
        """
        return getdel_frames(self._client.connection_pool, keys,
                             self.max_bytes + MAX_HEADER_BYTES)

    def _full_error(self, step: int, microbatch: int, nbytes: int) -> StashFullError:
        """Builds the error of a put that timed out, with the server's memory figures."""
        used = maxmemory = -1
        with suppress(RedisError):
            info = self._client.info("memory")
            used, maxmemory = int(info["used_memory"]), int(info["maxmemory"])
        return StashFullError(self.job, step, microbatch, nbytes, used, maxmemory)

    def _count(self, **deltas: int) -> None:
        """Adds to the named counters of `stats`."""
        with self._lock:
            for field, delta in deltas.items():
                setattr(self._stats, field, getattr(self._stats, field) + delta)


def open_redis_store(address: str, job: str, attempt: int = 0, /, **options: Any
                     ) -> OffloadStore:
    """The Redis backend's `StoreFactory`: a pooled client (`connect`) bound to one job
    attempt.

    Args:
        address: ``host:port`` of the Redis server.
        job: job id, ``[A-Za-z0-9_.-]+``.
        attempt: restart count of the job.
        **options: ``ttl_seconds``, ``max_wait_seconds``, ``chunk_bytes`` (default
            ``$PIPEFB_STORE_CHUNK_BYTES``, else `offload_store.chunks.CHUNK_BYTES`) and
            ``chunk_connections`` go to `OffloadStore`, the rest to `connect`
            (``username=None, password=None`` ignores the environment).

    Raises:
        ValueError: a bad address, job id, attempt, option value or
            ``$PIPEFB_STORE_CHUNK_BYTES``.
    """
    store_options = {k: options.pop(k) for k in STORE_OPTIONS if k in options}
    if "chunk_bytes" not in store_options:
        store_options["chunk_bytes"] = chunk_bytes_from_env()
    return OffloadStore(connect(address, **options), job, attempt, **store_options)


def clear_job_keys(client: redis.Redis, job: str) -> int:
    """Deletes every key of `job`, any attempt (SCAN + UNLINK); returns how many.

    Raises:
        ValueError: a bad job id.
    """
    keys = client.scan_iter(match=job_pattern(job), count=SCAN_COUNT)
    return sum(int(client.unlink(*batch)) for batch in _batches(keys, UNLINK_BATCH))


def count_job_keys(client: redis.Redis, job: str) -> int:
    """The number of stash keys of `job` in the store, any attempt: chunk keys too, so a
    half-written chunked value's show ([Note: chunked values] in `offload_store.chunks`);
    the local tier's sets of ranks, which the ranks remove as they drop the job, not
    counted.

    Raises:
        ValueError: a bad job id.
    """
    return sum(1 for key in client.scan_iter(match=job_pattern(job), count=SCAN_COUNT)
               if not bytes(key).endswith(TIER_RANKS_SUFFIX))


def execute_once(pipe: Pipeline) -> list[Any]:
    """Executes a pipeline without redis-py's automatic resend ([Note: no resend]): on a
    checked-out connection with retries switched off."""
    conn = pipe.connection_pool.get_connection()
    saved = conn.retry
    conn.retry = Retry(NoBackoff(), 0)
    pipe.connection = conn  # released back to the pool by the pipeline's reset()
    try:
        return pipe.execute(raise_on_error=False)
    finally:
        conn.retry = saved
