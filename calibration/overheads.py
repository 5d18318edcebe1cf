"""The overhead probes: what a step and its actions cost beyond their own work.

- **action and step** (`overheads.action`, `overheads.step`): `action` is the median gap
  between consecutive actions of a real `StageRuntime` step (clocks, span label, memory
  accounting); `step` is a unary RPC round trip to the echo peer's server plus what
  `run_step` spends outside its actions (flush, report).
- **CPU of a step call** (`overheads.step_cpu`): the real `StepPump` drives
  `Settings.step_calls` Step calls on the echo peer, which answers with a reply shaped as
  a worker's (`calibration.links.probe_reply`); the CPU of both processes over the calls,
  per call. On a loopback host the simulator runs it beside each rank's step ([Note: step
  calls] in pipefb.sim.engine).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence

import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from calibration.cpu import CpuMeter
from calibration.settings import JOB, PROBE_TIMEOUT_S, CalibrationError
from coordinator.stepping import StepPump
from protos import server, worker_pb2, worker_pb2_grpc


class _NoPeers:
    """The transport of a one-rank job that keeps every tensor: nothing to send."""

    def flush(self) -> int:
        """No sends, no bytes."""
        return 0

    def held_bytes(self) -> int:
        """No stash."""
        return 0

    def in_flight_bytes(self) -> int:
        """No stash."""
        return 0


def runtime_overheads(steps: int) -> tuple[float, float]:
    """(per action, per step) seconds a real StageRuntime spends outside its actions,
    running a one-rank gpipe step of a tiny mlp."""
    from pipefb.job.checks import check_job
    from pipefb.job.config import JobConfig
    from pipefb.plan.partition import balanced_plan
    from pipefb.runtime.stage import StageRuntime

    job = JobConfig(model="mlp", dataset="synthetic", loss="mse", schedule="gpipe", workers=1,
                    batch_size=4, microbatches=4, steps=steps, optimizer="sgd",
                    model_config={"in_features": 8, "hidden": 8, "depth": 2},
                    dataset_config={"in_features": 8})
    plan = balanced_plan("gpipe", 1, check_job(job), job.batch_size, job.microbatches)
    with torch.random.fork_rng(devices=[]):  # the runtime seeds torch's global generator
        runtime = StageRuntime(job, plan, 0, _NoPeers())  # type: ignore[arg-type]
        gaps, rest = [], []
        for step in range(steps):
            started = time.time()  # the clock of the runtime's spans
            spans = runtime.run_step(step).spans
            ended = time.time()
            gaps += [b[1] - a[2] for a, b in itertools.pairwise(spans)]
            rest.append(ended - started - (spans[-1][2] - spans[0][1]))
    action = max(0.0, statistics.median(gaps))
    return action, max(0.0, statistics.median(rest) - action)  # the last action's gap


def step_cpu(address: str, calls: int, pids: Sequence[int]) -> float:
    """CPU seconds of one Step call as the coordinator makes it (`StepPump`, one rank) to
    the peer's `Step`, both processes together; 0 where /proc cannot tell."""
    meter = CpuMeter(pids)
    with server.channel(address) as channel:
        stub = worker_pb2_grpc.StageWorkerStub(channel)
        stub.Step(worker_pb2.StepRequest(job_id=JOB), timeout=PROBE_TIMEOUT_S)  # connects
        pump = StepPump(JOB, [stub], calls, lambda step, replies, seconds: None)
        with meter.span():
            failures = pump.run(lambda: None)
    if failures:
        raise CalibrationError(f"Step probe failed: {failures[0][1]}")
    return meter.cpu / calls if meter.readable else 0.0


def rpc_round_trip(address: str, repeats: int) -> float:
    """Median seconds of a unary RPC (health Check) to a StageWorker-style server."""
    with server.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        times = []
        for _ in range(repeats + 1):  # the first call also connects
            started = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
