"""pipefb.job.data: deterministic sampling, shapes, held-out splits and config errors."""

from __future__ import annotations

import time

import pytest
import torch

from pipefb.errors import ConfigError
from pipefb.job.data import DATASETS, Dataset, build_dataset, read_corpus
from pipefb.job.dataroots import DataRoots, Found
from pipefb.job.sampling import DataContext

SMALL = {"digits": None, "text": {"max_bytes": 50_000}, "synthetic": {"task": "classification"}}
BUILT_IN = ("digits", "text", "synthetic")  # datasets that need no files of a data root


def rooted(path) -> DataContext:
    """A context whose one data root is `path`."""
    return DataContext(roots=DataRoots.parse(str(path)))


def equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture(scope="module")
def built() -> dict[str, Dataset]:
    return {name: build_dataset(name, SMALL[name], seed=5) for name in BUILT_IN}


def test_names() -> None:
    assert DATASETS == ("digits", "text", "synthetic", "tokens", "arrays")


@pytest.mark.parametrize("name", BUILT_IN)
def test_deterministic_in_seed_step_microbatch(built, name: str) -> None:
    ds, again = built[name], build_dataset(name, SMALL[name], seed=5)
    assert isinstance(ds, Dataset)
    for split in ds.splits:
        first = ds.microbatch(3, 1, 16, split)
        assert equal(first, ds.microbatch(3, 1, 16, split))
        assert equal(first, again.microbatch(3, 1, 16, split))
        assert not equal(first, ds.microbatch(3, 2, 16, split))
        assert not equal(first, ds.microbatch(4, 1, 16, split))
    other = build_dataset(name, SMALL[name], seed=6)
    assert not equal(ds.microbatch(3, 1, 16), other.microbatch(3, 1, 16))


def test_sampling_leaves_global_rng_alone(built) -> None:
    state = torch.random.get_rng_state()
    for ds in built.values():
        ds.microbatch(0, 0, 4)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_digits_shapes_and_split(built) -> None:
    ds = built["digits"]
    x, y = ds.microbatch(0, 0, 32)
    assert x.shape == (32, 64) and x.dtype == torch.float32
    assert y.shape == (32,) and y.dtype == torch.int64
    assert 0.0 <= x.min() and x.max() <= 1.0 and 0 <= y.min() and y.max() <= 9
    train, held = ds.data["train"][0], ds.data["eval"][0]
    assert len(train) + len(held) == 1797 and len(held) == round(1797 * 0.2)
    rows = {tuple(r.tolist()) for r in train}
    assert not any(tuple(r.tolist()) in rows for r in held)  # the 1797 images are distinct
    xe, _ = ds.microbatch(0, 0, 64, "eval")
    assert not any(tuple(r.tolist()) in rows for r in xe)


def test_digits_split_independent_of_seed(built) -> None:
    other = build_dataset("digits", None, seed=99)
    assert torch.equal(other.index["eval"], built["digits"].index["eval"])


def test_text_default_corpus_is_stdlib_and_fast() -> None:
    start = time.perf_counter()
    ds = build_dataset("text", None, seed=0)
    assert time.perf_counter() - start < 1.0
    assert len(ds.data["train"]) + len(ds.data["eval"]) == 2_000_000
    assert len(ds.data["eval"]) == 200_000
    x, y = ds.microbatch(0, 0, 8)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= x.min() and x.max() < 256


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_bytes(b"a" * 600)
    (tmp_path / "b" / "c.txt").write_bytes(b"c" * 400)  # the last 40%: the eval split
    (tmp_path / "b" / "skip.py").write_bytes(b"z" * 100)
    return tmp_path


def test_text_eval_split_is_the_tail(corpus) -> None:
    ds = build_dataset(
        "text",
        {"path": ".", "pattern": "*.txt", "eval_fraction": 0.4, "block_size": 16},
        seed=1, context=rooted(corpus),
    )
    assert ds.splits == ("train", "eval")
    x, y = ds.microbatch(0, 0, 64)
    assert set(x.unique().tolist()) == {ord("a")} and y.shape == (64, 16)
    xe, ye = ds.microbatch(0, 0, 64, "eval")
    assert set(torch.cat([xe, ye]).unique().tolist()) == {ord("c")}


def test_text_reads_sorted_recursively_and_caps(corpus) -> None:
    found = Found(corpus.resolve(), corpus.resolve())
    assert read_corpus(found, "*.txt", 10_000) == b"a" * 600 + b"c" * 400
    assert read_corpus(found, "*.txt", 700) == b"a" * 600 + b"c" * 100
    assert read_corpus(found, "*", 10_000).endswith(b"z" * 100)


def test_text_without_eval(corpus) -> None:
    ds = build_dataset("text", {"path": ".", "eval_fraction": 0.0, "pattern": "*.txt"}, 0,
                       rooted(corpus))
    assert ds.splits == ("train",)
    with pytest.raises(ConfigError, match="'eval'"):
        ds.microbatch(0, 0, 2, "eval")


@pytest.mark.parametrize("task", ["regression", "classification", "tokens"])
def test_synthetic_tasks(task: str) -> None:
    ds = build_dataset("synthetic", {"task": task, "out_features": 4, "vocab_size": 20}, seed=2)
    x, y = ds.microbatch(0, 0, 50)
    if task == "tokens":
        assert x.shape == y.shape == (50, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1]) and 0 <= x.min() and x.max() < 20
    else:
        assert x.shape == (50, 64) and x.dtype == torch.float32
    if task == "regression":
        assert y.shape == (50, 4) and y.dtype == torch.float32
    if task == "classification":
        assert y.shape == (50,) and y.dtype == torch.int64 and 0 <= y.min() and y.max() < 4


def test_synthetic_teacher_from_seed() -> None:
    a, b = (build_dataset("synthetic", None, seed=s) for s in (1, 2))
    assert torch.equal(a.w1, build_dataset("synthetic", None, seed=1).w1)
    assert not torch.equal(a.w1, b.w1)


@pytest.mark.parametrize(
    ("name", "config", "needle"),
    [
        ("imagenet", None, "'imagenet'.*'digits', 'text', 'synthetic', 'tokens', 'arrays'"),
        ("digits", {"shuffle": True}, "'shuffle'.*'digits'"),
        ("text", {"block": 3}, "'block'.*'text'"),
        ("text", {"block_size": 0}, "block_size = 0"),
        ("text", {"path": "/no/such/dir"}, "'/no/such/dir' is not readable under the data"),
        ("synthetic", {"task": "ranking"}, "'ranking'"),
        ("synthetic", {"in_features": -1}, "in_features = -1"),
    ],
)
def test_config_errors(name: str, config: dict | None, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_dataset(name, config, seed=0)


def test_empty_and_too_short_corpus(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"'.' has no"):
        build_dataset("text", {"path": "."}, seed=0, context=rooted(tmp_path))
    (tmp_path / "x.py").write_bytes(b"tiny")
    with pytest.raises(ConfigError, match="shorter than block_size \\+ 1 = 33") as error:
        build_dataset("text", {"path": ".", "eval_fraction": 0.0}, 0, rooted(tmp_path))
    assert "4" not in str(error.value)  # the file's size is not told


@pytest.mark.parametrize("name", BUILT_IN)
def test_bad_requests(built, name: str) -> None:
    with pytest.raises(ConfigError, match="'test'"):
        built[name].microbatch(0, 0, 4, "test")
    with pytest.raises(ConfigError, match="size 0"):
        built[name].microbatch(0, 0, 0)
