"""An AST scan of every Python source of the product: nothing imports a code-bearing
serializer (pickle, dill, cloudpickle, marshal, shelve, joblib), calls eval, exec or
compile, loads YAML unsafely, or calls torch.load / numpy.load without weights_only=True /
allow_pickle=False. Tests may write a pickle on purpose (to check it is refused), so they
are scanned for loading only."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("pipefb", "protos", "worker", "coordinator", "offload_store", "deploy", "bench",
           "scripts")
BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib",
                  "_pickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
#: call -> (keyword, the only value it may have): loaders that unpickle unless told not to
GUARDED = {("torch", "load"): ("weights_only", True), ("numpy", "load"): ("allow_pickle", False),
           ("np", "load"): ("allow_pickle", False), ("yaml", "load"): ("Loader", None),
           ("yaml", "unsafe_load"): ("", None), ("yaml", "full_load"): ("", None),
           ("torch", "save"): ("", None)}


def sources(folders: tuple[str, ...]) -> Iterator[Path]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not path.name.endswith("_pb2.py") and not path.name.endswith("_pb2_grpc.py"):
                yield path


def findings(path: Path, loading_only: bool = False) -> list[str]:
    """Every unsafe import or call in one file, as `path:line what`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:" \
                f"{getattr(node, 'lineno', 0)}"
        if not loading_only and isinstance(node, ast.Import | ast.ImportFrom):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            out += [f"{where} imports {n}" for n in names
                    if n.split(".")[0] in BANNED_MODULES]
        if isinstance(node, ast.Call):
            out += _call_findings(node, where, loading_only)
    return out


def _call_findings(node: ast.Call, where: str, loading_only: bool) -> list[str]:
    func = node.func
    if isinstance(func, ast.Name) and func.id in BANNED_CALLS:
        return [f"{where} calls {func.id}"]
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return []
    key = (func.value.id, func.attr)
    if key not in GUARDED or (loading_only and key == ("torch", "save")):
        return []
    keyword, required = GUARDED[key]
    given = {k.arg: k.value for k in node.keywords}
    value = given.get(keyword)
    if keyword == "Loader" and isinstance(value, ast.Attribute) and value.attr == "SafeLoader":
        return []
    if keyword and isinstance(value, ast.Constant) and value.value is required is not None:
        return []
    return [f"{where} calls {'.'.join(key)} without {keyword or 'a safe form'}"]


def test_the_product_never_deserializes_code() -> None:
    scanned = list(sources(PRODUCT))
    assert len(scanned) > 50  # the scan sees the code
    assert [f for path in scanned for f in findings(path)] == []


def test_tests_never_load_a_pickle() -> None:
    assert [f for path in sources(("tests",)) for f in findings(path, loading_only=True)] == []


# the unsafe forms are spelled from parts, so that no line of this file reads as one
TORCH_LOAD = "torch" + ".load"


@pytest.mark.parametrize("code, what", [
    ("import pickle", "imports pickle"), ("from dill import loads", "imports dill"),
    ("eval('1')", "calls eval"), (f"{TORCH_LOAD}(f)", f"calls {TORCH_LOAD} without weights_only"),
    (f"{TORCH_LOAD}(f, weights_only=False)", f"calls {TORCH_LOAD} without weights_only"),
    ("np.load(f)", "calls np.load without allow_pickle"),
    ("yaml.load(s)", "calls yaml.load without Loader"),
    ("yaml.unsafe_load(s)", "calls yaml.unsafe_load without a safe form")])
def test_the_scan_catches_each_unsafe_form(tmp_path: Path, code: str, what: str) -> None:
    path = tmp_path / "probe.py"
    path.write_text(code + "\n")
    assert [f.split(" ", 1)[1] for f in findings(path)] == [what]


@pytest.mark.parametrize("code", ["torch.load(f, weights_only=True)",
                                  "np.load(f, allow_pickle=False)",
                                  "yaml.load(s, Loader=yaml.SafeLoader)", "layer.eval()"])
def test_the_scan_lets_safe_forms_through(tmp_path: Path, code: str) -> None:
    path = tmp_path / "probe.py"
    path.write_text(code + "\n")
    assert findings(path) == []
