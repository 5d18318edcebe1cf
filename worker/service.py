"""The StageWorker servicer: decodes requests, calls the stage runtime, encodes replies."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from dataplane.grpc_transport import GrpcTransport, inbox_key, nbytes, weight_key
from dataplane.inbox import Inbox
from offload_store import StashStore, open_store
from offload_store.local import LocalTier, local_tier_cap
from offload_store.staging import HostStaging
from offload_store.writer import STASH_IN_FLIGHT_BYTES, StashWriter
from pipefb import codec
from pipefb.allocator import release_freed_memory
from pipefb.errors import CodecError, ConfigError, WorkerFailed
from pipefb.job.config import JobConfig, job_device
from pipefb.plan.migration import takeover
from pipefb.plan.plan import Plan
from pipefb.plan.stashpath import (
    copies_on_compute_thread,
    fences_sends,
    stash_consumers,
    stash_producers,
    takes_back_own_stash,
)
from pipefb.profile.measure import measure_profile
from pipefb.runtime.allreduce import (
    GroupAllReduce,
    norm_rendezvous_key,
    rendezvous_key,
)
from pipefb.runtime.checkpoint import rank_file, resolve_under
from pipefb.runtime.manifest import verified_files
from pipefb.runtime.stage import StageRuntime
from pipefb.schedule import Kind
from protos import job_pb2, tensor_pb2, wire, worker_pb2, worker_pb2_grpc
from protos.convert import ProfileQuery, job_from_proto, plan_from_proto, profile_to_proto
from protos.server import FailedPrecondition
from worker.caller import Caller
from worker.metrics import WorkerMetrics
from worker.sidegroups import join_stats_group, join_tie_group
from worker.stepgate import StepGate
from worker.takeover import Source, buffers_of, local_part, migrate_stream, pull

log = logging.getLogger(__name__)

ACTIVATION_KINDS = (str(Kind.RECV_F), str(Kind.RECV_L))
HOP_KINDS = (*ACTIVATION_KINDS, str(Kind.RECV_B), str(Kind.RECV_W))  # a hop socket's
DRAIN_WAIT_SECONDS = 10.0  # how long Drain waits for a running step to reach an abort point
CHECKPOINT_WAIT_SECONDS = 30.0  # how long Checkpoint waits for the running step to end
DEADLINE_BACKSTOP_SECONDS = 1.0  # a Step's wait outlasts its caller's deadline by this
MAX_WAIT_SECONDS = 1e6  # a caller's deadline further off than this counts as none
MAX_LEAD = 2  # steps a transfer may be ahead of the receiving rank (sync leads by one)


def _write_in_background(transport: GrpcTransport, store: StashStore, runtime: StageRuntime,
                         cap: int, memory_cap: int, predicted: int) -> None:
    """Gives the transport its stash writer ([Note: background stash]), and on CUDA its
    staging copies ([Note: staging]). Under a job's memory cap (`memory_cap` > 0) on the
    cpu, a stash waits while the bytes in flight plus the rank's accounted memory would
    pass the rank's limit: its plan's `predicted` peak (0: none), which the planner held
    under the cap, else the cap. On CUDA the bytes in flight are in pinned host memory,
    outside the device's account (`StageRuntime._account`), so only `cap` bounds them."""
    device, account = runtime.device, runtime.memory
    limit = min(memory_cap, predicted) if predicted else memory_cap

    def memory() -> tuple[int, int]:  # the account as of the action before the STASH
        return account.total_besides("stash_in_flight"), limit

    if device.type == "cuda":
        transport.staging = HostStaging(device)
    transport.writer = StashWriter(store, cap, transport.staging.to_host
                                   if transport.staging is not None else None,
                                   memory if memory_cap and device.type == "cpu" else None)
    transport.fence_sends = fences_sends(runtime.topology, runtime.rank)


@dataclass
class Assigned:
    """The job rank this worker serves now."""

    job_id: str
    rank: int
    runtime: StageRuntime
    transport: GrpcTransport
    inbox: Inbox
    gate: StepGate
    reducer: GroupAllReduce | None = None  # with several groups, on ranks that own weights
    norm_reducer: GroupAllReduce | None = None  # with clipping, on owners ([Note: global norm])
    checkpoints: Path | None = None  # the job's checkpoint directory, when it takes any
    attempt: int = 0  # the job attempt; Step calls and transfers of any other are refused
    tie_reducer: GroupAllReduce | None = None  # owners of tied copies ([Note: tied parameters])


