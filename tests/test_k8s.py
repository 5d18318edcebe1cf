"""The Kubernetes manifests: every overlay builds, validates strictly, and keeps its invariants."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy.manifests import (
    WORKLOADS,
    Doc,
    build,
    containers,
    find,
    find_prefixed,
    main_container,
    overlays,
    pod_labels,
    pod_spec,
    workloads,
)
from pipefb.job.config import JobConfig

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = "1.37.0"  # the schemas kubernetes-validate checks against
GPU = "nvidia.com/gpu"
SECRET = ("pipefb-redis", "password")
# Env vars the services read that the manifests may leave unset, with why the default is
# right in the cluster.
DEFAULT_IS_RIGHT = {
    "PIPEFB_CACHE_DIR": "read only by `pipefb plan` / local runs (calibration cache)",
    "PIPEFB_USERS_FILE": "optional: users besides the admin (docs/deploy.md)",
    "PIPEFB_STORE_SOCKET": "a local cluster's Redis unix socket; on Kubernetes Redis is "
                           "another pod, reached over TCP",
    "PIPEFB_LOCAL_HOPS": "on by default, and only a peer at a loopback address gets a hop "
                         "socket: pods reach each other at their pod addresses",
    "PIPEFB_STORE_CHUNK_BYTES": "the store's chunk size for large values; the default "
                                "suits any Redis ([Note: chunked values])",
    "PIPEFB_CPUS": "the kubelet's static CPU manager pins a Guaranteed pod's container "
                   "(docs/deploy.md, [Note: pinned workers])",
}
# Env vars a worker must not get: the user's token, the coordinator's credential and the
# store's service user; it takes calls of the coordinator's credential (checked against
# its verifier) and of its peers' service credential, and stashes as each job's own
# store user
NOT_FOR_WORKERS = {"PIPEFB_TOKEN_FILE", "PIPEFB_USERS_FILE", "PIPEFB_STORE_USER",
                   "PIPEFB_STORE_PASSWORD", "PIPEFB_COORDINATOR_TOKEN_FILE"}
SERVICE_DIRS = ("coordinator", "worker", "offload_store", "dataplane", "protos")
PIPEFB_CONTAINERS = {"pipefb-coordinator": "coordinator", "pipefb-worker": "worker"}


@pytest.fixture(scope="module")
def built() -> dict[str, list[Doc]]:
    return {name: build(name) for name in overlays()}


def test_every_overlay_builds_the_same_resources(built: dict[str, list[Doc]]) -> None:
    assert sorted(built) == ["cpu", "gpu"]
    for docs in built.values():
        # the job ConfigMap's name carries kustomize's content hash
        names = sorted((d["kind"], re.sub(r"^pipefb-job-[a-z0-9]+$", "pipefb-job",
                                           d["metadata"]["name"])) for d in docs)
        assert names == [
            ("ConfigMap", "pipefb-dashboard"), ("ConfigMap", "pipefb-job"),
            ("Deployment", "pipefb-coordinator"), ("Deployment", "pipefb-redis"),
            ("Job", "pipefb-submit"), ("Namespace", "pipefb"),
            ("PersistentVolumeClaim", "pipefb-data"), ("PodMonitor", "pipefb"),
            ("Service", "pipefb-coordinator"), ("Service", "pipefb-redis"),
            ("Service", "pipefb-worker"), ("StatefulSet", "pipefb-worker")]
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
            "pipefb"}


def test_kubernetes_validate_strict_accepts_every_resource(built: dict[str, list[Doc]]) -> None:
    """The PodMonitor is a CRD without a bundled schema; test_podmonitor checks it."""
    for docs in built.values():
        for doc in docs:
            if doc["kind"] != "PodMonitor":
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field(built: dict[str, list[Doc]]) -> None:
    worker = copy.deepcopy(find(built["cpu"], "StatefulSet", "pipefb-worker"))
    main_container(worker)["resource"] = {"limits": {"cpu": "1"}}  # typo of `resources`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


def test_gpus_only_in_worker_limits_of_the_gpu_overlay(built: dict[str, list[Doc]]) -> None:
    assert GPU not in yaml.safe_dump_all(built["cpu"])
    for workload, container in containers(built["gpu"]):
        resources = container.get("resources", {})
        assert GPU not in resources.get("requests", {})
        expected = 1 if workload["metadata"]["name"] == "pipefb-worker" else None
        assert resources.get("limits", {}).get(GPU) == expected, workload["metadata"]["name"]
    job = yaml.safe_load(find_prefixed(built["gpu"], "ConfigMap", "pipefb-job")["data"]["job.yaml"])
    assert job["device"] == "cuda"


def _port_numbers(container: Doc) -> dict[str | int, int]:
    ports = container.get("ports", [])
    return {**{p["name"]: p["containerPort"] for p in ports if "name" in p},
            **{p["containerPort"]: p["containerPort"] for p in ports}}


def test_probe_ports_are_container_ports(built: dict[str, list[Doc]]) -> None:
    probes = 0
    for docs in built.values():
        for workload, container in containers(docs):
            ports = _port_numbers(container)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                probes += 1
                handler = next(k for k in ("grpc", "tcpSocket", "httpGet", "exec") if k in probe)
                if handler in ("grpc", "tcpSocket", "httpGet"):
                    assert probe[handler]["port"] in ports, (workload["metadata"]["name"], kind)
    assert probes == 2 * (3 + 3 + 2)


def test_grpc_services_are_probed_over_mtls_on_their_grpc_port(
        built: dict[str, list[Doc]]) -> None:
    for name in PIPEFB_CONTAINERS:
        workload = next(w for w in workloads(built["cpu"]) if w["metadata"]["name"] == name)
        container = main_container(workload)
        grpc_port = _port_numbers(container)["grpc"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[kind]["exec"]["command"] == [
                "python", "-m", "protos.probe", f"127.0.0.1:{grpc_port}"]
            assert container[kind]["timeoutSeconds"] >= 3  # a Python start, then one call
        listen = {e["name"]: e.get("value") for e in container["env"]}["PIPEFB_LISTEN"]
        assert listen == f"0.0.0.0:{grpc_port}"


def test_services_select_pods_and_target_named_ports(built: dict[str, list[Doc]]) -> None:
    docs = built["cpu"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selected = [w for w in workloads(docs)
                    if service["spec"]["selector"].items() <= pod_labels(w).items()]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = _port_numbers(main_container(selected[0]))
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"]


def test_podmonitor_selects_the_service_pods_on_their_metrics_port(
        built: dict[str, list[Doc]]) -> None:
    for docs in built.values():
        monitor = find(docs, "PodMonitor", "pipefb")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor["spec"]) == {"selector", "podMetricsEndpoints"}
        selector = monitor["spec"]["selector"]
        assert set(selector) == {"matchLabels"}
        selected = {w["metadata"]["name"] for w in workloads(docs)
                    if selector["matchLabels"].items() <= pod_labels(w).items()}
        assert selected == set(PIPEFB_CONTAINERS)
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s",
                            "honorLabels": True}  # keeps pipefb's own `job` label
        for name in selected:
            container = main_container(find(docs, _kind(docs, name), name))
            port = _port_numbers(container)[endpoint["port"]]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert (env["PIPEFB_METRICS_PORT"], env["PIPEFB_METRICS_HOST"]) == (str(port),
                                                                                "0.0.0.0")


def _kind(docs: list[Doc], name: str) -> str:
    return next(w["kind"] for w in workloads(docs) if w["metadata"]["name"] == name)


def env_vars_read() -> dict[str, set[str]]:
    """PIPEFB_* names in the service packages' sources -> the packages that name them."""
    found: dict[str, set[str]] = {}
    for folder in SERVICE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"[\"'](PIPEFB_[A-Z0-9_]+)[\"']", path.read_text()):
                found.setdefault(name, set()).add(folder)
    return found


