"""Pinned workers ([Note: pinned workers] in pipefb/cpus.py): cpu lists, the local
cluster's share of cores per worker, real worker processes on their cores, and training
on them equal to one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipefb.cpus import allowed, format_cpu_list, parse_cpu_list, pin, share_out
from pipefb.errors import ConfigError
from pipefb.processes import project_env
from tests.conftest import WORKER_THREADS
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="this system cannot pin a process to cores")


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list(" 5 ") == {5}
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize(("text", "names"), [
    ("", "''"), ("a", "'a'"), ("1-", "'1-'"), ("0,,1", "''"), ("-1", "'-1'")])
def test_a_bad_cpu_list_names_the_piece(text: str, names: str) -> None:
    with pytest.raises(ConfigError, match=f"{names} is not a core number"):
        parse_cpu_list(text)


def test_a_falling_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="the range '3-1' runs down"):
        parse_cpu_list("3-1")


@given(st.sets(st.integers(0, 200), min_size=1))
def test_a_formatted_list_reads_back(cores: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cores)) == cores


def test_workers_get_disjoint_cores_in_order_or_none() -> None:
    assert share_out(2, 1, [0, 1]) == [{0}, {1}]
    assert share_out(2, 2, [0, 1, 4, 5, 6]) == [{0, 1}, {4, 5}]
    assert share_out(3, 1, [0, 1]) is None  # too few: the kernel places them
    assert share_out(2, 2, [0, 1, 2]) is None
    assert share_out(0, 1, [0]) is None


def test_pinning_to_a_core_outside_the_process_is_refused() -> None:
    outside = max(allowed()) + 1
    with pytest.raises(ConfigError, match=f"core {outside} is not one this process may run on"):
        pin({outside})
    assert allowed() == sorted(os.sched_getaffinity(0))  # unchanged


def test_a_worker_with_a_bad_cpu_list_stops_with_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "worker", "--cpus", "0-x"],
                          env=project_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "python -m worker: error: cpu list '0-x': '0-x' is not a core number or a range "
        "such as 0-3")


def cores_of(status: Path) -> set[int] | None:
    """The cores of a live process or thread, from its /proc status file; None for a
    thread that ended meanwhile (gRPC starts and ends threads of its own)."""
    try:
        text = status.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list in {status}")


@pytest.mark.parametrize("pin_cpus", [True, False], ids=["pinned", "unpinned"])
def test_a_local_cluster_pins_each_worker_and_trains_as_one_process(
        pin_cpus: bool, tmp_path: Path) -> None:
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices

    shares = share_out(2, WORKER_THREADS)
    if pin_cpus and shares is None:
        pytest.skip(f"{len(allowed())} core(s): too few to give 2 workers one each")
    with LocalServices(2, tmp_path, threads=WORKER_THREADS, pin_cpus=pin_cpus) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        client.wait_for_workers(2)
        workers = cluster.workers()
        want = shares if pin_cpus else [set(allowed())] * 2
        assert [cores_of(Path(f"/proc/{w.pid}/status")) for w in workers] == want
        # every thread of a worker runs there: they all started after the flag took effect
        for proc, cores in zip(workers, want, strict=True):
            seen = [cores_of(t / "status") for t in Path(f"/proc/{proc.pid}/task").iterdir()]
            alive = [c for c in seen if c is not None]
            assert len(alive) > 3 and all(c == cores for c in alive)
        coordinator = next(p for p in cluster.processes if p.name == "coordinator")
        assert cores_of(Path(f"/proc/{coordinator.pid}/status")) == set(allowed())
        job = make_job("mlp", "1f1b", 2, "adamw")
        reports, weights = run_on_cluster(client, job)
        assert_same_training(job, reports, weights)


def test_a_local_cluster_gives_its_workers_no_cpu_list_of_its_own_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `PIPEFB_CPUS` in the CLI's environment would pin every worker to one list; a
    worker's cores are its `--cpus` alone (nothing starts here)."""
    from pipefb.app.local import LocalServices

    monkeypatch.setenv("PIPEFB_CPUS", "0")
    for pin_cpus in (True, False):
        cluster = LocalServices(2, tmp_path, threads=1, pin_cpus=pin_cpus)
        assert "PIPEFB_CPUS" not in cluster.worker_env
        assert cluster.worker_cpus == ((share_out(2, 1) or []) if pin_cpus else [])