class StageWorkerServicer(worker_pb2_grpc.StageWorkerServicer):
    """One process, one job rank at a time; `metrics` (if any) sees every step."""

    def __init__(self, metrics: WorkerMetrics | None = None, checkpoint_root: str = "",
                 local_stash_bytes: int = -1, store_address: str = "",
                 stash_in_flight_bytes: int = STASH_IN_FLIGHT_BYTES,
                 local_tier: tuple[str, int] = ("", -1)) -> None:
        self.store_address = store_address  # the one store this worker stashes in (--store)
        # the node-local shared-memory tier's directory (empty: none) and cap (-1: the
        # default), [Note: local tier index] in offload_store/shm.py
        self.local_tier = local_tier
        self.local_stash_bytes = local_stash_bytes  # a combined rank's local tier cap; -1:
        # the device's default (`offload_store.local.local_tier_cap`)
        # the cap of stash bytes handed to the store's I/O thread and not yet written; 0:
        # the compute thread writes ([Note: background stash] in offload_store/writer.py)
        self.stash_in_flight_bytes = stash_in_flight_bytes
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # SIGTERM: long calls (Profile) end now
        self._assigned: Assigned | None = None
        self._source: Source | None = None  # a paused attempt peers may migrate from
        self.checkpoint_root = checkpoint_root  # checkpoints are written and read only here
        self.metrics = metrics

    def _current(self, job_id: str, attempt: int | None = None) -> Assigned:
        """The assignment of `job_id` (and of `attempt`, when given).

        [Note: attempt fencing] Each restart of a job assigns every rank again with
        attempt + 1; stash keys, Step calls and transfers carry the attempt, and a rank
        refuses those of any other. A worker that was stopped past the deadline and comes
        back (SIGCONT), or a stream still draining from before the restart, so cannot
        feed the replay: its sender gets FAILED_PRECONDITION and its stash keys are
        never read.
        """
        assigned = self._assigned
        if assigned is None or assigned.job_id != job_id:
            raise FailedPrecondition(f"job {job_id!r} is not assigned to this worker")
        if attempt is not None and attempt != assigned.attempt:
            log.warning("refused a call of attempt %d of job %s (this rank runs attempt %d)",
                        attempt, job_id, assigned.attempt)
            raise FailedPrecondition(f"attempt {attempt} of job {job_id!r} is over; this "
                                     f"worker runs attempt {assigned.attempt}")
        return assigned

    def Assign(self, request: worker_pb2.AssignRequest, context: grpc.ServicerContext
               ) -> worker_pb2.AssignReply:
        job = job_from_proto(request.job)
        plan = plan_from_proto(request.plan)
        if len(request.peers) != len(plan.assignment):
            raise ConfigError(f"{len(request.peers)} peer addresses for "
                              f"{len(plan.assignment)} ranks")
        with self._lock:
            self._check_not_stale(job.job_id, request.attempt)
        source = (self._keep_source(job.job_id, request.source.attempt, request.resume_step)
                  if request.HasField("source") else None)
        caller = Caller(context)  # checked between phases: [Note: callers that give up]
        what = f"Assign of job {job.job_id} rank {request.rank}"
        inbox = Inbox()
        private = takes_back_own_stash(plan, request.rank)  # [Note: private index]
        store = self._open_store(request, plan, job.job_id, private)
        transport = GrpcTransport(job.job_id, request.peers, store, inbox, request.attempt)
        reducer = _join_group(request, plan, job_device(job))
        try:
            norm_reducer = _join_norm_group(request, plan, job)
        except BaseException:
            if reducer is not None:
                reducer.close()
            raise
        runtime = StageRuntime(job, plan, request.rank, transport, reducer, norm_reducer)
        cap = local_tier_cap(self.local_stash_bytes, runtime.device)
        if runtime.role == "combined" and cap:  # [Note: local tier]
            transport.local = LocalTier(runtime.device, cap)
        if store is not None:
            runtime.node_tier_bytes = store.node_bytes
            if copies_on_compute_thread(private, bool(self.local_tier[0]),
                                        runtime.device.type):
                transport.prefetches = False  # [Note: copies on the compute thread]
            else:
                peaks = plan.predicted_peak_memory_bytes
                _write_in_background(transport, store, runtime, self.stash_in_flight_bytes,
                                     job.memory_cap, peaks[request.rank]
                                     if request.rank < len(peaks) else 0)
        takes = job.checkpoint_every or (request.resume_step and source is None) or (
            job.checkpoint_dir and self.checkpoint_root)  # Checkpoint on request writes there
        checkpoints = resolve_under(self.checkpoint_root, job.checkpoint_dir) if takes else None
        migrated = 0
        tie_reducer: GroupAllReduce | None = None
        try:
            caller.check(what)
            tie_reducer = join_tie_group(request, runtime)
            join_stats_group(request, runtime)  # [Note: group statistics]
            caller.check(what)
            if request.HasField("source"):
                migrated = self._take_over(request, plan, runtime, source)
            elif request.resume_step:
                assert checkpoints is not None
                # the files its manifest lists, each checked against it ([Note: manifests]);
                # a forward rank's file holds its buffers ([Note: buffer owners])
                runtime.restore(verified_files(checkpoints, request.resume_step,
                                               job.to_dict()), request.resume_step)
            caller.check(what)  # nothing is installed for a caller that left
            with self._lock:
                # a later attempt's Assign may have finished first (a rolled-back move)
                self._check_not_stale(job.job_id, request.attempt)
                self._drop("reassigned")
                self._assigned = Assigned(job.job_id, request.rank, runtime, transport, inbox,
                                          StepGate(request.resume_step), reducer,
                                          norm_reducer, checkpoints, request.attempt,
                                          tie_reducer)
        except BaseException as error:  # nothing of the refused assignment stays open
            if caller.gone.is_set():
                log.warning("%s: %s", what, error)
            transport.close()
            for group in (reducer, norm_reducer, tie_reducer, runtime.stats.reducer):
                if group is not None:
                    group.close()
            raise
        caller.finished()
        if self.metrics is not None:
            self.metrics.assigned(job.job_id, runtime.role)
        log.info("assigned job %s rank %d as %s (attempt %d, from step %d)", job.job_id,
                 request.rank, runtime.role, request.attempt, request.resume_step)
        return worker_pb2.AssignReply(role=runtime.role, actions=[str(a) for a in runtime.actions],
                                      parameter_bytes=runtime.param_bytes,
                                      migrated_bytes=migrated)

    def _open_store(self, request: worker_pb2.AssignRequest, plan: Plan, job_id: str,
                    private: bool) -> StashStore | None:
        """The job's stash in this worker's own store, as the job's store user; None for
        a job without a store ([Note: access] in protos/security.py). With the node-local
        tier it learns this rank, which rank takes each layer it stashes and which rank
        stashed each layer it takes ([Note: tier ranks] in offload_store/tierranks.py).

        Raises:
            PermissionError: the Assign names another store (nothing is sent there).
            FailedPrecondition: the job has a store and this worker none configured.
        """
        if not request.store_address:
            return None
        if request.store_address != self.store_address:
            if not self.store_address:
                raise FailedPrecondition(f"the job stashes in {request.store_address}; this "
                                         "worker has no store (--store, PIPEFB_STORE)")
            raise PermissionError(f"Assign names the store {request.store_address!r}; this "
                                  f"worker uses only its own, {self.store_address!r}")
        tier_dir, tier_bytes = self.local_tier
        return open_store(self.store_address, job_id, request.attempt,
                          username=request.store_user or None,
                          password=request.store_password or None,
                          local_tier_dir=tier_dir, local_tier_bytes=tier_bytes,
                          local_tier_ranks=len(request.peers),
                          local_tier_private=private, local_tier_rank=request.rank,
                          local_tier_consumers=stash_consumers(plan, request.rank),
                          local_tier_producers=stash_producers(plan, request.rank))

    def _check_not_stale(self, job_id: str, attempt: int) -> None:
        """Refuses an Assign of an attempt older than the one this worker runs (hold the
        lock)."""
        current = self._assigned
        if current is not None and current.job_id == job_id and current.attempt > attempt:
            raise FailedPrecondition(f"attempt {attempt} of job {job_id!r} is over; this "
                                     f"worker runs attempt {current.attempt}")

    def _keep_source(self, job_id: str, attempt: int, step: int) -> Source | None:
        """This worker's paused attempt `attempt` of `job_id` at step `step`, kept as the
        migration's source ([Note: migration, worker side]); None if it ran none."""
        with self._lock:
            if self._source is not None and self._source.matches(job_id, attempt):
                if self._source.step != step:
                    raise FailedPrecondition(f"attempt {attempt} of job {job_id!r} paused "
                                             f"at step {self._source.step}, not {step}")
                return self._source
            current = self._assigned
        if current is None or (current.job_id, current.attempt) != (job_id, attempt):
            return None
        if current.gate.horizon() != step or not current.gate.wait_idle(0):
            raise FailedPrecondition(f"attempt {attempt} of job {job_id!r} is not paused "
                                     f"at step {step} (it is at {current.gate.horizon()})")
        runtime = current.runtime
        forward = runtime.pending_weights(step) if runtime.role == "forward" else {}
        with self._lock:
            if self._source is None or not self._source.matches(job_id, attempt):
                self._source = Source(job_id, attempt, step, runtime, forward)
            return self._source

    def _take_over(self, request: worker_pb2.AssignRequest, plan: Plan,
                   runtime: StageRuntime, source: Source | None) -> int:
        """Restores every layer the new runtime holds from the paused attempt (its own
        source and its peers'); returns the bytes taken from peers. A fault injected for
        tests (`MigrationSource.fail`) raises after the layers arrived."""
        old = plan_from_proto(request.source.plan)
        wanted = takeover(old, plan, request.rank)
        parts, received = pull(request.peers, request.job.job_id, request.source.attempt,
                               request.resume_step, wanted, runtime.max_state_bytes)
        parts.insert(0, local_part(source, wanted))
        runtime.restore_parts(parts, request.resume_step,
                              f"migration at step {request.resume_step}")
        if request.source.fail:
            raise WorkerFailed(f"rank {request.rank}: migration fault injected for tests")
        log.info("rank %d took over layers %s at step %d: %d bytes from peers",
                 request.rank, sorted(set(wanted.owned) | set(wanted.kept)
                                      | {i for w, _ in wanted.pulls.values() for i in w}),
                 request.resume_step, received)
        return received

    def Migrate(self, request: worker_pb2.MigrateRequest, context: grpc.ServicerContext
                ) -> Iterator[tensor_pb2.TensorChunk]:
        current = self._assigned
        if current is not None and current.runtime.role == "forward" and (
                current.job_id, current.attempt) == (request.job_id, request.attempt):
            # a forward rank owns nothing; keeping it as a source would take its next
            # weight version out of its inbox, so it sends its forward layers' buffers
            # (`buffers_only`) from the paused runtime itself
            if not request.buffers_only:
                raise FailedPrecondition(f"rank {current.rank} is a forward rank; it owns no "
                                         "layers to migrate")
            if current.gate.horizon() != request.step or not current.gate.wait_idle(0):
                raise FailedPrecondition(f"attempt {request.attempt} of job "
                                         f"{request.job_id!r} is not paused at step "
                                         f"{request.step}")
            yield from migrate_stream(request.job_id, request.attempt, request.step,
                                      buffers_of(current.runtime, request.layers))
            return
        source = self._keep_source(request.job_id, request.attempt, request.step)
        if source is None:
            raise FailedPrecondition(f"attempt {request.attempt} of job {request.job_id!r} "
                                     "did not run here")
        yield from source.stream(request)

    def Step(self, request: worker_pb2.StepRequest, context: grpc.ServicerContext
             ) -> worker_pb2.StepReply:
        assigned = self._current(request.job_id, request.attempt)
        if self._source is not None:  # a later attempt runs: no rollback needs it now
            with self._lock:
                self._source = None
        caller = Caller(context)  # [Note: callers that give up]
        caller.on_gone(assigned.gate.wake)
        try:
            # the caller's deadline ends the wait through `gone` (gRPC tells it first);
            # the wait's own timeout is the backstop, a moment later
            left = _time_left(context)
            wait = None if left is None else left + DEADLINE_BACKSTOP_SECONDS
            with assigned.gate.turn(request.step, wait, caller.gone.is_set):
                # the step runs for its caller only: once it left, the step's waits end
                caller.on_gone(lambda: _abort_step(assigned, request.step))
                r = assigned.runtime.run_step(request.step, request.checkpoint)
                saved = None
                if request.checkpoint and assigned.runtime.saves_checkpoints:
                    if assigned.checkpoints is None:
                        raise FailedPrecondition(f"job {request.job_id!r} takes no checkpoints")
                    saved = _save(assigned, request.step + 1)
        finally:
            caller.finished()
        if self.metrics is not None:
            store = assigned.transport.store
            self.metrics.step(assigned.job_id, assigned.runtime.role, r,
                              store.stats if store is not None else None)
        return worker_pb2.StepReply(
            step=r.step, losses=r.losses, compute_seconds=r.compute_seconds,
            idle_seconds=r.idle_seconds, memory_bytes=r.memory_bytes,
            peak_memory_bytes=r.peak_memory_bytes, bytes_sent=r.bytes_sent,
            bytes_stashed=r.bytes_stashed, weight_version=r.weight_version,
            action_seconds=r.action_seconds,
            spans=[worker_pb2.ActionSpan(action=a, start=s, end=e) for a, s, e in r.spans],
            versions=[worker_pb2.VersionTag(action=a, step=t, version=v)
                      for a, t, v in r.versions],
            kept_versions=r.kept_versions, kind_peak_bytes=r.kind_peak_bytes,
            activation_peak_bytes=r.activation_peak_bytes,
            device_memory_bytes=r.device_memory_bytes, weights_digest=r.weights_digest,
            layer_seconds=r.layer_seconds, metrics=r.metrics, checkpoint_file=saved, lr=r.lr,
            grad_norm=r.grad_norm, skipped=r.skipped, tied_digests=r.tied_digests,
            loss_scale=r.loss_scale,
        )

    def Checkpoint(self, request: worker_pb2.CheckpointRequest, context: grpc.ServicerContext
                   ) -> worker_pb2.CheckpointReply:
        assigned = self._current(request.job_id, request.attempt)
        if assigned.checkpoints is None:
            raise FailedPrecondition(f"job {request.job_id!r} takes no checkpoints")
        left = _time_left(context)  # the caller's deadline, if sooner
        wait = CHECKPOINT_WAIT_SECONDS if left is None else min(left, CHECKPOINT_WAIT_SECONDS)
        with assigned.gate.between(request.step, wait):
            if not assigned.runtime.saves_checkpoints:
                return worker_pb2.CheckpointReply(saved=False)
            saved = _save(assigned, request.step)
        return worker_pb2.CheckpointReply(saved=True, file=saved)

    def _check(self, transfer: tensor_pb2.Transfer, kinds: tuple[str, ...]) -> Assigned:
        """The rank a received transfer is for, after checking it belongs here."""
        if transfer.kind not in kinds:
            raise CodecError(f"transfer kind {transfer.kind!r} is not one of {kinds}")
        assigned = self._current(transfer.job_id, transfer.attempt)
        plan = assigned.runtime.plan
        if transfer.kind != str(Kind.RECV_W) and not 0 <= transfer.microbatch < plan.microbatches:
            raise CodecError(
                f"microbatch {transfer.microbatch} is not in 0..{plan.microbatches - 1}")
        # [Note: receive window] In sync mode a rank leads its peers by at most one step,
        # so anything outside [horizon, horizon + MAX_LEAD] is stale or hostile; refusing
        # it bounds what the inbox can hold. Async PipeFB lets forward ranks run
        # `staleness` steps further ahead, and a weight version v serves step
        # v + staleness, so the window widens by the staleness.
        lag = plan.staleness
        step = (transfer.version + lag if transfer.kind == str(Kind.RECV_W)
                else transfer.step)
        low = assigned.gate.horizon()
        high = low + MAX_LEAD + lag
        if not low <= step <= high:
            raise CodecError(f"step {step} is outside this rank's window {low}..{high}")
        return assigned

    def _deliver(self, messages: Iterator[tensor_pb2.TensorChunk], kinds: tuple[str, ...],
                 context: grpc.ServicerContext) -> tensor_pb2.Ack:
        """Puts every transfer of a (long-lived) stream into the inbox as it completes;
        ends once its sender gave up ([Note: callers that give up])."""
        caller = Caller(context)
        total, count = 0, 0
        for transfer, tensors in wire.decode_transfers(messages, max_bytes=self.receive_limit()):
            caller.check(f"the {transfer.kind} stream of job {transfer.job_id}")
            self._accept(transfer, tensors, kinds)
            total += nbytes(tensors)
            count += len(tensors)
        caller.finished()
        return tensor_pb2.Ack(bytes=total, tensors=count)

    def receive_limit(self) -> int:
        """The largest tensor a peer may make this worker allocate now: the largest this
        rank can expect."""
        current = self._assigned
        return current.runtime.max_receive_bytes if current else codec.CHUNK_BYTES

    def deliver_hop(self, transfer: tensor_pb2.Transfer, tensors: dict[str, torch.Tensor]
                    ) -> None:
        """Checks a transfer from a same-host peer's hop socket and puts it into the inbox
        ([Note: local hops] in dataplane/localhop.py); one connection carries every kind."""
        self._accept(transfer, tensors, HOP_KINDS)

    def _accept(self, transfer: tensor_pb2.Transfer, tensors: dict[str, torch.Tensor],
                kinds: tuple[str, ...]) -> None:
        """Puts one decoded transfer into the inbox after checking it belongs here."""
        assigned = self._check(transfer, kinds)
        stage = 0 if transfer.kind == str(Kind.RECV_W) else transfer.stage
        assigned.runtime.check_received(transfer.kind, stage, tensors)
        if transfer.kind == str(Kind.RECV_W):
            for name, tensor in tensors.items():
                assigned.inbox.put(weight_key(transfer.version, name), {name: tensor})
        else:
            assigned.inbox.put(inbox_key(transfer.kind, transfer.step, transfer.stage,
                                         transfer.microbatch), tensors)
        if self.metrics is not None:
            self.metrics.received_grpc(transfer.job_id, nbytes(tensors))

    def Activations(self, request_iterator: Iterator[tensor_pb2.TensorChunk],
                    context: grpc.ServicerContext) -> tensor_pb2.Ack:
        return self._deliver(request_iterator, ACTIVATION_KINDS, context)

    def Gradients(self, request_iterator: Iterator[tensor_pb2.TensorChunk],
                  context: grpc.ServicerContext) -> tensor_pb2.Ack:
        return self._deliver(request_iterator, (str(Kind.RECV_B),), context)

    def Weights(self, request_iterator: Iterator[tensor_pb2.TensorChunk],
                context: grpc.ServicerContext) -> tensor_pb2.Ack:
        return self._deliver(request_iterator, (str(Kind.RECV_W),), context)

    def ExportWeights(self, request: job_pb2.ExportWeightsRequest,
                      context: grpc.ServicerContext) -> Iterator[tensor_pb2.TensorChunk]:
        assigned = self._current(request.job_id)
        runtime = assigned.runtime
        if request.version:
            try:
                weights = runtime.take_eval_weights(request.version)
            except KeyError as error:
                raise FailedPrecondition(str(error.args[0])) from None
        else:
            weights = runtime.owned_weights()
        transfer = tensor_pb2.Transfer(job_id=request.job_id,
                                       version=request.version or runtime.version,
                                       microbatch=-1, kind="EXPORT")
        yield from wire.encode_stream(transfer, weights)

    def Profile(self, request: worker_pb2.ProfileRequest, context: grpc.ServicerContext
                ) -> worker_pb2.ProfileReply:
        query = ProfileQuery.from_proto(request)
        gone = threading.Event()  # set by gRPC when the call ends: deadline, cancel
        if not context.add_callback(gone.set):
            gone.set()
        try:  # stops once the caller is gone or the worker stops (two flags, no gRPC lock)
            profile = measure_profile(
                query.job, query.microbatch_size, query.layers, query.warmup, query.repeats,
                cancelled=lambda: gone.is_set() or self._stopping.is_set())
        finally:
            release_freed_memory()  # the model, data and activations it timed are gone
        return profile_to_proto(profile, torch.get_num_threads())

    def Drain(self, request: worker_pb2.DrainRequest, context: grpc.ServicerContext
              ) -> worker_pb2.DrainReply:
        with self._lock:
            current = self._assigned
            if (current is None or current.job_id != request.job_id
                    or current.attempt > request.attempt):  # a late Drain of an older attempt
                return worker_pb2.DrainReply(drained=False)
            self._drop(request.reason or "drained")
            self._source = None
        return worker_pb2.DrainReply(drained=True)

    def stop(self) -> None:
        """The process is stopping (SIGTERM): a running step ends now with ABORTED, since
        its peers may be gone and nothing else would wake a receive (before its timeout)."""
        self._stopping.set()
        with self._lock:
            self._drop("the worker is stopping")

    def _drop(self, reason: str) -> None:
        """Aborts the job's waits, lets a running step stop (bounded), then forgets it."""
        if self._assigned is not None:
            log.info("dropping job %s: %s", self._assigned.job_id, reason)
            self._assigned.runtime.stop(reason)  # a computing step ends at its next action
            self._assigned.inbox.abort(reason)
            self._assigned.gate.abort(reason)
            if not self._assigned.gate.wait_idle(DRAIN_WAIT_SECONDS):
                log.warning("a step of job %s still runs after %.0f s", self._assigned.job_id,
                            DRAIN_WAIT_SECONDS)
            self._assigned.transport.close()
            for group in (self._assigned.reducer, self._assigned.norm_reducer,
                          self._assigned.tie_reducer, self._assigned.runtime.stats.reducer):
                if group is not None:
                    group.close()
            self._assigned = None


