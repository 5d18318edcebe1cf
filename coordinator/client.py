"""The Python client of a running coordinator: submit, follow, stop, fetch weights."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import torch

from pipefb.job.config import JobConfig
from protos import coordinator_pb2, coordinator_pb2_grpc, job_pb2, security, server, wire
from protos.convert import job_to_proto


class CoordinatorClient:
    """Wraps the Coordinator stub; every method raises grpc.RpcError from the server."""

    def __init__(self, address: str, settings: security.Security | None = None) -> None:
        """Connects to the coordinator at `address` with `settings` (default: the
        environment's, and the user token a local cluster left for `address`:
        `protos.security.client_settings`)."""
        self.address = address
        self._channel = server.channel(address, settings)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def submit(self, job: JobConfig) -> coordinator_pb2.JobStatus:
        """Submits a job; returns its first status (with the id the coordinator chose)."""
        return self.stub.SubmitJob(job_to_proto(job), timeout=60)

    def train(self, job_id: str) -> Iterator[coordinator_pb2.StepReport]:
        """Follows a job's step reports until it ends (ABORTED error if it fails)."""
        yield from self.stub.Train(coordinator_pb2.TrainRequest(job_id=job_id))

    def follow(self, job_id: str, reconnect_seconds: float = 0.0
               ) -> Iterator[coordinator_pb2.StepReport]:
        """Like `train`, but when the coordinator goes away (UNAVAILABLE) it waits up to
        `reconnect_seconds` for it to come back (a relaunched one resumes its journaled
        jobs) and follows on; each step is yielded once, in order.

        Raises:
            grpc.RpcError: the job failed (ABORTED), or the coordinator stayed away.
        """
        seen = -1
        while True:
            try:
                for report in self.train(job_id):
                    if report.step > seen:
                        seen = report.step
                        yield report
                return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or reconnect_seconds <= 0:
                    raise
                self._wait_for_job(job_id, reconnect_seconds, error)

    def _wait_for_job(self, job_id: str, timeout: float, error: grpc.RpcError) -> None:
        """Waits until the coordinator answers for the job again; re-raises `error` if it
        does not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                self.status(job_id)
                return
            except grpc.RpcError as again:
                if again.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
        raise error

    def status(self, job_id: str) -> coordinator_pb2.JobStatus:
        """The job's current status."""
        return self.stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=10)

    def stop(self, job_id: str) -> coordinator_pb2.JobStatus:
        """Asks the job to stop at the next step boundary."""
        return self.stub.StopJob(coordinator_pb2.StopJobRequest(job_id=job_id), timeout=10)

    def repartition(self, job_id: str, forward: list[int], backward: list[int] | None = None,
                    fail_ranks: list[int] | None = None) -> coordinator_pb2.JobStatus:
        """Moves the running job's layers to new partitions at its next step boundary
        (`fail_ranks`: fault injection for tests, those ranks fail the move)."""
        return self.stub.Repartition(coordinator_pb2.RepartitionRequest(
            job_id=job_id, forward_partition=forward, backward_partition=backward or [],
            fail_ranks=fail_ranks or []), timeout=10)

    def checkpoint(self, job_id: str, timeout: float = 600.0) -> coordinator_pb2.JobStatus:
        """Checkpoints the running job at its next step boundary; returns its status once
        the checkpoint is committed (`checkpointed` is the step a resume starts at)."""
        return self.stub.Checkpoint(coordinator_pb2.CheckpointJobRequest(job_id=job_id),
                                    timeout=timeout)

    def workers(self) -> list[coordinator_pb2.WorkerInfo]:
        """Registered workers."""
        return list(self.stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=10).workers)

    def weights(self, job_id: str) -> dict[str, torch.Tensor]:
        """The finished job's whole-model weights, named layers.{i}.{param}."""
        stream = self.stub.ExportWeights(job_pb2.ExportWeightsRequest(job_id=job_id), timeout=120)
        return wire.decode_stream(stream)[1]

    def wait_for_workers(self, count: int, timeout: float = 60.0) -> None:
        """Blocks until `count` workers are registered and alive."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                alive = sum(w.alive for w in self.workers())
            except grpc.RpcError:
                alive = 0
            if alive >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} of {count} workers alive after {timeout:.0f} s")
            time.sleep(0.1)
