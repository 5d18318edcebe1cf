"""Stash writes off the compute path: the compute thread hands a micro-batch's stash over and
goes on; one I/O thread per rank writes it into the `StashStore`, with the bytes in flight
capped.

[Note: background stash] `StashWriter.put` counts the stash's bytes in flight and queues
its write for the rank's one I/O thread; the compute thread waits only when the bytes
already in flight would pass the cap, or, under a job's memory cap, when the bytes in
flight (this stash's among them) plus the rank's accounted memory (this stash still among
it: room for the saved tensors of the next forward, which take its place) would pass the
rank's memory limit (a stash larger than either waits until nothing else is in flight,
so it never deadlocks), and `put` returns how long it waited: the
runtime's STASH action lasts that long, which `store_blocked_seconds` reports. Writes
complete in the order they were handed over (one thread), so a *ticket* (how many puts were
handed over so far) names a prefix of them: `wait_written(ticket)` returns once that prefix
is in the store. Three readers rely on that:

- a forward rank's sends: a peer stream sends a transfer only after every stash handed
  over before it was written (`dataplane.grpc_transport`), so a backward rank that got the
  loss or gradient of a micro-batch finds its stash in the store ([Note: transport
  ordering]);
- a rank taking back its own stash (`take_pending`): a stash still handed over is handed
  back at once: one whose write has not started leaves the queue and never reaches the
  store; one being written is returned too (the write only reads it), and the I/O thread
  deletes it from the store once written;
- the step's end (`drain`): every write of the step is done, and the first failed write
  raises on the compute thread (a full store's `StashFullError` as before), so a failure
  never goes unreported. A failed write also wakes the waiters; its stash is not in the
  store, and the consumer's take fails with `KeyError` if the step was not failed first.

[Note: copies on the compute thread] On the CPU, a rank whose stash goes into the node
tier under its own index ([Note: private index] in offload_store/shm.py) puts and takes
it on the compute thread, with no writer and no prefetch: such a put is one memcpy into
a mapped file and a take is a view, with no round trip to wait on, so an I/O thread would
only do the same work on the same cores, and take the interpreter's lock from the compute
thread at each hand-over (bench/offload_overlap.py measures both ways; docs/benchmarks.md).
Every other stash (a Redis round trip, or a CUDA copy) goes through the writer.

On CUDA the stash is copied to host memory first (`offload_store.staging.HostStaging`:
pinned, reused buffers, a copy stream ordered by events); the I/O thread waits for the
copy's event before it writes. With a cap of 0 the put writes on the caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch

from offload_store.api import LayerTensors, StashStore
from pipefb.memory import tensor_bytes

# The default cap of a rank's bytes in flight to the store (worker --stash-in-flight-bytes)
STASH_IN_FLIGHT_BYTES = 256 << 20
Key = tuple[int, int]  # (step, micro-batch)


def stash_nbytes(tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int:
    """Data bytes of a micro-batch's stash."""
    return sum(t.nelement() * t.element_size() for named in tensors.values()
               for t in named.values())


