"""The Dockerfile, parsed (no docker build here): stages, non-root user, the torch switch,
generated protobuf code, and commands that agree with the Kubernetes manifests."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import dockerfile
import pytest

from deploy.manifests import build, containers, pod_spec

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = "/opt/venv/bin"


def stages() -> dict[str, list[Any]]:
    """Stage name -> its instructions (FROM first), in file order."""
    out: dict[str, list[Any]] = {}
    current: list[Any] = []
    for command in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        if command.cmd == "FROM":
            assert command.value[1].upper() == "AS", command.original  # every stage is named
            current = out.setdefault(command.value[2], [])
        current.append(command)
    return out


def stages_of(name: str) -> list[list[Any]]:
    """The stage `name` and the stages it is built FROM, nearest first (its inherited ENV)."""
    s, chain = stages(), []
    while name in s:
        chain.append(s[name])
        name = s[name][0].value[0]
    return chain


def instructions(stage: list[Any], cmd: str) -> list[Any]:
    return [c for c in stage if c.cmd == cmd]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pin(requirements: list[str], name: str) -> str:
    [req] = [r for r in requirements if re.match(rf"{re.escape(name)}\s*==", r)]
    return req.split("==")[1].strip()


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict[str, Any]]]:
    return {overlay: build(overlay) for overlay in ("cpu", "gpu")}


def test_stages_and_a_slim_runtime() -> None:
    s = stages()
    assert list(s) == ["wheels", "protos", "deps", "build", "runtime"]
    assert s["wheels"] == s["wheels"][:1] and s["wheels"][0].value[0] == "scratch"  # empty
    bases = {name: stage[0].value[0] for name, stage in s.items()}
    assert bases["build"] == "deps"  # pipefb installed on top of the dependencies
    assert {bases[n] for n in ("protos", "deps", "runtime")} == {
        "python:${PYTHON}-slim-bookworm"}  # same Python in each
    runtime = s["runtime"]
    copies = [c.original for c in instructions(runtime, "COPY")]
    assert copies == ["COPY --from=deps /opt/venv /opt/venv",  # no sources, no build tools
                      "COPY --from=build /opt/pipefb /opt/pipefb"]
    assert not any(re.search(r"\bpip\b", c.value[0]) for c in instructions(runtime, "RUN"))
    env = " ".join(e.original for e in instructions(runtime, "ENV"))
    assert "PYTHONPATH=/opt/pipefb" in env and "PATH=/opt/pipefb/bin:/opt/venv/bin:$PATH" in env


def test_runtime_runs_as_the_manifests_non_root_user(docs: dict[str, list[Any]]) -> None:
    runtime = stages()["runtime"]
    [user] = instructions(runtime, "USER")
    uid, gid = (int(x) for x in user.value[0].split(":"))
    assert uid > 0 and gid > 0  # numeric, so runAsNonRoot can verify it
    assert runtime[-1].cmd in ("CMD", "EXPOSE") and runtime.index(user) > max(
        runtime.index(c) for c in runtime if c.cmd in ("RUN", "COPY"))
    for workload, container in containers(docs["cpu"]):
        if container["image"].startswith("pipefb:"):
            security = {**pod_spec(workload)["securityContext"],
                        **container.get("securityContext", {})}
            if container in pod_spec(workload)["containers"]:
                assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)
            else:  # an init container in another image's pod runs as that pod's user
                assert security["runAsNonRoot"] and security["runAsUser"] > 0


def test_torch_build_argument_chooses_the_wheel_index() -> None:
    build_stage = stages()["deps"]
    args = dict(a.value[0].split("=", 1) for a in instructions(build_stage, "ARG"))
    assert args["TORCH"] == "cpu"
    [install] = [r.value[0] for r in instructions(build_stage, "RUN") if "torch==" in r.value[0]]
    torch_pin = pin(pyproject()["project"]["dependencies"], "torch")
    assert f"torch=={torch_pin}" in install
    cases = dict(re.findall(r"(\w+)\) index=\"\$\{TORCH_INDEX:-([^}]+)\}\"", install))
    assert cases == {"cpu": "https://download.pytorch.org/whl/cpu",
                     "cuda": "https://pypi.org/simple"}  # PyPI's Linux wheel is the CUDA build
    assert "exit 1" in install  # any other value fails the build
    runs = [r.value[0] for r in instructions(build_stage, "RUN")]
    deps = next(i for i, r in enumerate(runs) if "-r /tmp/requirements.txt" in r)
    assert runs.index(install) < deps  # torch first: the rest finds it satisfied
    assert "torch.version.cuda" in install  # a CPU image with a CUDA torch fails its build


def test_every_pip_install_takes_the_wheels_context_and_the_ca_secret() -> None:
    """Without a registry or behind a TLS-inspecting proxy (docs/deploy.md): every pip
    install sees `--build-context wheels=DIR` and trusts `--secret id=ca`, which stays out
    of the layers (a secret mount, never COPY or ENV)."""
    for name, stage in stages().items():
        for run in instructions(stage, "RUN"):
            if "pip install" not in run.value[0]:
                continue
            flags = run.flags
            assert "--mount=type=bind,from=wheels,target=/wheels" in flags, (name, run.original)
            assert "--mount=type=secret,id=ca,required=false" in flags, (name, run.original)
            assert 'PIP_CERT="$(test -f /run/secrets/ca && echo /run/secrets/ca)"' in run.value[0]
        env = " ".join(e.original for s in stages_of(name) for e in instructions(s, "ENV"))
        assert name in ("wheels", "runtime") or "PIP_FIND_LINKS=/wheels" in env, name


def test_a_source_change_reinstalls_pipefb_alone() -> None:
    """The dependencies come from pyproject.toml in a stage no source is copied into, so
    the layer cache keeps them (and torch, and the runtime's copy of the venv) while
    pipefb's code changes; pipefb itself goes to /opt/pipefb, a small layer of its own."""
    s = stages()
    assert [c.original for c in instructions(s["deps"], "COPY")] == ["COPY pyproject.toml ./"]
    assert any("-r /tmp/requirements.txt" in r.value[0] for r in instructions(s["deps"], "RUN"))
    [install] = [r.value[0] for r in instructions(s["build"], "RUN")
                 if "pip install" in r.value[0]]
    assert "pip install --no-deps --target /opt/pipefb ." in install


def test_protobuf_code_is_generated_in_the_image() -> None:
    s = stages()
    protos_runs = [r.value[0] for r in instructions(s["protos"], "RUN")]
    tools = pin(pyproject()["project"]["optional-dependencies"]["test"], "grpcio-tools")
    assert protos_runs[0].endswith(f"pip install grpcio-tools=={tools}")
    assert protos_runs[1:] == ["python -m protos.generate"]
    copies = [c.original for c in instructions(s["build"], "COPY") if "--from=protos" in c.original]
    assert copies == ["COPY --from=protos /src/protos/*_pb2.py /src/protos/*_pb2_grpc.py protos/"]
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert {"protos/*_pb2.py", "protos/*_pb2_grpc.py"} <= set(ignored)  # never copied in


def test_image_commands_agree_with_the_manifests(docs: dict[str, list[Any]]) -> None:
    runtime = stages()["runtime"]
    assert not instructions(runtime, "ENTRYPOINT")  # so a container's `command` is the argv
    [cmd] = instructions(runtime, "CMD")
    assert cmd.json
    env = " ".join(e.original for e in instructions(runtime, "ENV"))
    assert f"PATH=/opt/pipefb/bin:{VENV_BIN}:$PATH" in env
    project = pyproject()
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    commands = {tuple(c["command"]) for overlay in docs.values() for _, c in containers(overlay)
                if c["image"].startswith("pipefb:")}
    assert tuple(cmd.value) in commands  # the default role is one the manifests run
    for command in commands:
        if command[0] == "python":
            assert command[1] == "-m"
            module = command[2]
            assert f"{module}*" in packages and (ROOT / module / "__main__.py").is_file()
        else:
            assert command[0] in project["project"]["scripts"], command
    [expose] = instructions(runtime, "EXPOSE")
    ports = {p["containerPort"] for overlay in docs.values() for _, c in containers(overlay)
             if c["image"].startswith("pipefb:") for p in c.get("ports", [])}
    assert {int(p) for p in expose.value} == ports


def test_every_copied_package_is_in_the_build_context() -> None:
    """.dockerignore ignores everything but what it lists: a package the build copies, or
    that pyproject.toml installs, must be listed, else the build fails."""
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = {c.value[0].split("/")[0] for c in stages()["build"]
              if c.cmd == "COPY" and not c.original.split()[1].startswith("--from")}
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                   ["packages"]["find"]["include"])
    assert {p.rstrip("*") for p in packages} <= allowed
    assert copied <= allowed | {"pyproject.toml", "README.md"}
