"""Prometheus metrics: a real Prometheus scrapes a local cluster run with metrics on and
agrees with report.json; promtool accepts every service's /metrics; the gRPC interceptor
counts real status codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry

from coordinator.driver import Driver
from coordinator.registry import Registry
from coordinator.service import CoordinatorServicer
from offload_store.server import _free_port as free_port
from pipefb.job.config import JobConfig
from pipefb.memory import KINDS, OUTSIDE_TOTAL
from protos import coordinator_pb2, coordinator_pb2_grpc, server, worker_pb2
from protos.aioserver import create_aio_server
from protos.monitoring import MetricsInterceptor, port_or_none

JOB = JobConfig(model="mlp", model_config={"hidden": 32, "depth": 2}, dataset="digits",
                loss="cross_entropy", schedule="pipefb", workers=2, batch_size=8,
                microbatches=4, steps=3, optimizer="sgd", lr=0.1, policy="recompute",
                clip_grad_norm=100.0)  # far above the norm: reported, never clipping
SCRAPE_TIMEOUT_SECONDS = 30.0
NO_PROMETHEUS = ("no prometheus/promtool on PATH: install Debian's prometheus package "
                 "(bash scripts/install_prometheus.sh; .ci/run does)")


class Prometheus:
    """A prometheus server on 127.0.0.1 scraping `targets` every second, in `folder`."""

    def __init__(self, targets: list[str], folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "prometheus.yml"
        # honor_labels: the services' own `job` label (the training job) wins over the
        # scrape job's name, as the PodMonitor's honorLabels does in k8s/
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "pipefb", "honor_labels": True,
                                "static_configs": [{"targets": targets}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = folder / "prometheus.log"
        with self.log.open("w") as log:
            self.popen = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def get(self, path: str, **params: str) -> Any:
        """GET an API path; the JSON reply's `data`."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query: each series' labels (sorted pairs, `instance` dropped) -> value."""
        return {tuple(sorted((k, v) for k, v in s["metric"].items() if k != "instance")):
                float(s["value"][1]) for s in self.get("/api/v1/query", query=expr)["result"]}

    def value(self, expr: str) -> float:
        """The value of a query that gives exactly one series."""
        values = list(self.query(expr).values())
        assert len(values) == 1, (expr, self.query(expr))
        return values[0]

    def wait_for_scrape_after(self, moment: float, targets: int) -> None:
        """Waits until every target is up and was last scraped after `moment` (epoch s)."""
        deadline = time.monotonic() + SCRAPE_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            try:  # how many targets are up, and the oldest of their last scrapes
                up = self.query('sum(up{job="pipefb"})').get((), 0.0)
                scraped = self.query('min(timestamp(up{job="pipefb"} == 1))').get((), 0.0)
            except OSError:  # not listening yet
                up = scraped = 0.0
            if up == targets and scraped > moment:
                return
            time.sleep(0.2)
        raise TimeoutError(f"no scrape of {targets} targets after {moment}: "
                           f"{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; always reaps."""
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class Scraped:
    """A finished job on a live cluster with metrics, and a Prometheus that scraped it."""

    prometheus: Prometheus
    report: dict[str, Any]  # report.json as written
    names: dict[int, str]  # worker id -> worker name (the `worker` label)
    urls: dict[str, str]  # service -> /metrics URL


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.skip(NO_PROMETHEUS)
    from coordinator.client import CoordinatorClient
    from pipefb.app.local import LocalServices
    from pipefb.app.report import write_report
    from pipefb.app.train import train_on

    folder = tmp_path_factory.mktemp("metrics")
    with LocalServices(JOB.workers, folder / "logs", threads=1, metrics=True) as cluster, \
            CoordinatorClient(cluster.coordinator) as client:
        urls = cluster.metrics_urls()
        prometheus = Prometheus([urllib.parse.urlsplit(u).netloc for u in urls.values()],
                                folder / "prometheus")
        try:
            client.wait_for_workers(JOB.workers)
            report = train_on(client, JOB, False)
            finished = time.time()
            path = write_report(folder / "run", report, report.pop("_weights"))
            prometheus.wait_for_scrape_after(finished, len(urls))
            names = {w.worker_id: w.name for w in client.workers()}
            yield Scraped(prometheus, json.loads(path.read_text()), names, urls)
        finally:
            prometheus.stop()