def held_bytes(tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> int:
    """Host memory a micro-batch's stash holds while in flight: its tensors' storages, one
    shared by several tensors once, as the runtime's memory account counts them (on CUDA
    the staging copies hold `stash_nbytes`)."""
    return tensor_bytes(t for named in tensors.values() for t in named.values())


class _Pending:
    """One handed-over stash: what to write, and whether the I/O thread took it yet."""

    def __init__(self, ticket: int, version: int, tensors: LayerTensors, nbytes: int,
                 ready: Callable[[], None], done: Callable[[], None]) -> None:
        self.ticket, self.version, self.tensors, self.nbytes = ticket, version, tensors, nbytes
        self.ready, self.done = ready, done  # the host copy's wait, and its buffers' release
        self.started = False
        self.taken = False  # taken back while being written: delete it once written


class StashWriter:
    """Writes one rank's stashes into `store` on an I/O thread, at most `cap_bytes` in
    flight ([Note: background stash]). Methods are for one compute thread, except
    `wait_written` (any thread) and the properties."""

    def __init__(self, store: StashStore, cap_bytes: int,
                 staging: Callable[[LayerTensors], tuple[LayerTensors, Callable[[], None],
                                                         Callable[[], None]]] | None = None,
                 memory: Callable[[], tuple[int, int]] | None = None) -> None:
        """Args:
            store: where the stashes go.
            cap_bytes: the most bytes handed over and not yet written; 0: write in `put`.
            staging: copies a stash to host memory and returns (host tensors, wait for the
                copy, release the buffers); None: the tensors are in host memory already.
            memory: under a job's memory cap, returns (the rank's accounted bytes besides
                those in flight, the stash being handed over among them; the rank's
                limit): a put waits while those bytes plus the bytes in flight, its own
                among them, pass the limit. None: no memory cap.
        """
        if cap_bytes < 0:
            raise ValueError(f"stash in-flight cap {cap_bytes} must be >= 0")
        self.store, self.cap_bytes, self._staging = store, cap_bytes, staging
        self._memory = memory
        self._cond = threading.Condition()
        self._queue: OrderedDict[Key, _Pending] = OrderedDict()
        self._in_flight = 0
        self._handed = self._written = 0  # tickets: puts handed over, and finished
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def in_flight_bytes(self) -> int:
        """Bytes handed over and not yet in the store."""
        return self._in_flight

    @property
    def ticket(self) -> int:
        """The ticket of the last put handed over (0: none yet)."""
        return self._handed

    def put(self, step: int, microbatch: int, version: int, tensors: LayerTensors) -> float:
        """Hands one micro-batch's stash over; returns the seconds spent waiting for room.

        Raises:
            The error of an earlier write that failed (then nothing is handed over).
            StashFullError, CodecError, ValueError: with a cap of 0, as `StashStore.put`.
        """
        self.check()
        nbytes = stash_nbytes(tensors) if self._staging is not None else held_bytes(tensors)
        if self.cap_bytes == 0:
            started = time.perf_counter()
            self.store.put(step, microbatch, version, tensors)
            return time.perf_counter() - started
        # `held` counts this stash as the rank's own; it moves into the bytes in flight, and
        # the next forward's saved tensors take its place: room for both
        held, limit = self._memory() if self._memory is not None else (0, 0)
        started = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._in_flight == 0 or (
                self._in_flight + nbytes <= self.cap_bytes
                and (not limit or held + self._in_flight + nbytes <= limit)))
            blocked = time.perf_counter() - started
            self.check()
            self._in_flight += nbytes
        host, ready, done = (self._staging(tensors) if self._staging is not None
                             else (tensors, _nothing, _nothing))
        with self._cond:
            self._handed += 1
            self._queue[(step, microbatch)] = _Pending(self._handed, version, host, nbytes,
                                                       ready, done)
            self._cond.notify_all()
        self._start()
        return blocked

    def take_pending(self, step: int, microbatch: int) -> LayerTensors | None:
        """The stash of (step, micro-batch) if it is still handed over (see [Note:
        background stash]); None if there is none (written, or never handed over)."""
        with self._cond:
            pending = self._queue.get((step, microbatch))
            if pending is None or pending.taken:
                return None
            if pending.started:  # copied under the lock: the writer releases the buffers
                pending.taken = True  # only after it, under the lock
                return self._copy_of(pending)
            del self._queue[(step, microbatch)]
            self._in_flight -= pending.nbytes
            self._finished()
        out = self._copy_of(pending)
        pending.done()
        return out

    def _copy_of(self, pending: _Pending) -> LayerTensors:
        """The stash's tensors: the handed-over ones themselves, or copies of the staging
        buffers (which go back to their pool)."""
        pending.ready()
        return {i: {n: t.clone() if self._staging is not None else t for n, t in named.items()}
                for i, named in pending.tensors.items()}

    def is_written(self, ticket: int) -> bool:
        """Whether every put up to `ticket` was written, failed or dropped."""
        with self._cond:
            return self._written >= ticket or self._closed

    def wait_written(self, ticket: int) -> None:
        """Returns once every put up to `ticket` was written, failed or dropped."""
        with self._cond:
            self._cond.wait_for(lambda: self._written >= ticket or self._closed)

    def check(self) -> None:
        """Raises the error of the first write that failed."""
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Waits for every write handed over, then raises the first failure."""
        self.wait_written(self._handed)
        self.check()

    def close(self) -> None:
        """Drops the writes not started, waits for the one under way, ends the thread."""
        with self._cond:
            for pending in self._queue.values():
                if not pending.started:
                    pending.done()
            self._queue.clear()
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _finished(self) -> None:
        """After a put left the queue (under the lock): every ticket before the oldest one
        still queued is finished (a put taken back from the queue may finish before older
        ones)."""
        self._written = min((p.ticket for p in self._queue.values()),
                            default=self._handed + 1) - 1
        self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stash-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if self._closed:
                    return
                (step, microbatch), pending = next(iter(self._queue.items()))
                pending.started = True
            try:
                pending.ready()
                self.store.put(step, microbatch, pending.version, pending.tensors)
                if pending.taken:  # read back from the queue meanwhile: nobody takes it
                    self.store.release(step, microbatch, pending.version,
                                       {i: list(named) for i, named in pending.tensors.items()})
            except BaseException as error:  # raised on the compute thread (`check`)
                with self._cond:
                    self._error = self._error or error
            finally:
                with self._cond:
                    pending.done()
                    self._queue.pop((step, microbatch), None)
                    self._in_flight -= pending.nbytes
                    self._finished()


def _nothing() -> None:
    """The wait and release of a stash already in host memory."""
