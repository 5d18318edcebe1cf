"""Architecture rules: the package layers of docs/architecture.md, module sizes, no import
cycles, the service libraries only where they belong; generated stubs are fresh."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pipefb
from protos import generate

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("grpc", "redis", "prometheus_client")
HAND_WRITTEN = ("pipefb", "protos", "worker", "coordinator", "offload_store", "dataplane",
                "calibration", "deploy", "bench", "tests", "scripts")
MAX_MODULE_LINES = 600
MAX_TOP_MODULES = 12  # modules directly in pipefb/ (packages excluded)
# Layers, lowest first: a module may import its own layer or a lower one, never a higher.
# The modules directly in pipefb/ are the base; pipefb.app (the CLI) is the top and the
# only core package that reaches the services.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pipefb.errors", "pipefb.configparse", "pipefb.seeding", "pipefb.codec",
     "pipefb.allocator", "pipefb.memory", "pipefb.processes", "pipefb.secretfiles",
     "pipefb.plugins", "pipefb.cpus"),
    ("pipefb.models", "pipefb.schedule"),
    ("pipefb.job",),
    ("pipefb.plan",),
    ("pipefb.sim",),
    ("pipefb.planner",),
    ("pipefb.runtime",),
    ("pipefb.profile",),
    ("protos", "offload_store"),
    ("dataplane",),
    ("worker", "coordinator"),
    ("calibration",),
    ("pipefb.app",),
)
# Which service library each package may import (everything else imports none of them).
LIBRARY_OWNERS = {"redis": ("offload_store",),
                  "grpc": ("protos", "dataplane", "worker", "coordinator", "calibration"),
                  "grpc_health": ("protos", "worker", "coordinator", "calibration"),
                  "prometheus_client": ("protos", "worker", "coordinator")}


def core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(pipefb.__path__, "pipefb."))


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_core_sources_import_no_service_library() -> None:
    sources = sorted((ROOT / "pipefb").rglob("*.py"))
    assert len(sources) > 10
    offenders = {str(p.relative_to(ROOT)): imported_names(p) & set(FORBIDDEN) for p in sources}
    assert {p: n for p, n in offenders.items() if n} == {}


def test_importing_the_core_loads_no_grpc_or_prometheus() -> None:
    """(torch itself may import redis for its compile cache, so only these two are checked)."""
    modules = core_modules()
    assert "pipefb.runtime.stage" in modules and "pipefb.app.cli" in modules
    checked = ("grpc", "prometheus_client")
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"print(sorted(n for n in sys.modules if n.split('.')[0] in {checked!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.strip()
    assert out == "[]"


def test_generated_stubs_match_the_protos(tmp_path: Path) -> None:
    """Regenerate with: python -m protos.generate"""
    assert generate.main(tmp_path) == 0
    for fresh in sorted((tmp_path / "protos").iterdir()):
        assert fresh.read_text() == (ROOT / "protos" / fresh.name).read_text(), fresh.name


def _sources() -> list[Path]:
    out = []
    for top in HAND_WRITTEN:
        out += [p for p in (ROOT / top).rglob("*.py") if "_pb2" not in p.name]
    return sorted(out)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module a source imports, at its top or inside a function (lazy imports
    count: they only hide a dependency); `if TYPE_CHECKING:` blocks excepted."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}:{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; `from PACKAGE import SUBMODULE` counts as an
    import of the submodule alone."""
    modules = {_module(p): p for p in _sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            module, _, attr = imported.partition(":")
            deps.add(f"{module}.{attr}" if f"{module}.{attr}" in modules else module)
        graph[name] = {m for m in deps if m in modules and m != name}
    return graph


def _layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_no_hand_written_module_is_over_600_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _sources()}
    assert len(sizes) > 100
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_pipefb_has_at_most_12_modules_of_its_own() -> None:
    top = sorted(p.name for p in (ROOT / "pipefb").glob("*.py") if p.name != "__init__.py")
    assert 0 < len(top) <= MAX_TOP_MODULES, top


def test_no_import_cycle_between_modules() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_packages_depend_downwards_only() -> None:
    upward = []
    for module, deps in sorted(_graph().items()):
        here = _layer(module)
        if here is None:
            continue
        upward += [f"{module} -> {d}" for d in sorted(deps)
                   if (there := _layer(d)) is not None and there > here]
    assert upward == []


def test_every_core_and_service_module_has_a_layer() -> None:
    unplaced = [m for m in _graph() if m.split(".")[0] in HAND_WRITTEN[:7]
                and m not in HAND_WRITTEN and _layer(m) is None]
    assert unplaced == []


def test_service_libraries_are_imported_only_by_their_owners() -> None:
    offenders = []
    for path in _sources():
        module = _module(path)
        if module.split(".")[0] in ("tests", "bench", "scripts", "deploy"):
            continue
        for lib in {n.split(".")[0] for n in _imports(path)} & set(LIBRARY_OWNERS):
            if module.split(".")[0] not in LIBRARY_OWNERS[lib]:
                offenders.append(f"{module} imports {lib}")
    assert offenders == []
