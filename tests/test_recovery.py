"""Recovery with real processes killed or stopped by pid ([Note: restarts] in
coordinator/recovery.py): the local cluster relaunches what dies, as Kubernetes restarts a
pod, and the job replays from its newest checkpoint to the weights an uninterrupted run
trains, leaving no stash key behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coordinator.client import CoordinatorClient
from pipefb.app.local import LocalServices
from pipefb.job.config import JobConfig
from pipefb.runtime.checkpoint import rank_file
from pipefb.runtime.manifest import committed
from pipefb.runtime.reference import SingleProcess
from protos.coordinator_pb2 import DONE, FAILED, RECOVERING, RUNNING, STOPPED
from tests.conftest import WORKER_THREADS, store_client, worker_threads
from tests.test_faults import ROOT, finish
from tests.test_transparency import make_job, reference

HEARTBEAT_DEADLINE_S = 5.0  # the coordinator's default heartbeat timeout
STEPS = 120  # long enough that a kill after a few steps lands mid-run


@pytest.fixture(scope="module")
def restarting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServices]:
    """Redis, a coordinator and 4 workers that are relaunched when they die."""
    root = tmp_path_factory.mktemp("recovery-checkpoints")
    with LocalServices(4, tmp_path_factory.mktemp("recovery"), threads=WORKER_THREADS,
                      extra_env={"PIPEFB_CHECKPOINT_ROOT": str(root)}, restart=True) as cluster:
        cluster.checkpoint_root = root  # type: ignore[attr-defined]
        yield cluster


@pytest.fixture(scope="module")
def client(restarting: LocalServices) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(restarting.coordinator) as c:
        c.wait_for_workers(4)
        yield c


def recoverable_job(name: str, **extra: Any) -> JobConfig:
    """A sync PipeFB job (2 forward, 2 backward ranks) that checkpoints every 5 steps and
    may restart twice."""
    fields: dict[str, Any] = {"steps": STEPS, "checkpoint_every": 5, "checkpoint_dir": name,
                              "max_restarts": 2, "job_id": name, **extra}
    return make_job("mlp", "pipefb", 4, "sgd", **fields)


def wait_for(client: CoordinatorClient, job_id: str, done: Callable[[Any], bool],
             timeout: float = 120.0) -> Any:
    """Polls the job's status until `done(status)`; returns that status."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status(job_id)
        if done(status):
            return status
        assert time.monotonic() < deadline, f"job {job_id} stuck: {status}"
        time.sleep(0.05)


def running_at(client: CoordinatorClient, job_id: str, step: int, attempt: int = 0) -> Any:
    """Waits until the job's attempt `attempt` runs and has reported `step` steps."""
    return wait_for(client, job_id, lambda s: s.attempt == attempt and s.step >= step
                    and s.state == RUNNING)


def finished(client: CoordinatorClient, job_id: str) -> Any:
    return wait_for(client, job_id, lambda s: s.state in (DONE, FAILED, STOPPED), timeout=300)


def assert_trained_as_uninterrupted(client: CoordinatorClient, job: JobConfig,
                                    reports: list[Any]) -> None:
    """The reports (from some step to the last) have the losses of one process's run of
    the job, and the job's final weights equal its weights bit for bit."""
    first = reports[0].step
    assert [r.step for r in reports] == list(range(first, job.steps))
    want_losses, want_weights = reference(replace(job, checkpoint_every=0, checkpoint_dir="",
                                                  max_restarts=0))
    assert [r.loss for r in reports] == pytest.approx(want_losses[first:], rel=1e-6)
    got = client.weights(job.job_id)
    assert sorted(got) == sorted(want_weights)
    for name, want in want_weights.items():
        assert got[name].equal(want), name  # bit for bit: sync replay from the checkpoint