def _abort_step(assigned: Assigned, step: int) -> None:
    """Ends the running `step` (its caller gave up): the step raises Aborted at its next
    action or receive, whichever comes first, and as any failed step it lets no later step
    of the attempt run."""
    reason = f"step {step} stopped: its caller gave up (deadline passed or cancelled)"
    log.warning("job %s rank %d: %s", assigned.job_id, assigned.rank, reason)
    assigned.runtime.stop(reason)
    assigned.inbox.abort(reason)
    assigned.gate.abort(reason)


def _time_left(context: grpc.ServicerContext) -> float | None:
    """Seconds to the caller's deadline; None without one (gRPC then reports a time far
    beyond what a wait's timeout may be)."""
    left: float | None = context.time_remaining()
    return None if left is None or left > MAX_WAIT_SECONDS else max(0.0, left)


def _join_group(request: worker_pb2.AssignRequest, plan: Plan, device: torch.device
                ) -> GroupAllReduce | None:
    """With several groups, a rank that owns a backward stage joins that stage's all-reduce
    group (one rank per group) at the coordinator's rendezvous; blocks until all have."""
    if plan.groups == 1:
        return None
    mine = [a for a in plan.assignment if a.rank == request.rank]
    if not mine:
        raise ConfigError(f"rank {request.rank} is not in the plan")
    if mine[0].role == "forward":
        return None
    if not request.rendezvous:
        raise ConfigError(f"a plan of {plan.groups} groups needs a rendezvous address")
    key = rendezvous_key(request.job.job_id, request.attempt, mine[0].stage)
    own_host = request.peers[request.rank].rpartition(":")[0]
    return GroupAllReduce(request.rendezvous, key, mine[0].group, plan.groups, device,
                          bind_host=own_host)