def by_worker(series: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    """Values by their `worker` label."""
    return {dict(labels)["worker"]: value for labels, value in series.items()}


def test_prometheus_throughput_equals_the_report(scraped: Scraped) -> None:
    prom, report = scraped.prometheus, scraped.report
    job, last = report["job_id"], report["steps"][-1]
    steps, samples = len(report["steps"]), len(report["steps"]) * JOB.batch_size
    assert prom.value(f'pipefb_job_step{{job="{job}"}}') == last["step"] == JOB.steps - 1
    assert prom.value(f'pipefb_job_samples_per_second{{job="{job}"}}') == \
        last["samples_per_second_median"]
    assert prom.value(f'pipefb_job_learning_rate{{job="{job}"}}') == last["lr"] == JOB.lr
    assert prom.value(f'pipefb_job_grad_norm{{job="{job}"}}') == last["grad_norm"] > 0
    # the one weight owner (the backward worker) exports the norm it took
    owners = [w for w in last["workers"] if w["role"] != "forward"]
    assert by_worker(prom.query(f'pipefb_worker_grad_norm{{job="{job}"}}')) == {
        scraped.names[w["worker_id"]]: last["grad_norm"] for w in owners}
    assert prom.value(f'pipefb_job_skipped_steps_total{{job="{job}"}}') == 0
    assert prom.value(f'pipefb_job_loss{{job="{job}"}}') == pytest.approx(last["loss"], rel=1e-6)
    assert prom.value(f'pipefb_job_step_seconds_count{{job="{job}"}}') == steps
    assert prom.value(f'pipefb_job_step_seconds_sum{{job="{job}"}}') == pytest.approx(
        sum(s["seconds"] for s in report["steps"]), rel=1e-9)
    # every rank processes every sample once: its forward (forward role) or backward
    per_role = prom.query(f'sum by (role) (pipefb_worker_samples_total{{job="{job}"}})')
    assert per_role == {(("role", "backward"),): samples, (("role", "forward"),): samples}
    assert set(by_worker(prom.query(f'pipefb_worker_steps_total{{job="{job}"}}')).values()) == \
        {steps}


def test_prometheus_per_worker_counters_equal_the_report(scraped: Scraped) -> None:
    prom, report = scraped.prometheus, scraped.report
    job = report["job_id"]
    sent = "pipefb_worker_sent_bytes_total{{job=\"{}\",channel=\"{}\"}}"
    sent_grpc = by_worker(prom.query(sent.format(job, "grpc")))
    sent_store = by_worker(prom.query(sent.format(job, "store")))
    idle = by_worker(prom.query(f'pipefb_worker_idle_seconds_total{{job="{job}"}}'))
    phases = prom.query(f'pipefb_worker_compute_seconds_count{{job="{job}"}}')
    actions = len(report["steps"]) * JOB.microbatches
    for rank in report["steps"][-1]["workers"]:
        name = scraped.names[rank["worker_id"]]
        ranks = [w for s in report["steps"] for w in s["workers"] if w["rank"] == rank["rank"]]
        assert sent_grpc[name] == sum(w["bytes_sent"] for w in ranks)
        assert sent_store[name] == sum(w["bytes_stashed"] for w in ranks)
        assert idle[name] == pytest.approx(sum(w["idle_seconds"] for w in ranks), rel=1e-9)
        counted = {dict(k)["phase"]: v for k, v in phases.items() if dict(k)["worker"] == name}
        # policy recompute: the backward rank re-runs each micro-batch's forward
        assert counted == ({"forward": actions} if rank["role"] == "forward"
                           else {"backward": actions, "recompute": actions})
    assert sum(sent_store.values()) > 0  # the forward rank stashed its inputs


def test_prometheus_memory_equals_the_last_step(scraped: Scraped) -> None:
    prom, report = scraped.prometheus, scraped.report
    job, last = report["job_id"], report["steps"][-1]
    peaks = by_worker(prom.query(f'pipefb_worker_peak_memory_bytes{{job="{job}"}}'))
    kinds = prom.query(f'pipefb_worker_memory_bytes{{job="{job}"}}')
    versions = by_worker(prom.query(f'pipefb_worker_weight_version{{job="{job}"}}'))
    stash = by_worker(prom.query(f'pipefb_worker_stash_bytes{{job="{job}"}}'))
    for rank in last["workers"]:
        name = scraped.names[rank["worker_id"]]
        assert peaks[name] == rank["peak_memory_bytes"] > 0
        mine = {dict(k)["kind"]: v for k, v in kinds.items() if dict(k)["worker"] == name}
        assert mine == {k: rank["memory_bytes"][k] for k in KINDS}
        own = sum(v for k, v in mine.items() if k not in OUTSIDE_TOTAL)
        assert own == rank["peak_memory_bytes"]  # the node tier is reported beside it
        assert versions[name] == rank["weight_version"]
        assert stash[name] == rank["bytes_stashed"]


def test_prometheus_has_coordinator_and_grpc_series(scraped: Scraped) -> None:
    prom, report = scraped.prometheus, scraped.report
    job = report["job_id"]
    assert prom.value("pipefb_workers_registered") == JOB.workers
    assert prom.value("pipefb_workers_alive") == JOB.workers
    assert prom.value("pipefb_store_used_memory_bytes") > 0
    assert prom.value(f'pipefb_migrations_total{{job="{job}"}}') == 0
    assert prom.value(f'pipefb_migrated_bytes_total{{job="{job}"}}') == 0
    assert prom.value(f'pipefb_migration_seconds_total{{job="{job}"}}') == 0
    assert prom.value(f'pipefb_restarts_total{{job="{job}"}}') == 0
    assert prom.value(f'pipefb_job_predicted_step_seconds{{job="{job}"}}') == 0  # plan even
    assert prom.value(f'pipefb_job_weight_version_lag{{job="{job}"}}') == 1  # sync
    workers = report["steps"][-1]["workers"]
    idle = sum(w["idle_seconds"] for w in workers)
    assert prom.value(f'pipefb_job_bubble_fraction{{job="{job}"}}') == pytest.approx(
        idle / (idle + sum(w["compute_seconds"] for w in workers)), rel=1e-9)
    step_calls = 'pipefb_grpc_server_handled_total{grpc_method="Step",grpc_code="OK"}'
    assert prom.value(f"count({step_calls})") == JOB.workers  # one series per worker
    assert prom.value(f"sum({step_calls})") == JOB.steps * JOB.workers
    assert prom.value('sum(pipefb_grpc_server_handled_total{grpc_service="pipefb.v1.Coordinator",'
                      'grpc_method="SubmitJob",grpc_code="OK"})') == 1
    assert prom.value('sum(pipefb_grpc_server_handling_seconds_count{grpc_method="SubmitJob"})') \
        == 1


def test_promtool_accepts_every_service(scraped: Scraped) -> None:
    assert sorted(scraped.urls) == ["coordinator", "worker-0", "worker-1"]
    for name, url in scraped.urls.items():
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read()
        assert b"pipefb_" in text
        check = subprocess.run(["promtool", "check", "metrics"], input=text,
                               capture_output=True, timeout=30)
        assert check.returncode == 0, (name, check.stdout.decode(), check.stderr.decode())


# -- the interceptor and the flags, without a cluster --------------------------------------

@pytest.fixture
def coordinator_stub() -> Iterator[tuple[coordinator_pb2_grpc.CoordinatorStub,
                                         CollectorRegistry]]:
    """A real Coordinator server (nothing to drive: no store behind it) with the interceptor
    counting into its own registry."""
    registry, workers = CollectorRegistry(), Registry()
    servicer = CoordinatorServicer(workers, Driver(workers, "127.0.0.1:1"))
    srv, port, _ = create_aio_server(  # as python -m coordinator serves it
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        interceptors=(MetricsInterceptor(registry),))
    with server.channel(f"127.0.0.1:{port}") as ch:
        yield coordinator_pb2_grpc.CoordinatorStub(ch), registry
    srv.stop(0).wait()


def test_interceptor_counts_ok_and_errors_with_real_codes(coordinator_stub: Any) -> None:
    stub, registry = coordinator_stub
    stub.ListWorkers(coordinator_pb2.ListWorkersRequest(), timeout=5)
    stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(address="127.0.0.1:9", name="a"),
                        timeout=5)
    calls = [(lambda: stub.RegisterWorker(coordinator_pb2.RegisterWorkerRequest(), timeout=5),
              grpc.StatusCode.INVALID_ARGUMENT),
             (lambda: stub.GetJob(coordinator_pb2.GetJobRequest(job_id="nope"), timeout=5),
              grpc.StatusCode.NOT_FOUND),
             (lambda: list(stub.Train(coordinator_pb2.TrainRequest(job_id="nope"), timeout=5)),
              grpc.StatusCode.NOT_FOUND)]  # a server stream
    for call, code in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is code

    def handled(method: str, code: str) -> float | None:
        return registry.get_sample_value("pipefb_grpc_server_handled_total", {
            "grpc_service": "pipefb.v1.Coordinator", "grpc_method": method, "grpc_code": code})

    assert handled("ListWorkers", "OK") == 1
    assert handled("RegisterWorker", "OK") == 1
    assert handled("RegisterWorker", "INVALID_ARGUMENT") == 1
    assert handled("GetJob", "NOT_FOUND") == 1
    deadline = time.monotonic() + 5.0  # an async stream's abort reaches the client first
    while handled("Train", "NOT_FOUND") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handled("Train", "NOT_FOUND") == 1
    assert handled("GetJob", "OK") is None
    timed = registry.get_sample_value("pipefb_grpc_server_handling_seconds_count", {
        "grpc_service": "pipefb.v1.Coordinator", "grpc_method": "RegisterWorker"})
    assert timed == 2


