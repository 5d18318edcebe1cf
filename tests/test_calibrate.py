"""The local calibration: real loopback gRPC and a real Redis measured once, cached as YAML."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from calibration import cache, cpu, fit, links, store
from calibration.__main__ import main
from calibration.cluster import local_cluster
from calibration.settings import HOST, CalibrationError, Measured, Settings
from pipefb.errors import ConfigError
from pipefb.memory import KINDS
from pipefb.sim.cluster import Cluster, Link

FAST = Settings(small_repeats=20, large_bytes=4 << 20, large_repeats=3, warmup=2,
                rpc_repeats=10, steps=4, step_calls=30, crowd_seconds=0.3, busy_repeats=20)
PROC = Path(f"/proc/{os.getpid()}/task").is_dir()  # where the calibration reads CPU time
OTHER = Measured(Link(2e9, 3e-5), Link(1e9, 4e-5), 5e-6, 6e-4)  # a re-measurement's result


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Cluster]:
    """One real measurement (Redis, an echo peer process, a runtime), cached in a folder."""
    folder = tmp_path_factory.mktemp("cache")
    return folder, local_cluster(2, cache_dir=folder, settings=FAST)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """Counts measurements; each returns OTHER."""
    calls: list[Settings] = []

    def fake(settings: Settings = FAST) -> Measured:
        calls.append(settings)
        return OTHER

    monkeypatch.setattr("calibration.cluster.measure", fake)
    return calls


def copy_cache(measured: tuple[Path, Cluster], folder: Path) -> Path:
    path = cache.cache_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cache.cache_path(measured[0]).read_text())
    return path


def test_measured_links_are_plausible_for_loopback(measured: tuple[Path, Cluster]) -> None:
    cluster = measured[1]
    for what, link in (("network", cluster.network), ("store", cluster.store)):
        assert math.isfinite(link.bandwidth) and 10e6 <= link.bandwidth <= 100e9, (what, link)
        assert 1e-6 <= link.latency <= 0.1, (what, link)
        assert link.seconds(16 << 20) > link.seconds(1024), what
        # cores busy while a link moves data: at least one (the meter's floor; a loaded
        # host may give both ends less than a core between them, so more than one is not
        # asserted here: test_cpu_meter_counts_every_thread_... counts two processes);
        # 1.0 exactly where /proc is missing
        assert 1.0 <= link.cpu <= 4.0 if PROC else link.cpu == 1.0, (what, link)
    assert 0 <= cluster.action_overhead < 0.01
    assert 1e-6 <= cluster.step_overhead < 0.1  # at least an RPC round trip
    # a Step call's CPU, both ends; 0 only where /proc is missing
    assert 20e-6 <= cluster.step_cpu < 0.05 if PROC else cluster.step_cpu == 0.0
    cached = yaml.safe_load(cache.cache_path(measured[0]).read_text())
    assert cached["overheads"]["step_cpu"] == cluster.step_cpu
    # twice as many busy processes as cores run slower in all
    speed = cluster.oversubscribed_of(HOST)
    assert 0.5 <= speed <= 1.0 and cached["hosts"][0]["oversubscribed"] == speed
    # a send followed by compute arrives later, never earlier
    assert 0.0 <= cluster.busy_send < 0.05
    assert cached["overheads"].get("busy_send", 0.0) == cluster.busy_send
    # the node-local tier's put and take (a memcpy and a view): less work than Redis's
    tier = cluster.local_tier
    assert tier is not None and 10e6 <= tier.bandwidth <= 1e12 and tier.latency < 0.01, tier
    assert tier.seconds(16 << 20) < cluster.store.seconds(16 << 20), (tier, cluster.store)
    # its cap is what the workers' environment gives them, not a measurement
    assert cluster.local_tier_bytes == store.tier_cap()
    # the cache keeps no cap: each read takes the environment's
    assert cached["local_tier"] == {"bandwidth": tier.bandwidth, "latency": tier.latency}
    # the tier two ranks share (index keys in Redis)
    for what, link in (("shared_tier", cluster.shared_tier),):
        assert link is not None and 10e6 <= link.bandwidth <= 1e12, (what, link)
        assert 1e-6 <= link.latency < 0.05, (what, link)
        assert 1.0 <= link.cpu <= 4.0 if PROC else link.cpu == 1.0, (what, link)
        assert Link.parse(cached[what], what) == link


def test_the_step_probe_answers_as_a_worker_does() -> None:
    reply = links.probe_reply(7)
    assert reply.step == 7 and len(reply.spans) == links.PROBE_SPANS
    assert set(reply.memory_bytes) == set(reply.kind_peak_bytes) == set(KINDS)


def ticks_run(pid: int) -> float:
    """CPU seconds process `pid` has run, from /proc/PID/stat (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_cpu_meter_counts_every_thread_of_every_process_it_watches() -> None:
    """A span in which this process and a child each keep a core busy counts the CPU
    seconds of both (as the kernel's own per-process counters tell them, so a loaded host
    that gives them less than two cores does not fail it); a process /proc cannot tell
    about makes the meter say 1."""
    if not PROC:
        pytest.skip("no /proc/PID/task on this system")
    busy = "import time\nend = time.time() + 5\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.3)  # the child is spinning
        meter = cpu.CpuMeter([os.getpid(), child.pid])
        own, theirs = time.process_time(), ticks_run(child.pid)
        with meter.span():
            end = time.perf_counter() + 1.0
            while time.perf_counter() < end:
                pass
        own, theirs = time.process_time() - own, ticks_run(child.pid) - theirs
        assert theirs > 0.1  # the child ran in the span: a meter of one process is short
        assert meter.cpu == pytest.approx(own + theirs, abs=0.05), (meter.cpu, own, theirs)
        assert meter.cores() == pytest.approx(max(1.0, meter.cpu / meter.wall))
    finally:
        child.kill()
        child.wait()
    gone = cpu.CpuMeter([child.pid])
    with gone.span():
        pass
    assert gone.cores() == 1.0


def test_cpu_meter_never_loses_the_time_of_a_thread_that_ends_in_its_span() -> None:
    """A thread that ran 0.3 s before the span and ends inside it takes its total out of
    the process's threads; the meter counts per thread, so the span's CPU stays >= 0."""
    if not PROC:
        pytest.skip("no /proc/PID/task on this system")
    go = threading.Event()

    def spin_then_wait() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        go.wait()

    worker = threading.Thread(target=spin_then_wait)
    worker.start()
    time.sleep(0.4)  # it has spun and waits
    meter = cpu.CpuMeter([os.getpid()])
    with meter.span():
        go.set()
        worker.join()
    assert 0.0 <= meter.cpu < 0.1, meter.cpu


def test_cluster_shape(measured: tuple[Path, Cluster]) -> None:
    cluster = measured[1]
    assert [w.name for w in cluster.workers] == ["w0", "w1"]
    assert all(w.host == "local" and w.speed == 1.0 and w.memory == math.inf
               for w in cluster.workers)
    assert dict(cluster.host_cores) == {"local": os.cpu_count()}
    assert cluster.cores_of(1) == ("local", os.cpu_count())


def test_cache_is_written_with_a_header_and_reads_back_equal(
        measured: tuple[Path, Cluster]) -> None:
    folder, cluster = measured
    path = cache.cache_path(folder)
    text = path.read_text()
    assert text.startswith("# pipefb local cluster, measured ")
    for version in ("python 3.", "torch 2.", "grpc 1."):
        assert version in text
    # the cache keeps no tier cap: each read takes the environment's
    assert Cluster.load(path) == replace(cluster, local_tier_bytes=math.inf)
    assert local_cluster(2, cache_dir=folder) == cluster


def test_a_bad_tier_cap_is_refused_without_measuring_again(
        measured: tuple[Path, Cluster], spy: list[Settings],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad PIPEFB_LOCAL_TIER_BYTES is the environment's mistake, not the cache's: it
    is refused, naming the value, and the good cache is neither measured again nor
    rewritten."""
    path = cache.cache_path(measured[0])
    before = path.read_text()
    monkeypatch.setenv("PIPEFB_LOCAL_TIER_BYTES", "1GiB")
    with pytest.raises(ConfigError, match="PIPEFB_LOCAL_TIER_BYTES='1GiB'"):
        local_cluster(2, cache_dir=measured[0])
    assert spy == [] and capsys.readouterr().err == "" and path.read_text() == before


def test_cache_is_reused_for_any_worker_count(measured: tuple[Path, Cluster], spy: list[Settings],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder, cluster = measured
    bigger = local_cluster(5, cache_dir=folder)
    assert spy == []
    assert capsys.readouterr().err == ""
    assert [w.name for w in bigger.workers] == [f"w{i}" for i in range(5)]
    assert (bigger.network, bigger.store) == (cluster.network, cluster.store)
    assert (bigger.action_overhead, bigger.step_overhead) == (cluster.action_overhead,
                                                              cluster.step_overhead)


def test_refresh_measures_again_and_rewrites(measured: tuple[Path, Cluster], spy: list[Settings],
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = copy_cache(measured, tmp_path)
    cluster = local_cluster(3, cache_dir=tmp_path, refresh=True)
    assert len(spy) == 1
    assert (cluster.network, cluster.store) == (OTHER.network, OTHER.store)
    assert Cluster.load(path) == cluster
    err = capsys.readouterr().err
    assert err == f"measuring loopback gRPC and Redis once; cached in {path}\n"


def test_missing_cache_measures_once(spy: list[Settings], tmp_path: Path) -> None:
    first = local_cluster(1, cache_dir=tmp_path / "new")
    again = local_cluster(1, cache_dir=tmp_path / "new")
    assert len(spy) == 1 and first == again


def test_cache_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("PIPEFB_CACHE_DIR", str(tmp_path))
    assert cache.cache_path().parent == tmp_path
    monkeypatch.delenv("PIPEFB_CACHE_DIR")
    assert cache.cache_path().parent == Path.home() / ".cache" / "pipefb"


CORRUPT: dict[str, Callable[[str], bytes]] = {
    "not yaml": lambda good: b"network: {bandwidth: [\n",
    "empty": lambda good: b"",
    "not utf-8": lambda good: b"\xff\xfe\x00",
    "a list": lambda good: b"- 1\n- 2\n",
    "no store": lambda good: good.replace("store:", "stash:").encode(),
    "zero bandwidth": lambda good: yaml.safe_dump(
        {**yaml.safe_load(good), "network": {"bandwidth": 0}}).encode(),
    "truncated": lambda good: good[: len(good) // 2].encode(),
    "mixed keys": lambda good: good.encode() + b"1: x\nzz: y\n",
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_cache_is_measured_again_with_a_warning(
        measured: tuple[Path, Cluster], spy: list[Settings], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], case: str) -> None:
    path = copy_cache(measured, tmp_path)
    path.write_bytes(CORRUPT[case](path.read_text()))
    cluster = local_cluster(2, cache_dir=tmp_path)
    assert len(spy) == 1
    assert cluster.network == OTHER.network
    assert Cluster.load(path) == cluster
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"warning: cached cluster {path} is unusable ("), err
    assert err[1].startswith("measuring loopback gRPC and Redis once")


def test_cache_of_older_probes_is_measured_again(
        measured: tuple[Path, Cluster], spy: list[Settings], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = copy_cache(measured, tmp_path)
    tag = f", probe version {cache.PROBE_VERSION}\n"
    assert tag in path.read_text()
    path.write_text(path.read_text().replace(tag, "\n"))  # an older probe's cache: no tag
    cluster = local_cluster(2, cache_dir=tmp_path)
    assert len(spy) == 1 and cluster.store == OTHER.store
    assert tag in path.read_text()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"cached cluster {path} was measured by older probes; measuring again"


def test_probe_stashes_are_shaped_as_a_stage_s() -> None:
    stash = store._probe_stash(16 << 20)
    tensors = [t for layer in stash.values() for t in layer.values()]
    assert len(stash) == store.STASH_LAYERS and len(tensors) == store.STASH_TENSORS
    assert sum(t.nbytes for t in tensors) == 16 << 20
    assert len({t.data_ptr() for t in tensors}) == len(tensors)  # fresh, not one reused
    again = store._probe_stash(16 << 20)
    assert again[0]["t0"].data_ptr() != stash[0]["t0"].data_ptr()


def test_the_tiers_cap_is_the_one_a_local_clusters_workers_use(tmp_path: Path) -> None:
    """--local-tier-bytes where the environment gives it, else the workers' default: half
    the file system their tier directory is on (made later: its nearest parent that is
    there), and a built cluster carries it ([Note: tier cap] in pipefb.sim.tierslots)."""
    from calibration.cluster import build_cluster
    from offload_store.shm import default_cap

    assert store.tier_cap({"PIPEFB_LOCAL_TIER_BYTES": "4096"}) == 4096
    assert store.tier_cap({"PIPEFB_LOCAL_TIER_BYTES": "0"}) == 0
    later = {"PIPEFB_LOCAL_TIER_DIR": str(tmp_path / "not" / "yet")}
    assert store.tier_cap(later) == default_cap(tmp_path)
    assert store.tier_cap({}) == default_cap(store.tier_root())
    for bad in ("lots", "-2"):
        with pytest.raises(ConfigError, match=bad):
            store.tier_cap({"PIPEFB_LOCAL_TIER_BYTES": bad})
    tiered = Measured(OTHER.network, OTHER.store, 0.0, 0.0, local_tier=Link(5e9, 0.0))
    assert build_cluster(1, tiered).local_tier_bytes == store.tier_cap()
    assert build_cluster(1, OTHER).local_tier_bytes == math.inf  # no tier measured


def test_fit_link_from_two_points() -> None:
    link = fit.fit_link("x", 1_000, 0.001, 1_001_000, 0.002)
    assert link.bandwidth == pytest.approx(1e9)
    assert link.latency == pytest.approx(0.001 - 1e-6)
    with pytest.raises(CalibrationError, match="not more than"):
        fit.fit_link("x", 1_000, 0.002, 1_001_000, 0.002)


def test_probes_fit_through_means_or_through_medians_past_a_slow_small_probe() -> None:
    small, large = [0.001, 0.001, 0.001], [0.002, 0.002, 0.002]
    assert fit.fit_probes("x", 1_000, small, 1_001_000, large) == fit.fit_link(
        "x", 1_000, 0.001, 1_001_000, 0.002)
    # one 5 ms hiccup puts the small mean (2.33 ms) above the large one (2 ms)
    slow = [0.001, 0.005, 0.001]
    assert fit.fit_probes("x", 1_000, slow, 1_001_000, large).bandwidth == (
        pytest.approx(1e9))
    with pytest.raises(CalibrationError, match=r"x: 1001000 bytes took 0\.002000 s"):
        fit.fit_probes("x", 1_000, [0.002, 0.005, 0.002], 1_001_000, large)


def test_no_workers_is_a_config_error(measured: tuple[Path, Cluster],
                                      spy: list[Settings]) -> None:
    with pytest.raises(ConfigError, match="at least one worker"):
        local_cluster(0, cache_dir=measured[0])
    assert spy == []


def test_cli_prints_yaml_that_cluster_load_reads(measured: tuple[Path, Cluster], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PIPEFB_CACHE_DIR", str(measured[0]))
    assert main(["--workers", "3"]) == 0
    out = capsys.readouterr()
    assert out.err == ""  # the cache was used: nothing measured
    (tmp_path / "c.yaml").write_text(out.out)
    loaded = Cluster.load(tmp_path / "c.yaml")
    assert loaded.size == 3 and loaded.network == measured[1].network


def test_cli_writes_the_out_file(measured: tuple[Path, Cluster], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEFB_CACHE_DIR", str(measured[0]))
    assert main(["--workers", "4", "--out", str(tmp_path / "c.yaml")]) == 0
    loaded = Cluster.load(tmp_path / "c.yaml")
    assert loaded.size == 4 and loaded.store == measured[1].store


class _ThreadStore:
    """A stash store that keeps stashes in a dict and records the thread of each call;
    a put takes `put_seconds` and fails with `error` where given."""

    def __init__(self, put_seconds: float = 0.0, error: Exception | None = None) -> None:
        self.put_seconds, self.error = put_seconds, error
        self.held: dict[tuple[int, int], dict[int, dict[str, object]]] = {}
        self.threads: list[tuple[str, str]] = []

    def put(self, step: int, microbatch: int, version: int, tensors: dict) -> int:
        self.threads.append(("put", threading.current_thread().name))
        time.sleep(self.put_seconds)
        if self.error is not None:
            raise self.error
        self.held[(step, microbatch)] = tensors
        return 0

    def take(self, step: int, microbatch: int, version: int, names: dict) -> dict:
        self.threads.append(("take", threading.current_thread().name))
        got = self.held.pop((step, microbatch))
        return {i: {n: got[i][n] for n in names[i]} for i in names}


def test_the_shared_tier_probe_copies_through_a_writer_and_a_prefetch_thread() -> None:
    """[Note: copy lane]: a put lasts until the writer's I/O thread wrote it, a take runs
    on a prefetch thread; neither on the caller's."""
    producer, consumer = _ThreadStore(put_seconds=0.02), _ThreadStore()
    lane = store.LaneCopies(producer, consumer)  # type: ignore[arg-type]
    stash = store._probe_stash(1024)
    try:
        started = time.perf_counter()
        assert lane.put(3, 0, 0, stash) == 1024
        assert time.perf_counter() - started >= 0.02  # returned once written
        consumer.held = producer.held  # one tier: what the producer wrote, the consumer takes
        got = lane.take(3, 0, 0, {0: ["t0"]})
        assert got[0]["t0"] is stash[0]["t0"]
    finally:
        lane.close()
    caller = threading.current_thread().name
    assert producer.threads == [("put", "stash-writer")]
    assert consumer.threads[0][0] == "take" and consumer.threads[0][1].startswith("prefetch")
    assert caller not in {name for _, name in producer.threads + consumer.threads}


def test_a_failed_write_of_the_shared_tier_probe_raises_on_the_caller() -> None:
    lane = store.LaneCopies(_ThreadStore(error=ValueError("full")), _ThreadStore())  # type: ignore[arg-type]
    try:
        with pytest.raises(ValueError, match="full"):
            lane.put(0, 0, 0, store._probe_stash(1024))
    finally:
        lane.close()
