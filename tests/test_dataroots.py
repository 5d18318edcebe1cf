"""Data roots under attack: a job's dataset reads nothing outside the roots, and a refusal
says the same one line whether the file is missing or not allowed, with nothing of any
file's content or size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipefb.errors import ConfigError
from pipefb.job.data import build_dataset
from pipefb.job.dataroots import DataAccessError, DataRoots, Found
from pipefb.job.sampling import DataContext

SECRET = b"root:x:0:0:the secret is 29b\n"  # the file an attacker wants


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, Path]:
    """A data root with one shard and links out of it, beside a secret outside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "corpus").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    np.arange(100, dtype=np.uint16).tofile(root / "corpus" / "train.bin")
    (root / "link-out").symlink_to(outside / "secret")
    (root / "dir-out").symlink_to(outside)
    (root / "corpus" / "leak.bin").symlink_to(outside / "secret")
    return root, outside


def attacks(root: Path, outside: Path) -> list[str]:
    return ["/etc/passwd", str(outside / "secret"), "../outside/secret",
            "corpus/../../outside/secret", "link-out", "dir-out/secret", "missing.bin",
            "~/secret", "corpus/\0", ""]


def refusal(error: ConfigError, path: str) -> str:
    return str(error).replace(repr(path), "PATH")


@pytest.mark.parametrize("dataset", ["tokens", "text", "arrays"])
def test_every_attack_gets_the_same_one_line(world: tuple[Path, Path], dataset: str) -> None:
    root, outside = world
    context = DataContext(roots=DataRoots.parse(str(root)), block_size=8, vocab_size=256)
    lines = set()
    for path in attacks(root, outside):
        if not path:  # an empty path is "none given" for tokens and arrays
            continue
        with pytest.raises(DataAccessError) as error:
            build_dataset(dataset, {"path": path}, 0, context)
        text = str(error.value)
        shown = refusal(error.value, path)  # the message less the path it echoes (a tmp path
        # may hold any digits)
        assert "\n" not in text and "secret is" not in shown and "29" not in shown
        lines.add(shown)
    assert len(lines) == 1, lines


def test_find_refuses_paths_out_of_every_root(world: tuple[Path, Path]) -> None:
    root, outside = world
    roots = DataRoots.parse(os.pathsep.join([str(root), str(outside / "nowhere")]))
    for path in attacks(root, outside):
        with pytest.raises(DataAccessError):
            roots.find(path, "path")
    assert roots.find("corpus/train.bin", "path").path == (root / "corpus" / "train.bin")
    with pytest.raises(DataAccessError):
        DataRoots().find("corpus/train.bin", "path")  # no roots: nothing is readable


def test_a_walk_never_follows_a_link_out_of_the_root(world: tuple[Path, Path]) -> None:
    root, _ = world
    found = Found(root.resolve(), root.resolve())
    names = [p.name for p in found.files("*")]
    assert names == ["train.bin"]  # leak.bin, link-out and dir-out point outside
    context = DataContext(roots=DataRoots.parse(str(root)), block_size=8)
    shards = build_dataset("tokens", {"path": "corpus", "eval_fraction": 0.0}, 0, context)
    x, _ = shards.microbatch(0, 0, 12)
    assert int(x.max()) < 100  # only train.bin's tokens (the secret's bytes are larger)


def test_a_text_corpus_of_links_out_reads_nothing(world: tuple[Path, Path]) -> None:
    root, _ = world
    (root / "only-links").mkdir()
    (root / "only-links" / "a.txt").symlink_to(root.parent / "outside" / "secret")
    with pytest.raises(ConfigError) as error:
        build_dataset("text", {"path": "only-links", "pattern": "*"}, 0,
                      DataContext(roots=DataRoots.parse(str(root))))
    assert str(error.value) == "text dataset path 'only-links' has no '*' text"


def test_arrays_files_linked_out_of_the_root_are_absent(world: tuple[Path, Path]) -> None:
    root, outside = world
    np.save(outside / "inputs.npy", np.zeros((4, 3), np.float32))
    np.save(outside / "targets.npy", np.zeros(4, np.int64))
    (root / "arr").mkdir()
    for name in ("inputs.npy", "targets.npy"):
        (root / "arr" / name).symlink_to(outside / name)
    with pytest.raises(ConfigError, match=r"holds neither inputs.npy"):
        build_dataset("arrays", {"path": "arr"}, 0, DataContext(roots=DataRoots.parse(str(root))))


def test_the_cli_refuses_a_path_out_of_its_roots_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PIPEFB_DATA_ROOT": str(tmp_path)}
    for path in ("/etc/passwd", "../etc/passwd"):
        run = subprocess.run(
            [sys.executable, "-m", "pipefb.app.cli", "local", "train", "--schedule", "single",
             "--model", "gpt", "--dataset", "tokens", "--dataset-config",
             f'{{"path": "{path}"}}', "--out", str(tmp_path / "out")],
            capture_output=True, text=True, env=env, timeout=120, check=False)
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("\n") == 1 and "root:" not in run.stderr
        assert run.stderr.startswith(f"pipefb: error: tokens dataset path {path!r} is not "
                                     "readable under the data roots")