def _save(assigned: Assigned, step: int) -> worker_pb2.CheckpointFile:
    """Writes this rank's file of the checkpoint of `step`; returns what the manifest
    records of it ([Note: manifests] in pipefb/runtime/manifest.py)."""
    assert assigned.checkpoints is not None
    path = rank_file(assigned.checkpoints, step, assigned.rank)
    digest = assigned.runtime.save_checkpoint(path)
    return worker_pb2.CheckpointFile(name=path.name, sha256=digest.sha256, bytes=digest.size)
def _join_norm_group(request: worker_pb2.AssignRequest, plan: Plan, job: JobConfig
                     ) -> GroupAllReduce | None:
    """With gradient clipping, a weight owner joins the norm exchange of its group: the
    owners of every backward stage of that group ([Note: global norm] in
    pipefb.runtime.clipping); None for a forward rank or a group with one stage. Every
    owner joins it after its stage's group, so no two owners wait on each other's
    first join."""
    if not job.clip_grad_norm and job.precision != "fp16":  # fp16: [Note: loss scaling]
        return None
    mine = next((a for a in plan.assignment if a.rank == request.rank), None)
    if mine is None:
        raise ConfigError(f"rank {request.rank} is not in the plan")
    stages = len({a.stage for a in plan.assignment
                  if a.group == mine.group and a.role != "forward"})
    if mine.role == "forward" or stages == 1:
        return None
    if not request.rendezvous:
        raise ConfigError("gradient clipping and fp16 across stages need a rendezvous "
                          "address")
    key = norm_rendezvous_key(request.job.job_id, request.attempt, mine.group)
    own_host = request.peers[request.rank].rpartition(":")[0]
    return GroupAllReduce(request.rendezvous, key, mine.stage, stages, job_device(job),
                          bind_host=own_host)
