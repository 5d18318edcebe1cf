"""Smoke test of the cpu overlay: its containers, run as local processes, train a few steps.

The commands, args and env come from `kubectl kustomize k8s/overlays/cpu`; deploy.localrun
maps only what exists in a cluster alone (DNS names, fixed ports, volumes) onto 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

from deploy import dashboard
from deploy.localrun import LocalDeployment, local_secrets
from deploy.manifests import build, find
from offload_store import connect
from offload_store.acl import SERVICE_USER
from tests.metric_contract import METRIC_NAME, contract_metric, labels_used, queries

STEPS = 3
SECRET = ("pipefb-redis", "password")
BYTE_VOCABULARY = 256  # the text dataset's tokens are bytes


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return build("cpu")


@pytest.fixture(scope="module")
def deployment(docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[LocalDeployment, str]]:
    """Redis, the coordinator and every worker replica of the overlay; one torch thread per
    worker (a test machine may have fewer cores than the manifests' CPU limits add up to)."""
    folder = tmp_path_factory.mktemp("k8s")
    values = local_secrets(folder / "pki")  # stand in for the Secrets an operator creates
    with LocalDeployment(docs, folder, values, {"PIPEFB_THREADS": "1"}) as run, \
            pytest.MonkeyPatch.context() as env:
        for name, value in run.client_env().items():  # this process dials them too
            env.setenv(name, value)
        yield run, values[SECRET]


@pytest.fixture(scope="module")
def trained(deployment: tuple[LocalDeployment, str]) -> subprocess.CompletedProcess[str]:
    """The pipefb-submit Job's command, its job file cut to `STEPS` steps."""
    return deployment[0].submit({"steps": STEPS})


def test_redis_runs_with_the_manifest_settings(deployment: tuple[LocalDeployment, str]
                                               ) -> None:
    run, password = deployment
    address = run.local.address("pipefb-redis:6379")
    assert address.startswith("127.0.0.1:")
    client = connect(address, username=SERVICE_USER, password=password)
    memory, persistence = client.info("memory"), client.info("persistence")
    assert (memory["maxmemory"], memory["maxmemory_policy"]) == (1 << 30, "noeviction")
    assert persistence["aof_enabled"] == 0
    with pytest.raises(redis.exceptions.NoPermissionError):  # the service user's limits
        client.config_get("save")
    with pytest.raises(redis.AuthenticationError):  # the default user is off
        connect(address, username=None, password=None, retry=Retry(NoBackoff(), 0)).ping()


def test_the_submit_job_trains_to_the_end(deployment: tuple[LocalDeployment, str],
                                          trained: subprocess.CompletedProcess[str]) -> None:
    from coordinator.client import CoordinatorClient
    from protos import coordinator_pb2

    assert trained.returncode == 0, trained.stderr[-3000:]
    job_id, *lines = trained.stdout.splitlines()
    steps = [re.fullmatch(r"step (\d+) loss (\S+) lr (\S+) (\S+) samples/s", line)
             for line in lines]
    assert None not in steps, lines
    assert [int(m[1]) for m in steps if m] == list(range(STEPS))
    losses = [float(m[2]) for m in steps if m]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(BYTE_VOCABULARY)) < 0.3  # an untrained byte model
    assert losses[-1] < losses[0]
    with CoordinatorClient(deployment[0].local.address("pipefb-coordinator:50051")) as client:
        status = client.status(job_id)
        workers = client.workers()
    assert coordinator_pb2.JobState.Name(status.state) == "DONE"
    assert status.spec.steps == STEPS and status.spec.model == "gpt"
    # names from the pods' metadata.name, addresses from PIPEFB_ADVERTISE (mapped locally)
    assert sorted(w.name for w in workers) == [f"pipefb-worker-{i}" for i in range(4)]
    assert all(w.alive and w.address.startswith("127.0.0.1:") for w in workers)


