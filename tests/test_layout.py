"""Architecture rules: the core imports no grpc/redis/prometheus; generated stubs are fresh."""

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
