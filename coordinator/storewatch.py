"""The coordinator's own calls to the offload store: a job's stash, its clean-up, and
noticing a lost store (restarted or not answering) during a run."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from offload_store import StoreAdmin, StoreUnavailable, open_admin
from pipefb.errors import WorkerFailed

log = logging.getLogger(__name__)

STORE_TIMEOUT_SECONDS = 2.0  # the store's answer during a run (the liveness check)
STORE_CHECK_SECONDS = 0.5  # at most this often (poll runs after every step)


def fail_fast_admin(address: str, retries: int = 0) -> StoreAdmin:
    """A handle on the store for the coordinator's own calls: short timeouts and few
    retries, none waited for, so a dead store shows at once (the workers' stores keep
    their backend's backoff)."""
    return open_admin(address, timeout_seconds=STORE_TIMEOUT_SECONDS,
                      connect_timeout_seconds=STORE_TIMEOUT_SECONDS, retries=retries)


def check_store_empty(address: str, job_id: str) -> None:
    """Logs the keys a finished job left in the store, if any."""
    with contextlib.closing(fail_fast_admin(address)) as store:
        left = store.count_keys(job_id)
    if left:
        log.warning("job %s left %d keys in the offload store", job_id, left)


def clear_store(address: str, job_id: str) -> None:
    """Deletes the job's stash keys (all attempts); a failure is logged, never raised."""
    try:
        with contextlib.closing(fail_fast_admin(address)) as store:
            store.clear_job(job_id)
    except Exception as error:
        log.warning("could not clear the store of job %s: %s", job_id, error)


def grant_store_user(address: str, job_id: str) -> tuple[str, str]:
    """Makes the job's own store user for its next attempt ([Note: job store users] in
    offload_store/acl.py); returns its name and password.

    Raises:
        WorkerFailed: the store does not answer or refuses (a lost store: recoverable).
    """
    try:
        with contextlib.closing(fail_fast_admin(address, retries=2)) as store:
            return store.grant_job(job_id)
    except StoreUnavailable as error:
        raise WorkerFailed(f"could not make the store user of job {job_id} at {address}: "
                           f"{error.reason}") from None


def drop_store_user(address: str, job_id: str) -> None:
    """Drops the job's store user and its connections; a failure is logged, never
    raised (a store that restarted has lost it anyway)."""
    try:
        with contextlib.closing(fail_fast_admin(address)) as store:
            store.revoke_job(job_id)
    except Exception as error:
        log.warning("could not drop the store user of job %s: %s", job_id, error)


def wait_for_store(address: str, wait_seconds: float, interrupted: Callable[[], None]
                   ) -> None:
    """Waits until the offload store answers (a restarted one comes back empty);
    `interrupted` raises to give up early (StopJob, or the coordinator stopping).

    Raises:
        WorkerFailed: it did not answer within `wait_seconds`.
    """
    deadline = time.monotonic() + wait_seconds
    with contextlib.closing(fail_fast_admin(address)) as store:
        while True:
            try:
                store.ping()
                return
            except StoreUnavailable as error:
                interrupted()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"the offload store at {address} did "
                                       f"not come back: {error.reason}") from None
                time.sleep(0.2)


class StoreWatch:
    """Notices a lost offload store during a run: its instance id changes when it restarts
    (empty), and it does not answer while it is down."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._store = fail_fast_admin(address, retries=2)  # a blip must not fail a job
        self._run_id = self._read()
        self._checked = time.monotonic()

    def _read(self) -> str:
        try:
            return self._store.instance()
        except StoreUnavailable as error:
            raise WorkerFailed(f"the offload store at {self.address} does not answer: "
                               f"{error.reason}") from None

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
        """Closes the store handle."""
        self._store.close()