def assert_equals_uninterrupted(client: CoordinatorClient, restarting: LocalServices,
                                job: JobConfig, status: Any) -> None:
    """The job finished after one restart, trained what one process trains, reported
    each step once, and left no key of any attempt in the store."""
    assert status.state == DONE, status.error
    assert status.attempt == 1 and len(status.restarts) == 1
    reports = list(client.train(job.job_id))
    assert reports[0].step == 0
    assert_trained_as_uninterrupted(client, job, reports)
    assert not list(store_client(restarting).scan_iter(match=f"pipefb:{job.job_id}:*"))
    assert restarting.tier_dir is not None  # no segment of any attempt left in the tier
    assert not list(restarting.tier_dir.glob(f"{job.job_id}+*/[0-9]*.seg"))


@pytest.mark.parametrize("victim", ["worker-0", "worker-3"])
def test_a_killed_worker_is_relaunched_and_the_job_replays_to_the_same_weights(
        client: CoordinatorClient, restarting: LocalServices, victim: str) -> None:
    """worker-0 runs forward stage 0, worker-3 backward stage 0 (it receives the gradient
    stream of backward stage 1); each is SIGKILLed mid-run."""
    job = recoverable_job(f"kill-{victim}")
    client.submit(job)
    running_at(client, job.job_id, 8)
    os.kill(restarting.process(victim).pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert victim in status.restarts[0] and "died" in status.restarts[0]
    assert restarting.relaunches.get(victim, 0) >= 1
    assert_equals_uninterrupted(client, restarting, job, status)


def test_a_replay_passes_over_damaged_checkpoints_to_the_newest_intact_one(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """worker-2 is stopped (no step ends, nothing commits), a byte is flipped in every
    checkpoint after the first, and the worker is killed: the replay names each one it
    passed over, starts from step 5 and ends with the uninterrupted run's weights.
    (worker-2: a later test counts worker-1's relaunches.)"""
    job = recoverable_job("damaged-replay")
    client.submit(job)
    running_at(client, job.job_id, 12)
    victim = restarting.process("worker-2")
    os.kill(victim.pid, signal.SIGSTOP)
    time.sleep(0.5)  # a commit under way ends
    root = restarting.checkpoint_root / job.checkpoint_dir  # type: ignore[attr-defined]
    damaged = [m.step for m in committed(root) if m.step > 5]
    assert damaged
    for step in damaged:
        path = rank_file(root, step, 2)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    os.kill(victim.pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert status.start_step == 5
    assert list(status.refused_checkpoints) == [
        f"step {s}: rank-2.safetensors does not match the SHA-256 in its manifest (altered "
        "or torn)" for s in damaged]
    assert_equals_uninterrupted(client, restarting, job, status)


def test_a_store_restarted_empty_replays_the_lost_steps(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    job = recoverable_job("kill-redis")
    client.submit(job)
    running_at(client, job.job_id, 8)
    os.kill(restarting.process("redis").pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert "offload store" in status.restarts[0]
    assert_equals_uninterrupted(client, restarting, job, status)


def test_a_stopped_worker_is_declared_dead_in_time_and_its_return_is_fenced(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """SIGSTOP past the heartbeat deadline: the job notices within the deadline plus a
    margin (no hang) and waits for a replacement; after SIGCONT the same worker registers
    again and the replay finishes with the uninterrupted run's weights."""
    job = recoverable_job("stop-worker-1")
    client.submit(job)
    running_at(client, job.job_id, 8)
    victim = restarting.process("worker-1")
    os.kill(victim.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(client, job.job_id, lambda s: s.state == RECOVERING,
                 timeout=HEARTBEAT_DEADLINE_S + 10)
        noticed = time.monotonic() - stopped
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    print(f"a worker stopped by SIGSTOP was noticed after {noticed:.1f} s")
    assert noticed < HEARTBEAT_DEADLINE_S + 10
    status = finished(client, job.job_id)
    assert "worker-1" in status.restarts[0]
    assert restarting.relaunches.get("worker-1", 0) == 0  # the same process came back
    assert_equals_uninterrupted(client, restarting, job, status)


def test_a_crash_loop_ends_the_job_after_max_restarts(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    job = recoverable_job("crash-loop", steps=STEPS)
    client.submit(job)
    for attempt in range(job.max_restarts + 1):
        running_at(client, job.job_id, 0, attempt)
        os.kill(restarting.process("worker-2").pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert status.state == FAILED
    assert status.attempt == 2 and len(status.restarts) == 2
    assert "worker-2" in status.error and "gave up after 2 restarts" in status.error
    assert not list(store_client(restarting).scan_iter(match=f"pipefb:{job.job_id}:*"))
    client.wait_for_workers(4)  # the cluster serves the next job


def test_without_restarts_a_job_still_fails_on_the_first_death(
        client: CoordinatorClient, restarting: LocalServices, tmp_path: Path) -> None:
    job = replace(recoverable_job("no-restarts"), max_restarts=0)
    client.submit(job)
    running_at(client, job.job_id, 3)
    os.kill(restarting.process("worker-1").pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert status.state == FAILED and status.attempt == 0
    assert "worker-1" in status.error and "died" in status.error
    client.wait_for_workers(4)


def with_the_coordinator_killed(client: CoordinatorClient, restarting: LocalServices,
                                job: Any) -> Any:
    """Submits `job`, SIGKILLs the coordinator once step 12 runs, and returns the job's
    status once the relaunched coordinator (same address and journal) has finished it:
    DONE in attempt 1, its one restart the coordinator's."""
    client.submit(job)
    running_at(client, job.job_id, 12)
    os.kill(restarting.process("coordinator").pid, signal.SIGKILL)
    time.sleep(1.0)
    client.wait_for_workers(4, timeout=120)
    status = finished(client, job.job_id)
    assert status.state == DONE, status.error
    assert status.attempt == 1 and status.restarts == ["the coordinator restarted"]
    return status


def test_a_killed_coordinator_is_relaunched_and_resumes_its_job_from_the_journal(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """The relaunched coordinator (same address, same journal) resumes the job with
    attempt + 1 from its newest checkpoint; the workers register again; the steps from
    that checkpoint on are reported and everything equals the uninterrupted run."""
    job = recoverable_job("kill-coordinator")
    with_the_coordinator_killed(client, restarting, job)
    reports = list(client.follow(job.job_id))
    first = reports[0].step
    assert first >= 10 and first % 5 == 0  # the newest checkpoint before the kill
    assert_trained_as_uninterrupted(client, job, reports)
    assert not list(store_client(restarting).scan_iter(match=f"pipefb:{job.job_id}:*"))
    assert not list((restarting.log_dir / "journal").glob("*.json"))  # finished: forgotten


def drained_and_resumed(client: CoordinatorClient, restarting: LocalServices,
                        job: JobConfig) -> list[Any]:
    """Submits `job`, SIGTERMs the coordinator once the job runs at step 12 (it must
    exit 0), and returns the step reports of the relaunched coordinator's run of it,
    which must end DONE."""
    client.submit(job)
    running_at(client, job.job_id, 12)
    old = restarting.process("coordinator")
    old.popen.send_signal(signal.SIGTERM)
    assert old.popen.wait(timeout=30) == 0
    time.sleep(1.0)
    client.wait_for_workers(4, timeout=120)
    status = finished(client, job.job_id)
    assert status.state == DONE, status.error
    return list(client.follow(job.job_id))


def test_a_sigtermed_coordinator_drains_checkpoints_and_its_successor_resumes(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """SIGTERM: the running steps end, every owner saves a checkpoint at that step (not
    a multiple of checkpoint_every), the coordinator exits 0 with the job journaled, and
    the relaunched one resumes from exactly that step: no step is lost or run twice."""
    job = recoverable_job("drain", checkpoint_every=100)
    reports = drained_and_resumed(client, restarting, job)
    first = reports[0].step
    assert first >= 12 and first % 100  # the drain's own checkpoint, not a periodic one
    root = restarting.checkpoint_root  # type: ignore[attr-defined]
    assert (root / "drain" / f"step-{first:06d}" / "manifest.json").is_file()
    assert_trained_as_uninterrupted(client, job, reports)


def test_a_heartbeat_under_an_id_a_restarted_coordinator_gave_another_worker_is_unknown(
) -> None:
    """A restarted coordinator numbers workers from 0 again: a worker still heartbeating
    with its old id must not keep another worker's record alive; it registers anew."""
    from coordinator.registry import Registry

    registry = Registry()
    first = registry.register("127.0.0.1:1001", "worker-0")
    assert registry.heartbeat(first, "127.0.0.1:1001")
    assert not registry.heartbeat(first, "127.0.0.1:1002")  # the other worker's old id
    assert not registry.heartbeat(first + 1, "127.0.0.1:1002")


def killed_and_replayed(client: CoordinatorClient, restarting: LocalServices, job: JobConfig
                        ) -> tuple[list[Any], list[Any]]:
    """Runs `job` with worker-3 (backward stage 0) SIGKILLed at step 8, checks the replay
    ends as the uninterrupted run does; one process's steps and the job's step reports."""
    client.submit(job)
    running_at(client, job.job_id, 8)
    os.kill(restarting.process("worker-3").pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert_equals_uninterrupted(client, restarting, job, status)
    with worker_threads():
        want = list(SingleProcess(replace(job, schedule="single", checkpoint_every=0,
                                          checkpoint_dir="", max_restarts=0)).run())
    reports = list(client.train(job.job_id))
    return want, reports


def test_a_clipped_scheduled_job_replays_with_the_lr_and_norm_of_each_step(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """worker-3 owns backward stage 0 and takes part in the norm exchange; killed mid-run,
    the replay from the checkpoint sets each step's lr from its number and exchanges the
    norms in the new attempt's group ([Note: global norm] in pipefb/runtime/clipping.py)."""
    job = recoverable_job("kill-clipped", lr_schedule="cosine", warmup_steps=10,
                          min_lr=0.001, clip_grad_norm=0.05)
    want, reports = killed_and_replayed(client, restarting, job)
    assert [r.lr for r in reports] == [s.lr for s in want]
    assert [r.grad_norm for r in reports] == [s.grad_norm for s in want]


def test_a_recovered_fp16_job_replays_with_the_loss_scale_of_its_checkpoint(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """worker-3 owns backward stage 0; killed mid-run, the replay takes the loss scale and
    its growth tracker from the checkpoint's rank files ([Note: loss scaling] in
    pipefb/runtime/lossscale.py): the same steps overflow and are skipped as in one
    process with torch's GradScaler, and the weights are the uninterrupted run's."""
    job = recoverable_job("kill-fp16", precision="fp16", initial_loss_scale=2.0**20,
                          loss_scale_window=2)
    want, reports = killed_and_replayed(client, restarting, job)
    assert any(s.skipped for s in want[10:]) and not all(s.skipped for s in want)
    assert [r.skipped for r in reports] == [s.skipped for s in want]
    assert [r.loss_scale for r in reports] == [s.loss_scale for s in want]


def pipedream_job(name: str) -> JobConfig:
    """An async PipeDream job (4 combined ranks) that checkpoints every 5 steps and may
    restart twice."""
    return make_job("mlp", "pipedream", 4, "sgd", steps=STEPS, checkpoint_every=5,
                    checkpoint_dir=name, max_restarts=2, job_id=name)


def uninterrupted(client: CoordinatorClient, job: JobConfig
                  ) -> tuple[list[Any], dict[str, Any]]:
    """The step reports and final weights of the job run without a failure (its own id
    and checkpoint directory)."""
    whole = replace(job, job_id=f"whole-{job.job_id}", checkpoint_dir=f"whole-{job.job_id}",
                    max_restarts=0)
    reports = list(client.train(client.submit(whole).job_id))
    return reports, client.weights(whole.job_id)


def assert_equals_run(client: CoordinatorClient, job: JobConfig, reports: list[Any],
                      want: list[Any], want_weights: dict[str, Any]) -> None:
    """The reports (from some step to the last) have the losses of the uninterrupted run
    `want` and the job's final weights equal `want_weights`, bit for bit."""
    first = reports[0].step
    assert [r.step for r in reports] == list(range(first, job.steps))
    assert [r.loss for r in reports] == [r.loss for r in want[first:]]
    got = client.weights(job.job_id)
    assert sorted(got) == sorted(want_weights)
    for name, value in want_weights.items():
        assert got[name].equal(value), name


def replays_from_its_checkpoint(client: CoordinatorClient, restarting: LocalServices,
                                job: JobConfig, victim: str) -> None:
    """Trains `job` uninterrupted, then again with `victim` SIGKILLed once the job runs at
    step 8: its one restart starts from the newest checkpoint committed before the kill
    (steps 5, 10, ...; not step 0), every step is reported once, the losses and final
    weights equal the uninterrupted run's bit for bit, and no stash key is left."""
    want, want_weights = uninterrupted(client, job)
    client.submit(job)
    at = running_at(client, job.job_id, 8).step
    os.kill(restarting.process(victim).pid, signal.SIGKILL)
    status = finished(client, job.job_id)
    assert status.state == DONE, status.error
    assert status.attempt == 1 and len(status.restarts) == 1
    assert victim in status.restarts[0]
    assert status.start_step >= at // 5 * 5 >= 5 and status.start_step % 5 == 0
    reports = list(client.train(job.job_id))
    assert reports[0].step == 0
    assert_equals_run(client, job, reports, want, want_weights)
    assert not list(store_client(restarting).scan_iter(match=f"pipefb:{job.job_id}:*"))


def resumes_after_the_coordinator_is_killed(client: CoordinatorClient,
                                            restarting: LocalServices, job: JobConfig) -> None:
    """Trains `job` uninterrupted, then again with the coordinator SIGKILLed mid-run
    (`with_the_coordinator_killed`): its successor resumes from a checkpoint (step 10 or
    later, a multiple of 5), and the steps from there and the final weights equal the
    uninterrupted run's bit for bit."""
    want, want_weights = uninterrupted(client, job)
    status = with_the_coordinator_killed(client, restarting, job)
    assert status.start_step >= 10 and status.start_step % 5 == 0
    reports = list(client.follow(job.job_id))
    assert reports[0].step == status.start_step
    assert_equals_run(client, job, reports, want, want_weights)


def test_a_killed_pipedream_worker_replays_from_its_checkpoint_bit_for_bit(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """PipeDream (async, 4 combined ranks) with worker-3 SIGKILLed mid-run: the replay
    starts at the newest checkpoint before the kill, not step 0, whose rank files hold the
    version its warm-up forwards run on ([Note: resumed leads] in pipefb/runtime/state.py),
    and every step's loss and the final weights equal the uninterrupted run's bit for bit."""
    replays_from_its_checkpoint(client, restarting, pipedream_job("kill-pipedream"),
                                "worker-3")


def test_a_relaunched_coordinator_resumes_a_pipedream_job_from_its_checkpoint(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """The coordinator SIGKILLed mid-run: its successor resumes the journaled PipeDream
    job from its newest checkpoint (not step 0), and the steps from there on and the
    final weights equal the uninterrupted run's bit for bit."""
    resumes_after_the_coordinator_is_killed(client, restarting,
                                            pipedream_job("kill-coordinator-pipedream"))


def async_pipefb_job(name: str, staleness: int, k: int = 0) -> JobConfig:
    """An async PipeFB job (2 forward, 2 backward ranks; staleness S, the first K
    micro-batches of a step stale) that checkpoints every 5 steps and may restart twice."""
    return make_job("mlp", "pipefb", 4, "sgd", mode="async", staleness=staleness,
                    staleness_microbatches=k, steps=STEPS, checkpoint_every=5,
                    checkpoint_dir=name, max_restarts=2, job_id=name)


@pytest.mark.parametrize(("staleness", "k", "victim"),
                         [(1, 0, "worker-3"), (2, 4, "worker-0")])
def test_a_killed_async_pipefb_worker_replays_from_its_checkpoint_bit_for_bit(
        client: CoordinatorClient, restarting: LocalServices, staleness: int, k: int,
        victim: str) -> None:
    """Async PipeFB with a weight owner (worker-3) or a forward rank (worker-0) SIGKILLed
    mid-run: the replay starts at the newest checkpoint before the kill, not step 0, whose
    owners' files hold the versions the forwards of its first S steps run on ([Note:
    resumed stale forwards] in pipefb/runtime/state.py), and every step's loss and the
    final weights equal the uninterrupted run's bit for bit."""
    replays_from_its_checkpoint(
        client, restarting, async_pipefb_job(f"kill-async-s{staleness}-{victim}", staleness, k),
        victim)


def test_a_relaunched_coordinator_resumes_an_async_pipefb_job_from_its_checkpoint(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """The coordinator SIGKILLed mid-run: its successor resumes the journaled async
    PipeFB job (S = 2) from its newest checkpoint (not step 0), and the steps from there
    on and the final weights equal the uninterrupted run's bit for bit."""
    resumes_after_the_coordinator_is_killed(client, restarting,
                                            async_pipefb_job("kill-coordinator-async", 2))


def test_a_sigtermed_coordinator_drains_an_async_pipefb_job_and_its_successor_resumes(
        client: CoordinatorClient, restarting: LocalServices) -> None:
    """SIGTERM while the forward ranks of an async PipeFB job (S = 2) run ahead: every
    rank ends the steps issued, the owners save at that boundary with the versions in
    flight, and the relaunched coordinator resumes from exactly that step to the
    uninterrupted run's losses and weights, bit for bit."""
    job = replace(async_pipefb_job("drain-async", 2), checkpoint_every=100)
    want, want_weights = uninterrupted(client, job)
    reports = drained_and_resumed(client, restarting, job)
    assert reports[0].step >= 12 and reports[0].step % 100  # the drain's own checkpoint
    assert_equals_run(client, job, reports, want, want_weights)


PIPEDREAM_CLI = ["local", "train", "--model", "mlp", "--dataset", "digits", "--loss",
                 "cross_entropy", "--schedule", "pipedream", "--workers", "4", "--batch-size",
                 "8", "--microbatches", "4", "--steps", "100", "--optimizer", "sgd", "--lr",
                 "0.01", "--checkpoint-every", "5", "--max-restarts", "1", "--no-progress"]


def test_the_cli_replays_a_killed_pipedream_worker_from_its_checkpoint(tmp_path: Path) -> None:
    """`pipefb local train --schedule pipedream --max-restarts 1 --checkpoint-every 5`,
    worker-2 SIGKILLed after step 12: the CLI exits 0 and report.json names the restart
    and the checkpoint step the replay started at (10 or later, not 0)."""
    assert_the_cli_replays_from_a_checkpoint(tmp_path, PIPEDREAM_CLI)


def test_the_cli_replays_a_killed_async_pipefb_worker_from_its_checkpoint(tmp_path: Path
                                                                          ) -> None:
    """The same with `--schedule pipefb --mode async --staleness 2`: worker-2 (a weight
    owner) SIGKILLed after step 12, the replay starts at a checkpoint (10 or later)."""
    cli = [*PIPEDREAM_CLI]
    at = cli.index("pipedream")
    cli[at:at + 1] = ["pipefb", "--mode", "async", "--staleness", "2"]
    assert_the_cli_replays_from_a_checkpoint(tmp_path, cli)


def assert_the_cli_replays_from_a_checkpoint(tmp_path: Path, cli: list[str]) -> None:
    """Runs `pipefb` with `cli` (100 steps, a checkpoint every 5, one restart), SIGKILLs
    worker-2 after step 12, and checks the CLI exits 0 and report.json names the restart
    and the checkpoint step the replay started at (10 or later, not 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipefb.app.cli", *cli, "--out",
                             str(tmp_path)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, cwd=ROOT)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("step 12/"):
            break
    cluster = json.loads((tmp_path / "logs" / "cluster.json").read_text())
    os.kill(cluster["worker-2"]["pid"], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["restarts"]) == 1 and "worker-2" in report["restarts"][0]
    assert report["start_step"] >= 10 and report["start_step"] % 5 == 0
    assert [s["step"] for s in report["steps"]] == list(range(100))