@pytest.mark.parametrize(("value", "port"), [("", None), (" ", None), ("0", 0), ("9100", 9100)])
def test_metrics_port_values(value: str, port: int | None) -> None:
    assert port_or_none(value) == port


@pytest.mark.parametrize("module", ["worker", "coordinator"])
def test_metrics_flags_and_env(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.__main__ import parse_args as coordinator_args
    from worker.__main__ import parse_args as worker_args

    parse = {"worker": worker_args, "coordinator": coordinator_args}[module]
    base = ["--store", "127.0.0.1:1"] if module == "coordinator" else []
    monkeypatch.delenv("PIPEFB_METRICS_PORT", raising=False)
    monkeypatch.delenv("PIPEFB_METRICS_HOST", raising=False)
    args = parse(base)
    assert (args.metrics_port, args.metrics_host) == (None, "127.0.0.1")
    monkeypatch.setenv("PIPEFB_METRICS_PORT", "9100")
    monkeypatch.setenv("PIPEFB_METRICS_HOST", "0.0.0.0")
    args = parse(base)
    assert (args.metrics_port, args.metrics_host) == (9100, "0.0.0.0")
    assert parse([*base, "--metrics-port", ""]).metrics_port is None  # the flag wins
    with pytest.raises(SystemExit) as info:
        parse([*base, "--metrics-port", "http"])
    assert info.value.code == 2


def test_weight_version_lag_and_bubble_of_a_report() -> None:
    from coordinator.metrics import bubble_fraction, weight_version_lag

    def tags(action: str, version: int) -> list[worker_pb2.VersionTag]:
        return [worker_pb2.VersionTag(action=action, step=5, version=version)]

    # async PipeFB, staleness 2, step 5: forwards use version 3; the owner makes version 6
    report = coordinator_pb2.StepReport(workers=[
        coordinator_pb2.WorkerStepStats(role="forward", weight_version=3, versions=tags("0F0", 3),
                                        compute_seconds=0.3, idle_seconds=0.1),
        coordinator_pb2.WorkerStepStats(role="backward", weight_version=6,
                                        versions=tags("0B0", 3), compute_seconds=0.5,
                                        idle_seconds=0.1)])
    assert weight_version_lag(report) == 3
    assert bubble_fraction(report) == pytest.approx(0.2 / 1.0)
    assert weight_version_lag(coordinator_pb2.StepReport()) == 0
    assert bubble_fraction(coordinator_pb2.StepReport()) == 0
