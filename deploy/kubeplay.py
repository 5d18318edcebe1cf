"""Adapts a built overlay (`kubectl kustomize k8s/overlays/cpu`) to what `podman kube
play` 4.3 runs, so the manifests' own containers, commands, env, users and security
contexts run as pods on one machine.

[Note: kube play adapter] Each change answers one limitation of podman 4.3's kube play;
nothing else of a container is touched, so a wrong flag, variable or user in the
manifests fails here as in a cluster:
- it ignores StatefulSet, Job, Service, Namespace and PodMonitor, and makes one pod per
  Deployment under a generated name: every workload becomes plain Pods (a StatefulSet
  one per replica, named `NAME-i` with its `hostname`; the Job one Pod that runs once);
- it has no Services or cluster DNS: each pod gets a static address on an `--internal`
  network, and every pod's `hostAliases` map each Service's names (and a headless
  Service's per-pod names) to the addresses of the pods it selects;
- it publishes every `containerPort` on the host's 0.0.0.0 (two workers collide, and
  nothing may listen outside loopback): ports are dropped; pods reach each other on the
  internal network only;
- it does not expand `$(VAR)` and resolves no `fieldRef`: both are resolved here, the way
  the kubelet does (earlier variables of the same container, metadata.name/namespace);
- it panics on a Secret volume without `optional`, writes Secret `data` still
  base64-encoded and ignores `stringData` and `defaultMode`; and it shares an emptyDir of
  one name between pods: Secret, ConfigMap and emptyDir volumes become host directories
  of this pod alone, their files decoded and owned by the pod's user and fsGroup with the
  Secret's mode (a memory-medium emptyDir is a plain directory here); a
  PersistentVolumeClaim is one directory its pods share (the test's job reads no data
  from it); a hostPath is the node's: the pods play on one node, so one directory of the
  run stands for it, shared by every pod that mounts that path, with the mode of a
  node's /dev/shm (1777: anyone may make an entry, only its owner remove it), and the
  host's own path is never mounted;
- it reads env `secretKeyRef` only from a podman secret holding a flat JSON object of
  base64 values: the caller creates one per Secret (`Podman.secret`); those entries are
  kept as written;
- it turns only liveness probes into health checks, run by systemd timers this machine
  lacks: probes are removed from the played pods and run by the test itself
  (`probes`, each through `podman exec`);
- it looks images up by short names through registries it cannot reach: `image:` gets
  the fully qualified local name;
- it removes a run-once init container as soon as it exits and fails the play when that
  races with the container still running ("cannot remove container ... as it is
  running"): init containers are marked `always` (podman's annotation), which keeps them.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deploy.manifests import Doc, pod_spec

IMAGES = {"pipefb": "localhost/pipefb", "redis": "docker.io/library/redis"}  # short -> local
INIT_TYPE = "io.podman.annotations.init.container.type"  # once (default) or always
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
START_ORDER = ("Deployment", "StatefulSet", "Job")  # the submit Job's pod starts last


@dataclass
class PlayPod:
    """One pod to play: its name, address, the YAML podman gets, its probes."""

    name: str
    kind: str  # the workload kind it came from
    address: str
    doc: Doc
    probes: dict[str, list[tuple[str, list[str]]]] = field(default_factory=dict)
    # container name -> [(probe kind, exec command)]

    def containers(self) -> list[str]:
        """podman's names of the pod's main containers (`POD-CONTAINER`)."""
        return [f"{self.name}-{c['name']}" for c in self.doc["spec"]["containers"]]


def _pods_of(workload: Doc) -> list[str]:
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(workload["spec"].get("replicas", 1))]
    return [name]


def _selects(service: Doc, workload: Doc) -> bool:
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    selector = service["spec"].get("selector", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _resolve_env(container: Doc, pod: str, namespace: str) -> None:
    """fieldRef and $(VAR) resolved as the kubelet does; secretKeyRef entries kept."""
    seen: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            value = {"metadata.name": pod, "metadata.namespace": namespace}[path]
            entry.pop("valueFrom")
            entry["value"] = value
        if "value" in entry:
            entry["value"] = _VAR.sub(lambda m: seen.get(m[1], m[0]), str(entry["value"]))
            seen[entry["name"]] = entry["value"]
    for key in ("command", "args"):
        if key in container:
            container[key] = [_VAR.sub(lambda m: seen.get(m[1], m[0]), str(a))
                              for a in container[key]]


def _image(name: str) -> str:
    repo, _, tag = name.partition(":")
    return f"{IMAGES.get(repo, repo)}:{tag or 'latest'}"


class Adapter:
    """Turns a built overlay into `PlayPod`s (see [Note: kube play adapter]).

    Args:
        docs: the built overlay.
        subnet: the internal network's subnet; pods get its addresses from .10 on.
        volumes: where the pods' volume directories are made.
        secrets: (Secret name, key) -> value, the Secrets an operator creates.
        job_changes: keys to replace in the job ConfigMap's YAML files (e.g. fewer steps).
    """

    def __init__(self, docs: list[Doc], subnet: str, volumes: Path,
                 secrets: Mapping[tuple[str, str], str],
                 job_changes: Mapping[str, object] | None = None) -> None:
        self.docs, self.volumes, self.secrets = docs, volumes, secrets
        self.job_changes = dict(job_changes or {})
        self.hosts = ipaddress.ip_network(subnet).hosts()
        for _ in range(9):  # .1 is the gateway; pods from .10
            next(self.hosts)

    def pods(self) -> list[PlayPod]:
        """Every pod, in start order (the submit Job's last)."""
        workloads = sorted((d for d in self.docs if d["kind"] in START_ORDER),
                           key=lambda d: START_ORDER.index(d["kind"]))
        pods = [PlayPod(name, w["kind"], str(next(self.hosts)), w)
                for w in workloads for name in _pods_of(w)]
        aliases = self._aliases(pods)
        return [self._pod(p, aliases) for p in pods]

    def _aliases(self, pods: list[PlayPod]) -> list[Doc]:
        """hostAliases entries: each Service's names -> the addresses of the pods it selects."""
        names: dict[str, list[str]] = {}
        for service in (d for d in self.docs if d["kind"] == "Service"):
            svc, ns = service["metadata"]["name"], service["metadata"].get("namespace", "default")
            long = [svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"]
            for pod in pods:
                if not _selects(service, pod.doc):
                    continue
                if service["spec"].get("clusterIP") == "None":  # headless: per-pod names
                    names.setdefault(pod.address, []).extend(f"{pod.name}.{n}" for n in long[1:])
                else:
                    names.setdefault(pod.address, []).extend(long)
        return [{"ip": ip, "hostnames": hostnames} for ip, hostnames in names.items()]

    def _pod(self, pod: PlayPod, aliases: list[Doc]) -> PlayPod:
        workload = pod.doc
        namespace = workload["metadata"].get("namespace", "default")
        spec = copy.deepcopy(pod_spec(workload))
        spec["hostAliases"] = aliases
        if workload["kind"] == "StatefulSet":
            spec["hostname"] = pod.name
        if workload["kind"] == "Job":
            spec["restartPolicy"] = "Never"
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            _resolve_env(container, pod.name, namespace)
            container.pop("ports", None)
            container["image"] = _image(container["image"])
            found = [(kind, container.pop(kind)["exec"]["command"])
                     for kind in PROBES if kind in container]
            if found:
                pod.probes[container["name"]] = found
        spec["volumes"] = [self._volume(pod.name, spec, v) for v in spec.get("volumes", [])]
        metadata = {"name": pod.name,
                    "labels": workload["spec"]["template"]["metadata"].get("labels", {})}
        if spec.get("initContainers"):
            metadata["annotations"] = {INIT_TYPE: "always"}
        doc = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
        return PlayPod(pod.name, pod.kind, pod.address, doc, pod.probes)

    def _volume(self, pod: str, spec: Doc, volume: Doc) -> Doc:
        """A Secret, ConfigMap or emptyDir volume as a host directory of this pod alone; a
        claim, or a hostPath, as one directory every pod mounting it shares (empty here)."""
        if "hostPath" in volume:
            path = volume["hostPath"]["path"]
            folder = self.volumes / "node" / (path.strip("/").replace("/", "-") or "root")
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o1777)  # as a node's /dev/shm
            return {"name": volume["name"],
                    "hostPath": {"path": str(folder), "type": "Directory"}}
        if "persistentVolumeClaim" in volume:
            folder = self.volumes / "claims" / volume["persistentVolumeClaim"]["claimName"]
            folder.mkdir(parents=True, exist_ok=True)
            return {"name": volume["name"],
                    "hostPath": {"path": str(folder), "type": "Directory"}}
        folder = self.volumes / pod / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        security = spec.get("securityContext", {})
        uid = security.get("runAsUser", 0)
        gid = security.get("fsGroup", security.get("runAsGroup", 0))
        if "secret" in volume:
            name, mode = volume["secret"]["secretName"], volume["secret"].get("defaultMode", 0o644)
            files = {k: v for (s, k), v in self.secrets.items() if s == name}
            if not files:
                raise KeyError(f"no values for the Secret {name!r}")
            self._write(folder, files, mode, uid, gid)
        elif "configMap" in volume:
            [config] = [d for d in self.docs if d["kind"] == "ConfigMap"
                        and d["metadata"]["name"] == volume["configMap"]["name"]]
            files = {k: self._changed(k, v) for k, v in config["data"].items()}
            self._write(folder, files, 0o644, uid, gid)
        elif "emptyDir" not in volume:
            raise ValueError(f"pod {pod}: volume {volume['name']!r} is of a kind the adapter "
                             "does not map")
        os.chown(folder, uid, gid)
        folder.chmod(0o770 if "emptyDir" in volume else 0o750)
        return {"name": volume["name"],
                "hostPath": {"path": str(folder), "type": "Directory"}}

    def _changed(self, key: str, text: str) -> str:
        if self.job_changes and key.endswith((".yaml", ".yml")):
            changed: str = yaml.safe_dump({**yaml.safe_load(text), **self.job_changes},
                                          sort_keys=False)
            return changed
        return text

    @staticmethod
    def _write(folder: Path, files: Mapping[str, str], mode: int, uid: int, gid: int) -> None:
        for key, value in files.items():
            path = folder / key
            path.write_text(value)
            os.chown(path, uid, gid)
            path.chmod(mode)


def write_pod(pod: PlayPod, folder: Path) -> Path:
    """The pod's YAML, as `podman kube play` reads it."""
    path = folder / f"{pod.name}.yaml"
    path.write_text(yaml.safe_dump(pod.doc, sort_keys=False))
    return path


def secrets_by_name(values: Mapping[tuple[str, str], str]) -> dict[str, dict[str, str]]:
    """(Secret, key) -> value regrouped as Secret -> {key: value} (one podman secret each)."""
    out: dict[str, dict[str, str]] = {}
    for (name, key), value in values.items():
        out.setdefault(name, {})[key] = value
    return out