def test_every_env_var_the_services_read_is_set(built: dict[str, list[Doc]]) -> None:
    read = env_vars_read()
    assert {"PIPEFB_LISTEN", "PIPEFB_STORE", "PIPEFB_COORDINATOR", "PIPEFB_STORE_PASSWORD",
            "PIPEFB_NAME", "PIPEFB_ADVERTISE", "PIPEFB_THREADS"} <= set(read)
    for docs in built.values():
        for name, role in PIPEFB_CONTAINERS.items():
            env = {e["name"] for e in main_container(find(docs, _kind(docs, name), name))["env"]}
            needed = {var for var, where in read.items()
                      if where & {role, "offload_store", "protos"} and var not in
                      DEFAULT_IS_RIGHT}
            if role == "worker":
                needed -= NOT_FOR_WORKERS
                assert sorted(env & NOT_FOR_WORKERS) == [], name
            else:  # the coordinator holds its own credential, not the workers' verifier,
                needed.discard("PIPEFB_COORDINATOR_VERIFIER_FILE")  # and no tier (its
                needed.discard("PIPEFB_LOCAL_TIER_BYTES")  # PIPEFB_LOCAL_TIER_DIR is "")
                assert {"name": "PIPEFB_LOCAL_TIER_DIR", "value": ""} in main_container(
                    find(docs, _kind(docs, name), name))["env"], name
            assert sorted(needed - env) == [], name


