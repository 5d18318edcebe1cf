"""The coordinator's own calls to the offload store: a job's stash, its clean-up, and
noticing a lost store (restarted or not answering) during a run."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from offload_store import OffloadStore, connect
from pipefb.errors import WorkerFailed

log = logging.getLogger(__name__)

STORE_TIMEOUT_SECONDS = 2.0  # the store's INFO during a run (the liveness check)
STORE_CHECK_SECONDS = 0.5  # at most this often (poll runs after every step)


def fail_fast_client(address: str, retries: int = 0) -> Any:
    """A client of the store for the coordinator's own calls: short timeouts and few
    retries, none waited for, so a dead store shows at once (the workers' clients keep
    redis-py's backoff)."""
    return connect(address, retry=Retry(NoBackoff(), retries),
                   socket_timeout=STORE_TIMEOUT_SECONDS,
                   socket_connect_timeout=STORE_TIMEOUT_SECONDS)


def job_store(address: str, job_id: str) -> OffloadStore:
    """The job's stash, through a client that fails at once when the store is down
    (no retries): a job's end must not wait on a dead store."""
    return OffloadStore(fail_fast_client(address), job_id)


def check_store_empty(address: str, job_id: str) -> None:
    """Logs the keys a finished job left in the store, if any."""
    left = job_store(address, job_id).count_keys()
    if left:
        log.warning("job %s left %d keys in the offload store", job_id, left)


def clear_store(address: str, job_id: str) -> None:
    """Deletes the job's stash keys (all attempts); a failure is logged, never raised."""
    try:
        job_store(address, job_id).clear_job()
    except Exception as error:
        log.warning("could not clear the store of job %s: %s", job_id, error)


def wait_for_store(address: str, wait_seconds: float, interrupted: Callable[[], None]
                   ) -> None:
    """Waits until the offload store answers (a restarted one comes back empty);
    `interrupted` raises to give up early (StopJob, or the coordinator stopping).

    Raises:
        WorkerFailed: it did not answer within `wait_seconds`.
    """
    deadline = time.monotonic() + wait_seconds
    client = fail_fast_client(address)
    try:
        while True:
            try:
                client.ping()
                return
            except RedisError as error:
                interrupted()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"the offload store at {address} did "
                                       f"not come back: {error}") from None
                time.sleep(0.2)
    finally:
        client.close()


class StoreWatch:
    """Notices a lost offload store during a run: its Redis run id changes when it restarts
    (empty), and INFO fails while it is down."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._client = fail_fast_client(address, retries=2)  # a blip must not fail a job
        self._run_id = self._read()
        self._checked = time.monotonic()

    def _read(self) -> str:
        try:
            return str(self._client.info("server")["run_id"])
        except (RedisError, KeyError) as error:
            raise WorkerFailed(f"the offload store at {self.address} does not answer: "
                               f"{error}") from None

    def check(self, every: float = 0.0) -> None:
        """Raises WorkerFailed if the store restarted or does not answer; with `every`,
        asks only if the last check is that many seconds old."""
        if every and time.monotonic() - self._checked < every:
            return
        self._checked = time.monotonic()
        now = self._read()
        if now != self._run_id:
            raise WorkerFailed(f"the offload store at {self.address} restarted (run id "
                               f"{self._run_id[:8]} -> {now[:8]}): the stash of steps in "
                               "flight is lost")

    def close(self) -> None:
        """Closes the client."""
        self._client.close()