def _exported(url: str) -> dict[str, set[str]]:
    """Series name -> label names of one /metrics page (no samples yet: no labels)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    series: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_dashboard_queries_name_metrics_the_services_export(
        deployment: tuple[LocalDeployment, str], trained: subprocess.CompletedProcess[str],
        docs: list[dict[str, Any]]) -> None:
    """Against the live /metrics of every service after a job ran; skips only when the
    services serve no metrics at all (no `metrics http://` line)."""
    urls = deployment[0].metrics_urls(wait_s=2.0)  # printed right after `ready` if at all
    if not urls:
        pytest.skip("the services print no `metrics http://` line (no --metrics-port yet)")
    replicas = find(docs, "StatefulSet", "pipefb-worker")["spec"]["replicas"]
    assert sorted(urls) == ["pipefb-coordinator",
                            *(f"pipefb-worker-{i}" for i in range(replicas))]
    exported: dict[str, set[str]] = {}
    for url in urls.values():
        for name, labels in _exported(url).items():
            exported.setdefault(name, set()).update(labels)
    board = json.loads(dashboard.dashboard_json())
    for expr in queries(board):
        names = METRIC_NAME.findall(expr)
        assert [n for n in names if n not in exported] == [], expr
        live = set().union(*(exported[n] for n in names))
        if live:  # labels are known once a series has samples
            contract = set().union(*(contract_metric(n)[1] for n in names))  # type: ignore[index]
            assert labels_used(expr) & contract <= live | {"le"}, expr


def test_local_paths_and_addresses_replace_cluster_ones(deployment: tuple[LocalDeployment, str],
                                                        tmp_path: Path) -> None:
    local = deployment[0].local
    assert local.address("pipefb-coordinator.pipefb.svc.cluster.local:50051") == local.address(
        "pipefb-coordinator:50051")
    assert local.address("pipefb-worker-2.pipefb-worker.pipefb.svc") == "127.0.0.1"
    env = local.env({"A": "0.0.0.0:9", "PIPEFB_METRICS_PORT": "9090", "HOME": "/tmp"},
                    {"/tmp": tmp_path})
    assert env == {"A": "127.0.0.1:0", "PIPEFB_METRICS_PORT": "0", "HOME": str(tmp_path)}


def test_the_manifests_probe_passes_over_mtls_and_plaintext_is_refused(
        deployment: tuple[LocalDeployment, str], docs: list[dict[str, Any]]) -> None:
    """The readiness probe's own command, aimed at the local coordinator, with the pod's
    TLS settings: SERVING. Without them the handshake fails and the probe says so."""
    import os
    import sys

    from deploy.manifests import main_container

    probe = main_container(find(docs, "Deployment", "pipefb-coordinator"))["readinessProbe"]
    argv = [sys.executable, *probe["exec"]["command"][1:-1],
            deployment[0].local.address("pipefb-coordinator:50051")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    ok = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    plain = {k: v for k, v in env.items() if not k.startswith(("PIPEFB_TLS", "PIPEFB_MTLS"))}
    refused = subprocess.run(argv, env=plain, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


def test_workers_on_this_one_node_share_the_host_path_directory(
        docs: list[dict[str, Any]], tmp_path: Path) -> None:
    """A hostPath is the node's: every local worker gets the same directory under it as
    its local tier (PIPEFB_LOCAL_TIER_DIR), and a pod's own volumes stay its own."""
    run = LocalDeployment(docs, tmp_path, local_secrets(tmp_path / "pki"))
    workers = find(docs, "StatefulSet", "pipefb-worker")
    envs = [run._container(workers, f"pipefb-worker-{i}", {})[1] for i in range(2)]
    tiers = {env["PIPEFB_LOCAL_TIER_DIR"] for env in envs}
    assert tiers == {str(tmp_path / "node" / "node-shm" / "pipefb")}
    assert envs[0]["HOME"] != envs[1]["HOME"]  # the emptyDir on /tmp