def test_secrets_come_from_the_redis_secret(built: dict[str, list[Doc]]) -> None:
    refs = [(e["name"], e["valueFrom"]["secretKeyRef"])
            for _, c in containers(built["cpu"]) for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})]
    # the coordinator's and the ACL file's writer: workers hold no store password
    assert sorted(n for n, _ in refs) == ["PIPEFB_STORE_PASSWORD", "PIPEFB_STORE_PASSWORD",
                                         "REDISCLI_AUTH"]
    assert {(r["name"], r["key"]) for _, r in refs} == {SECRET}
    assert all(d["kind"] != "Secret" for d in built["cpu"])  # created out of band, not committed


def test_redis_runs_with_password_memory_limit_noeviction_no_persistence(
        built: dict[str, list[Doc]]) -> None:
    deployment = find(built["cpu"], "Deployment", "pipefb-redis")
    container = main_container(deployment)
    args = container["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {"--aclfile": "/acl/users.acl", "--maxmemory": "1gb",
                     "--maxmemory-policy": "noeviction", "--save": "", "--appendonly": "no",
                     "--dir": "/data"}
    assert container["command"] == ["redis-server"]


def test_redis_password_reaches_redis_in_a_file_never_on_a_command_line(
        built: dict[str, list[Doc]]) -> None:
    """The init container writes offload_store.acl's users from the Secret into a memory
    volume that Redis reads; no argument of any container names a secret variable (Redis
    would get `$(VAR)` expanded onto its command line, visible in every process list)."""
    deployment = find(built["cpu"], "Deployment", "pipefb-redis")
    spec = pod_spec(deployment)
    [init] = spec["initContainers"]
    assert init["command"] == ["python", "-m", "offload_store", "--write-acl", "/acl/users.acl"]
    [password] = [e for e in init["env"] if e["name"] == "PIPEFB_STORE_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": SECRET[0], "key": SECRET[1]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["acl"]["emptyDir"] == {"medium": "Memory"}
    mounts = {m["name"]: m for m in main_container(deployment)["volumeMounts"]}
    assert mounts["acl"] == {"name": "acl", "mountPath": "/acl", "readOnly": True}
    secret_vars = {e["name"] for _, c in containers(built["cpu"]) for e in c.get("env", [])
                   if "secretKeyRef" in e.get("valueFrom", {})}
    for workload in built["cpu"]:
        if workload["kind"] not in WORKLOADS:
            continue
        every = [*pod_spec(workload).get("initContainers", []), *pod_spec(workload)["containers"]]
        for c in every:
            argv = " ".join([*c.get("command", []), *c.get("args", [])])
            assert not any(f"$({v})" in argv for v in secret_vars), (c["name"], argv)


def test_redis_probes_authenticate_as_the_acl_user(built: dict[str, list[Doc]]) -> None:
    """The default user is off, so a probe that connects without the ACL user (a bare
    tcpSocket or `redis-cli ping`) would fail or prove nothing: both probes PING as it."""
    container = main_container(find(built["cpu"], "Deployment", "pipefb-redis"))
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind]["exec"]["command"] == ["redis-cli", "--user", "pipefb", "ping"]
    auth = [e for e in container["env"] if e["name"] == "REDISCLI_AUTH"]
    assert auth[0]["valueFrom"]["secretKeyRef"] == {"name": SECRET[0], "key": SECRET[1]}


def test_workers_have_stable_names_and_dns(built: dict[str, list[Doc]]) -> None:
    for docs in built.values():
        _check_worker_identity(docs)


