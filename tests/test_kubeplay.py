"""The kube-play adapter (deploy/kubeplay.py) on the built cpu overlay: what it changes for
podman 4.3 and that it changes nothing else. scripts/test_container.sh plays the result."""

from __future__ import annotations

import copy
import ipaddress
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.kubeplay import INIT_TYPE, Adapter, PlayPod, secrets_by_name
from deploy.manifests import build, find, pod_spec

SUBNET = "10.89.77.0/24"
VALUES = {("pipefb-redis", "password"): "p" * 32, ("pipefb-auth", "token"): "t" * 43,
          ("pipefb-service", "token"): "s" * 43, ("pipefb-coordinator", "token"): "c" * 43,
          ("pipefb-coordinator-verifier", "verifier"): "d" * 64,
          ("pipefb-tls", "tls.crt"): "CERT", ("pipefb-tls", "tls.key"): "KEY",
          ("pipefb-tls", "ca.crt"): "CA"}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return build("cpu")


@pytest.fixture(scope="module")
def pods(docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[PlayPod]:
    if os.geteuid() != 0:
        pytest.skip("the adapter gives volume files to the pods' users (root only)")
    secrets = {**VALUES}
    for name, key in _secret_keys(docs):  # whatever other Secret the manifests name
        secrets.setdefault((name, key), f"{name}-{key}")
    return Adapter(copy.deepcopy(docs), SUBNET, tmp_path_factory.mktemp("volumes"), secrets,
                   {"steps": 3}).pods()


def _secret_keys(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    keys = set()
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = pod_spec(doc)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    keys.add((ref["name"], ref["key"]))
        for v in spec.get("volumes", []):
            if "secret" in v:
                for item in v["secret"].get("items", []):
                    keys.add((v["secret"]["secretName"], item["key"]))
    return keys


def _containers(pod: PlayPod) -> list[dict[str, Any]]:
    return [*pod.doc["spec"].get("initContainers", []), *pod.doc["spec"]["containers"]]


def test_every_workload_becomes_named_pods_the_job_last(docs: list[dict[str, Any]],
                                                        pods: list[PlayPod]) -> None:
    replicas = find(docs, "StatefulSet", "pipefb-worker")["spec"]["replicas"]
    assert [p.name for p in pods] == [
        "pipefb-coordinator", "pipefb-redis",
        *(f"pipefb-worker-{i}" for i in range(replicas)), "pipefb-submit"]
    assert {p.doc["kind"] for p in pods} == {"Pod"}
    assert pods[-1].doc["spec"]["restartPolicy"] == "Never"  # a Job's pod runs once
    workers = [p for p in pods if p.kind == "StatefulSet"]
    assert [p.doc["spec"]["hostname"] for p in workers] == [p.name for p in workers]
    addresses = [ipaddress.ip_address(p.address) for p in pods]
    assert len(set(addresses)) == len(pods)
    assert all(a in ipaddress.ip_network(SUBNET) for a in addresses)


def test_no_port_is_published_and_images_are_local(pods: list[PlayPod]) -> None:
    for pod in pods:
        for c in _containers(pod):
            assert "ports" not in c and "hostPort" not in str(c)
            assert c["image"] in ("localhost/pipefb:cpu", "docker.io/library/redis:7.4.2")


def test_probes_move_to_the_test_unchanged(docs: list[dict[str, Any]],
                                           pods: list[PlayPod]) -> None:
    for pod in pods:
        for c in _containers(pod):
            assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c)
    [redis] = [p for p in pods if p.name == "pipefb-redis"]
    original = pod_spec(find(docs, "Deployment", "pipefb-redis"))["containers"][0]
    assert redis.probes["redis"] == [(k, original[k]["exec"]["command"])
                                     for k in ("readinessProbe", "livenessProbe")]


def test_names_resolve_to_the_pods_services_select(pods: list[PlayPod]) -> None:
    by_name = {p.name: p for p in pods}
    aliases = {h: a["ip"] for a in pods[0].doc["spec"]["hostAliases"] for h in a["hostnames"]}
    assert all(p.doc["spec"]["hostAliases"] == pods[0].doc["spec"]["hostAliases"] for p in pods)
    assert aliases["pipefb-coordinator"] == by_name["pipefb-coordinator"].address
    assert aliases["pipefb-redis"] == by_name["pipefb-redis"].address
    for pod in (p for p in pods if p.kind == "StatefulSet"):
        env = {e["name"]: e.get("value") for e in pod.doc["spec"]["containers"][0]["env"]}
        assert env["PIPEFB_NAME"] == pod.name  # fieldRef metadata.name
        advertised = env["PIPEFB_ADVERTISE"]  # $(PIPEFB_NAME).pipefb-worker.$(POD_NAMESPACE).svc
        assert advertised == f"{pod.name}.pipefb-worker.pipefb.svc"
        assert aliases[advertised] == pod.address
    assert "pipefb-worker" not in aliases  # headless: per-pod names only


def test_variables_are_expanded_and_secret_refs_kept(docs: list[dict[str, Any]],
                                                      pods: list[PlayPod]) -> None:
    text = yaml.safe_dump([p.doc for p in pods])
    assert "$(" not in text and "fieldRef" not in text

    def refs(containers: list[dict[str, Any]]) -> int:
        return sum("secretKeyRef" in e.get("valueFrom", {})
                   for c in containers for e in c.get("env", []))

    expected = sum(refs([*pod_spec(d).get("initContainers", []), *pod_spec(d)["containers"]])
                   * (d["spec"].get("replicas", 1) if d["kind"] == "StatefulSet" else 1)
                   for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job"))
    assert sum(refs(_containers(p)) for p in pods) == expected > 0


def test_volumes_are_host_directories_of_each_pod_with_decoded_files(
        pods: list[PlayPod]) -> None:
    [coordinator] = [p for p in pods if p.name == "pipefb-coordinator"]
    volumes = {v["name"]: Path(v["hostPath"]["path"]) for v in coordinator.doc["spec"]["volumes"]}
    security = coordinator.doc["spec"]["securityContext"]
    key = volumes["tls"] / "tls.key"
    assert key.read_text() == "KEY"  # decoded, not base64
    stat = key.stat()
    assert (stat.st_uid, stat.st_mode & 0o777) == (security["runAsUser"], 0o440)
    others = [Path(v["hostPath"]["path"]) for p in pods if p is not coordinator
              for v in p.doc["spec"]["volumes"] if v["name"] == "tmp"]
    assert volumes["tmp"] not in others  # an emptyDir is one pod's alone
    [submit] = [p for p in pods if p.kind == "Job"]
    job = {v["name"]: Path(v["hostPath"]["path"]) for v in submit.doc["spec"]["volumes"]}["job"]
    [job_file] = job.iterdir()
    assert yaml.safe_load(job_file.read_text())["steps"] == 3  # the test's change


def test_init_containers_are_kept_and_secrets_regroup(pods: list[PlayPod]) -> None:
    [redis] = [p for p in pods if p.name == "pipefb-redis"]
    assert redis.doc["metadata"]["annotations"] == {INIT_TYPE: "always"}
    assert secrets_by_name(VALUES)["pipefb-tls"] == {"tls.crt": "CERT", "tls.key": "KEY",
                                                    "ca.crt": "CA"}


def test_a_host_path_is_one_directory_of_the_run_every_pod_on_the_node_shares(
        docs: list[dict[str, Any]], pods: list[PlayPod]) -> None:
    """The workers' node /dev/shm (the local tier) becomes one sticky, world-writable
    directory of the run that all worker pods mount, never the host's own /dev/shm."""
    paths = {v["hostPath"]["path"] for p in pods if p.kind == "StatefulSet"
             for v in p.doc["spec"]["volumes"] if v["name"] == "node-shm"}
    workers = find(docs, "StatefulSet", "pipefb-worker")["spec"]["replicas"]
    assert len(paths) == 1 and workers > 1
    [path] = paths
    assert path != "/dev/shm" and Path(path).is_dir()
    assert Path(path).stat().st_mode & 0o7777 == 0o1777
    assert not any(v["name"] == "node-shm" for p in pods if p.kind != "StatefulSet"
                   for v in p.doc["spec"]["volumes"])
