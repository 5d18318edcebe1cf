"""Killed workers and Ctrl-C: the job fails naming the worker, and no process is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LONG_JOB = ["local", "train", "--model", "mlp", "--dataset", "digits", "--loss", "cross_entropy",
            "--schedule", "pipefb", "--workers", "4", "--batch-size", "8", "--microbatches", "4",
            "--steps", "100000", "--optimizer", "sgd", "--lr", "0.01", "--no-progress"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it holds nothing, so it counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def start_and_wait_for_steps(out: Path) -> tuple[subprocess.Popen[str], dict[str, dict]]:
    """Starts the CLI on a long job and returns once it reports its second step."""
    proc = subprocess.Popen([sys.executable, "-m", "pipefb.app.cli", *LONG_JOB, "--out", str(out)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stderr is not None
    deadline = time.monotonic() + 180
    for line in proc.stderr:
        if line.startswith("step 2/") or time.monotonic() > deadline:
            break
    manifest = json.loads((out / "logs" / "cluster.json").read_text())
    assert len(manifest) == 6  # redis, coordinator, 4 workers
    return proc, manifest


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    assert proc.stderr is not None
    try:
        rest = proc.stderr.read()
        return proc.wait(timeout=120), rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_killed_worker_fails_the_job_naming_it_and_leaves_no_process(tmp_path: Path) -> None:
    proc, manifest = start_and_wait_for_steps(tmp_path)
    victim = manifest["worker-2"]
    os.kill(victim["pid"], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("pipefb: ABORTED") and "worker-2" in last and victim["address"] in last
    assert "died" in last
    assert not [name for name, p in manifest.items() if alive(p["pid"])]


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    proc, manifest = start_and_wait_for_steps(tmp_path)
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 130, err
    assert not [name for name, p in manifest.items() if alive(p["pid"])]


# A `pipefb local train` whose clean-up never ends (as a deadlocked Channel.close would):
# the command starts a real local cluster, says so, and hangs in its `finally`. It says
# so inside the `try`: the test's SIGINT can land as `print` returns, and one raised
# before the `try` would skip the hang (a clean stop, which tests nothing).
HUNG_CLEAN_UP = """
import sys, time
from pipefb.app import cli
from pipefb.app.local import LocalServices

def hang(args):
    with LocalServices(1, args.out / "logs"):
        try:
            print("serving", file=sys.stderr, flush=True)
            time.sleep(300)
        finally:
            time.sleep(300)
    return 0

cli.INTERRUPT_GRACE_SECONDS = 3.0
cli.COMMANDS["local"] = hang
sys.exit(cli.main(["local", "train", "--out", sys.argv[1]]))
"""


def test_ctrl_c_ends_the_cli_and_its_processes_even_when_the_clean_up_hangs(
        tmp_path: Path) -> None:
    """[Note: interrupt deadline] in pipefb/app/cli.py: the deadline kills the cluster."""
    proc = subprocess.Popen([sys.executable, "-c", HUNG_CLEAN_UP, str(tmp_path)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("serving"):
            break
    manifest = json.loads((tmp_path / "logs" / "cluster.json").read_text())
    assert len(manifest) == 3  # redis, coordinator, 1 worker
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 130, err
    assert time.monotonic() - started < 60  # the 3 s deadline, not the 300 s hang
    assert err.strip().splitlines()[-1] == (
        "pipefb: interrupted; the clean-up took over 3 s, so 3 local process(es) were killed")
    assert not [name for name, p in manifest.items() if alive(p["pid"])]


def test_sigterm_ends_workers_waiting_on_a_dead_peer(tmp_path: Path) -> None:
    """The coordinator, worker-0 and the CLI die at once (SIGKILL: none of their clean-up
    runs, and no one drains the job). Workers 1-3 get SIGTERM from the kernel (the CLI
    asked for it: PR_SET_PDEATHSIG) while their steps wait for worker-0's activations;
    each must abort its step and exit within the server's grace (5 s), not when the
    receive times out (300 s)."""
    proc, manifest = start_and_wait_for_steps(tmp_path)
    for name in ("coordinator", "worker-0"):
        os.kill(manifest[name]["pid"], signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p["pid"]) for p in manifest.values()):
        time.sleep(0.2)
    left = [name for name, p in manifest.items() if alive(p["pid"])]
    stacks = stacks_of([manifest[name] for name in left])
    for name in left:  # nothing outlives the test
        os.kill(manifest[name]["pid"], signal.SIGKILL)
    assert not left, stacks


def stacks_of(processes: list[dict]) -> str:
    """The Python stacks that stuck local-cluster children write to their logs on SIGUSR1
    (`pipefb.processes` registers it), so a failure says where each one waits."""
    for p in processes:
        os.kill(p["pid"], signal.SIGUSR1)
    time.sleep(1)
    return "\n".join(Path(p["log"]).read_text()[-3000:] for p in processes)


@pytest.mark.parametrize("victim", ["coordinator"])
def test_dead_coordinator_ends_the_cli_with_a_message(tmp_path: Path, victim: str) -> None:
    proc, manifest = start_and_wait_for_steps(tmp_path)
    os.kill(manifest[victim]["pid"], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1, err
    assert err.strip().splitlines()[-1].startswith("pipefb: UNAVAILABLE")
    assert not [name for name, p in manifest.items() if alive(p["pid"])]


def test_with_max_restarts_the_cli_relaunches_a_killed_worker_and_finishes(
        tmp_path: Path) -> None:
    """`pipefb local train --max-restarts 1`: the killed worker is relaunched, the job
    replays from its checkpoint, the CLI exits 0 and report.json names the restart."""
    job = [*LONG_JOB[:LONG_JOB.index("--steps")], "--steps", "150",
           *LONG_JOB[LONG_JOB.index("--steps") + 2:],
           "--max-restarts", "1", "--checkpoint-every", "10"]
    proc = subprocess.Popen([sys.executable, "-m", "pipefb.app.cli", *job, "--out", str(tmp_path)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("step 2/"):
            break
    manifest = json.loads((tmp_path / "logs" / "cluster.json").read_text())
    os.kill(manifest["worker-2"]["pid"], signal.SIGKILL)
    code, err = finish(proc)
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["restarts"]) == 1 and "worker-2" in report["restarts"][0]
    assert [s["step"] for s in report["steps"]] == list(range(150))
    relaunched = json.loads((tmp_path / "logs" / "cluster.json").read_text())
    assert relaunched["worker-2"]["pid"] != manifest["worker-2"]["pid"]
    assert not [name for name, p in relaunched.items() if alive(p["pid"])]


STUCK_STOP = """
import signal, threading, time
from protos import server
srv, port, health = server.create_server(lambda s: None, "127.0.0.1:0")
def announce():  # once serve_until_signal has its SIGTERM handler, so none is lost
    while signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        time.sleep(0.01)
    print("serving", flush=True)
threading.Thread(target=announce, daemon=True).start()
server.serve_until_signal(srv, health, on_stop=lambda: time.sleep(3600), exit_within=1.0)
"""


def test_a_stop_whose_clean_up_is_stuck_ends_the_process_at_its_deadline() -> None:
    """A worker's stop ends the process `exit_within` seconds after SIGTERM even when its
    clean-up never returns (a thread stuck on a dead peer)."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK_STOP], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "serving"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1 and time.monotonic() - started < 10
    assert "still runs 1 s after the stop signal: exiting now" in proc.stderr.read()