def _check_worker_identity(docs: list[Doc]) -> None:
    workers = find(docs, "StatefulSet", "pipefb-worker")
    service = find(docs, "Service", workers["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    env = main_container(workers)["env"]
    order = [e["name"] for e in env]
    by_name = {e["name"]: e for e in env}
    assert by_name["PIPEFB_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert by_name["POD_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    advertise = by_name["PIPEFB_ADVERTISE"]["value"]
    assert advertise == f"$(PIPEFB_NAME).{service['metadata']['name']}.$(POD_NAMESPACE).svc"
    # Kubernetes expands $(VAR) only from variables defined earlier in the list
    assert order.index("PIPEFB_ADVERTISE") > max(order.index("PIPEFB_NAME"),
                                                 order.index("POD_NAMESPACE"))
    coordinator = find(docs, "Service", "pipefb-coordinator")
    assert by_name["PIPEFB_COORDINATOR"]["value"] == (
        f"pipefb-coordinator:{coordinator['spec']['ports'][0]['port']}")


def test_pods_run_non_root_with_read_only_root_and_resources(
        built: dict[str, list[Doc]]) -> None:
    for docs in built.values():
        for workload, container in containers(docs):
            pod = pod_spec(workload)
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] > 0
            assert pod["automountServiceAccountToken"] is False
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert "memory" in container["resources"]["limits"]
            if container["image"].startswith("pipefb:"):
                _assert_tmp_is_writable(pod, container)


def _assert_tmp_is_writable(pod: Doc, container: Doc) -> None:
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": mounts["/tmp"], "emptyDir": {}}
    assert {"name": "HOME", "value": "/tmp"} in container["env"]


def test_one_image_per_overlay_for_every_pipefb_role(built: dict[str, list[Doc]]) -> None:
    for overlay, tag in (("cpu", "cpu"), ("gpu", "cuda")):
        images = {c["image"] for _, c in containers(built[overlay])
                  if not c["image"].startswith("redis:")}
        assert images == {f"pipefb:{tag}"}


def test_submit_job_sends_the_mounted_job_to_the_coordinator(
        built: dict[str, list[Doc]]) -> None:
    for docs in built.values():
        job = find(docs, "Job", "pipefb-submit")
        container = main_container(job)
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "job"]
        assert container["command"] == [
            "pipefb", "submit", "--coordinator", "pipefb-coordinator:50051", "--follow",
            f"{mount['mountPath']}/job.yaml"]
        volume = next(v for v in pod_spec(job)["volumes"] if v["name"] == "job")
        spec: dict[str, Any] = yaml.safe_load(
            find(docs, "ConfigMap", volume["configMap"]["name"])["data"]["job.yaml"])
        config = JobConfig.from_dict(spec)
        replicas = find(docs, "StatefulSet", "pipefb-worker")["spec"]["replicas"]
        assert config.workers == replicas
        assert pod_spec(job)["restartPolicy"] == "Never"


def test_monitoring_values_pick_up_the_dashboard_and_the_podmonitor(
        built: dict[str, list[Doc]]) -> None:
    """k8s/monitoring-values.yaml (kube-prometheus-stack) matches what the manifests label."""
    values = yaml.safe_load((ROOT / "k8s" / "monitoring-values.yaml").read_text())
    sidecar = values["grafana"]["sidecar"]["dashboards"]
    dashboard = find(built["cpu"], "ConfigMap", "pipefb-dashboard")
    assert dashboard["metadata"]["labels"][sidecar["label"]] == sidecar["labelValue"] == "1"
    assert sidecar["enabled"] is True and sidecar["searchNamespaces"] == "ALL"
    prometheus = values["prometheus"]["prometheusSpec"]
    assert prometheus["podMonitorSelectorNilUsesHelmValues"] is False
    assert prometheus["podMonitorNamespaceSelector"] == prometheus["podMonitorSelector"] == {}


# [Note: access]: which token files each gRPC process gets, from which Secret (and key)
AUTH = {"PIPEFB_TOKEN_FILE": ("/etc/pipefb-auth/token", "pipefb-auth")}
SERVICE = {"PIPEFB_SERVICE_TOKEN_FILE": ("/etc/pipefb-service/token", "pipefb-service")}
TOKENS = {"coordinator": {**AUTH, **SERVICE, "PIPEFB_COORDINATOR_TOKEN_FILE": (
              "/etc/pipefb-coordinator/token", "pipefb-coordinator")},
          "worker": {**SERVICE, "PIPEFB_COORDINATOR_VERIFIER_FILE": (
              "/etc/pipefb-coordinator-verifier/verifier", "pipefb-coordinator-verifier")},
          "submit": AUTH}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_every_grpc_process_gets_mtls_and_only_its_own_tokens_from_secrets(
        built: dict[str, list[Doc]], overlay: str) -> None:
    """Coordinator, workers and the submit Job: certificate, key and CA from the Secret
    pipefb-tls; the admin's token (pipefb-auth) for the coordinator and the submit Job,
    the service credential (pipefb-service) for the coordinator and the workers, the
    coordinator's own (pipefb-coordinator) for it alone and its verifier
    (pipefb-coordinator-verifier) for the workers; each mounted read-only and named by
    the env, and nothing else."""
    want = {"PIPEFB_TLS_CERT": "/etc/pipefb-tls/tls.crt", "PIPEFB_TLS_KEY":
            "/etc/pipefb-tls/tls.key", "PIPEFB_TLS_CA": "/etc/pipefb-tls/ca.crt",
            "PIPEFB_MTLS": "1", "PIPEFB_TLS_SERVER_NAME": "pipefb"}
    seen = []
    for workload, container in containers(built[overlay]):
        name = container["name"]
        if name not in TOKENS:
            continue
        seen.append(name)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in want} == want, name
        tokens = {k: v for k, v in env.items() if k.endswith(("TOKEN_FILE", "VERIFIER_FILE"))}
        assert tokens == {k: file for k, (file, _) in TOKENS[name].items()}
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        secrets = {volumes[m["name"]]["secret"]["secretName"]: path
                   for path, m in mounts.items() if "secret" in volumes[m["name"]]}
        assert secrets == {"pipefb-tls": "/etc/pipefb-tls",
                           **{s: f.rsplit("/", 1)[0] for f, s in TOKENS[name].values()}}, name
        assert all(mounts[path]["readOnly"] is True for path in secrets.values())
    assert sorted(seen) == ["coordinator", "submit", "worker"]


def test_services_read_data_only_from_the_read_only_data_claim(
        built: dict[str, list[Doc]]) -> None:
    for docs in built.values():
        claim = find(docs, "PersistentVolumeClaim", "pipefb-data")
        assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
        for name in PIPEFB_CONTAINERS:
            workload = find(docs, _kind(docs, name), name)
            container = main_container(workload)
            env = {e["name"]: e.get("value") for e in container["env"]}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            mount = mounts[env["PIPEFB_DATA_ROOT"]]
            assert mount.get("readOnly") is True, name
            volume = {v["name"]: v for v in pod_spec(workload)["volumes"]}[mount["name"]]
            assert volume["persistentVolumeClaim"] == {"claimName": "pipefb-data",
                                                       "readOnly": True}, name


def _bytes(quantity: str) -> int:
    """A memory quantity of the manifests ("16Gi", "512Mi") in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()  # type: ignore[union-attr]
    return int(number) << (30 if unit == "Gi" else 20)


def test_workers_share_the_nodes_tmpfs_as_the_local_tier(built: dict[str, list[Doc]]) -> None:
    """Every worker pod mounts its node's /dev/shm and names a directory under it as the
    local tier, capped well inside its memory limit (tmpfs pages count there); nothing
    else mounts a host path, and the coordinator names no tier."""
    for overlay, docs in built.items():
        workers = find(docs, "StatefulSet", "pipefb-worker")
        container = main_container(workers)
        env = {e["name"]: e.get("value") for e in container["env"]}
        volumes = {v["name"]: v for v in pod_spec(workers)["volumes"]}
        [(mount, volume)] = [(m, volumes[m["name"]]) for m in container["volumeMounts"]
                             if "hostPath" in volumes[m["name"]]]
        assert volume["hostPath"] == {"path": "/dev/shm", "type": "Directory"}, overlay
        assert not mount.get("readOnly")  # the workers write their segments there
        tier = env["PIPEFB_LOCAL_TIER_DIR"]
        assert tier.startswith(mount["mountPath"] + "/") and tier != mount["mountPath"] + "/"
        limit = _bytes(container["resources"]["limits"]["memory"])
        assert 0 < int(env["PIPEFB_LOCAL_TIER_BYTES"]) <= limit // 4, overlay
        hosts = [(w["metadata"]["name"], v["hostPath"]["path"]) for w in workloads(docs)
                 for v in pod_spec(w).get("volumes", []) if "hostPath" in v]
        assert hosts == [("pipefb-worker", "/dev/shm")], overlay
        coordinator = main_container(find(docs, "Deployment", "pipefb-coordinator"))
        assert {"name": "PIPEFB_LOCAL_TIER_DIR", "value": ""} in coordinator["env"]


def test_gpu_workers_prefer_the_node_of_other_workers(built: dict[str, list[Doc]]) -> None:
    """The GPU overlay packs workers onto a node (preferred, by the label every worker
    pod carries, per host); the CPU overlay leaves placement to the scheduler."""
    workers = find(built["gpu"], "StatefulSet", "pipefb-worker")
    [term] = pod_spec(workers)["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector.items() <= pod_labels(workers).items()
    assert selector == workers["spec"]["selector"]["matchLabels"]  # workers, nothing else
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert "affinity" not in pod_spec(find(built["cpu"], "StatefulSet", "pipefb-worker"))
