"""The user's own data and losses: token shards, arrays of samples, the pipefb.datasets
and pipefb.losses entry points, cross_entropy's options; sampling in epoch order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from torch.nn import functional as F

from pipefb.errors import ConfigError
from pipefb.job.checks import check_job
from pipefb.job.config import JobConfig, build_layers
from pipefb.job.data import build_dataset, job_dataset, known_datasets, microbatch_specs
from pipefb.job.dataroots import DataRoots, configure, current
from pipefb.job.losses import build_loss, known_losses
from pipefb.job.sampling import DataContext, EpochOrder
from pipefb.runtime.inputs import MicroBatches

T = 8  # window length of these tests


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Token shards and arrays of samples under one data root."""
    rng = np.random.default_rng(0)
    (tmp_path / "shards").mkdir()
    for i, n in enumerate((101, 57)):  # 12 + 7 windows of T + 1
        rng.integers(0, 200, n, dtype=np.uint16).tofile(tmp_path / "shards" / f"s{i}.bin")
    rng.integers(0, 200, 41, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "inputs.npy", rng.standard_normal((50, 6)).astype(np.float32))
    np.save(tmp_path / "npy" / "targets.npy", rng.integers(0, 3, 50))
    (tmp_path / "st").mkdir()
    save_file({"inputs": rng.standard_normal((30, 2, 3)).astype(np.float32),
               "targets": rng.standard_normal((30, 4)).astype(np.float32)},
              str(tmp_path / "st" / "train.safetensors"))
    return tmp_path


def ctx(root: Path, **extra: Any) -> DataContext:
    return DataContext(roots=DataRoots.parse(str(root)), **{"block_size": T, **extra})


def test_epoch_order_splits_a_step_without_overlap_and_sees_every_sample() -> None:
    order = EpochOrder(40, seed=3, split="train", batch_size=8)
    steps = [torch.cat([order.indices(k, m, 2) for m in range(4)]) for k in range(5)]
    assert all(len(set(s.tolist())) == 8 for s in steps)  # micro-batches (and groups) disjoint
    assert sorted(torch.cat(steps).tolist()) == list(range(40))  # one epoch, each once
    assert torch.equal(order.indices(7, 1, 2), EpochOrder(40, 3, "train", 8).indices(7, 1, 2))
    assert not torch.equal(torch.cat([order.indices(5 + k, m, 2) for k in range(5)
                                      for m in range(4)]), torch.cat(steps))  # a new order


def test_token_windows_are_shard_slices_with_shifted_targets(root: Path) -> None:
    ds = build_dataset("tokens", {"path": "shards", "eval_path": "val.bin"}, 1, ctx(root))
    assert ds.splits == ("train", "eval")
    tokens = [np.fromfile(root / "shards" / f"s{i}.bin", dtype=np.uint16) for i in (0, 1)]
    windows = {tuple(s[j * T:j * T + T + 1].tolist()) for s in tokens
               for j in range((len(s) - 1) // T)}
    assert len(windows) == 19
    x, y = ds.microbatch(0, 0, 19)
    assert x.shape == y.shape == (19, T) and x.dtype == torch.int64
    drawn = {(*a.tolist(), b[-1].item()) for a, b in zip(x, y, strict=True)}
    assert drawn == windows  # the first epoch: each window once
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert microbatch_specs(ds, 5)[0].shape == (5, T)
    xe, _ = ds.microbatch(0, 0, 3, "eval")
    assert set(xe.flatten().tolist()) <= set(np.fromfile(root / "val.bin", np.uint16).tolist())


def test_token_eval_fraction_holds_out_the_last_windows(root: Path) -> None:
    ds = build_dataset("tokens", {"path": "shards/s0.bin", "eval_fraction": 0.25}, 1, ctx(root))
    shard = np.fromfile(root / "shards" / "s0.bin", dtype=np.uint16)
    held = {tuple(shard[j * T:j * T + T].tolist()) for j in range(9, 12)}
    x, _ = ds.microbatch(0, 0, 9)
    assert not {tuple(r.tolist()) for r in x} & held
    xe, _ = ds.microbatch(0, 0, 3, "eval")
    assert {tuple(r.tolist()) for r in xe} == held


@pytest.mark.parametrize(("config", "extra", "needle"), [
    ({"path": "shards", "block_size": 64}, {"block_size": 64},
     "shard 'shards/s1.bin' is shorter than one window of block_size \\+ 1 = 65 tokens"),
    ({"path": "shards", "dtype": "uint32"}, {}, "'shards/s0.bin' is not a whole number of"),
    ({"path": "shards"}, {"vocab_size": 100, "check_all": True},
     "shard 'shards/s0.bin' holds token ids outside the model's vocabulary \\(vocab_size 100\\)"),
    ({"path": "shards", "block_size": 9}, {}, "block_size 9 is longer than the model's"),
    ({"path": "npy"}, {}, "'npy' has no '\\*.bin' shard"),
    ({}, {}, "needs a path"),
])
def test_bad_token_data_is_one_line(root: Path, config: dict[str, Any], extra: dict[str, Any],
                                    needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as error:
        build_dataset("tokens", config, 0, ctx(root, **extra))
    assert "\n" not in str(error.value)


def test_tokens_outside_the_vocabulary_fail_a_draw_too(root: Path) -> None:
    ds = build_dataset("tokens", {"path": "shards"}, 0, ctx(root, vocab_size=100))
    with pytest.raises(ConfigError, match="vocab_size 100"):
        for step in range(4):
            ds.microbatch(step, 0, 8)


def test_arrays_from_npy_and_safetensors(root: Path) -> None:
    ds = build_dataset("arrays", {"path": "npy", "eval_fraction": 0.2}, 2, ctx(root))
    inputs = np.load(root / "npy" / "inputs.npy", allow_pickle=False)
    targets = np.load(root / "npy" / "targets.npy", allow_pickle=False)
    x, y = ds.microbatch(0, 0, 40)  # the whole training split, once
    order = [int(np.flatnonzero((inputs == row.numpy()).all(axis=1))[0]) for row in x]
    assert sorted(order) == list(range(40)) and torch.equal(y, torch.from_numpy(targets[order]))
    xe, _ = ds.microbatch(0, 0, 10, "eval")
    assert {tuple(r.tolist()) for r in xe} == {tuple(r) for r in inputs[40:].tolist()}
    packed = build_dataset("arrays", {"path": "st", "eval_fraction": 0.0}, 2, ctx(root))
    xs, ys = packed.microbatch(1, 1, 4)
    assert xs.shape == (4, 2, 3) and ys.shape == (4, 4) and packed.splits == ("train",)
    assert [s.shape for s in microbatch_specs(packed, 4)] == [(4, 2, 3), (4, 4)]


def test_arrays_never_unpickle(root: Path) -> None:
    (root / "obj").mkdir()
    np.save(root / "obj" / "inputs.npy", np.array([{"x": 1}] * 3, dtype=object),
            allow_pickle=True)
    np.save(root / "obj" / "targets.npy", np.zeros(3))
    with pytest.raises(ConfigError, match=r"'inputs.npy' is not a .npy array of numbers"):
        build_dataset("arrays", {"path": "obj"}, 0, ctx(root))
    np.save(root / "obj" / "inputs.npy", np.zeros((4, 2)))
    with pytest.raises(ConfigError, match="the train inputs and targets do not hold the same"):
        build_dataset("arrays", {"path": "obj"}, 0, ctx(root))


def test_submit_checks_use_the_model_window_and_vocabulary(root: Path) -> None:
    before = current()
    configure(DataRoots.parse(str(root)))
    try:
        job = JobConfig(model="gpt", model_config={"block_size": T, "vocab_size": 256},
                        dataset="tokens", dataset_config={"path": "shards"}, schedule="single")
        check_job(job)
        assert job_dataset(job).microbatch(0, 0, 2)[0].shape == (2, T)
        small = JobConfig(model="gpt", model_config={"block_size": T, "vocab_size": 150},
                          dataset="tokens", dataset_config={"path": "shards"},
                          schedule="single")
        with pytest.raises(ConfigError, match="vocab_size 150"):
            check_job(small)
    finally:
        configure(before)


def test_cross_entropy_options_equal_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen)
    targets = torch.randint(7, (3, 5), generator=gen)
    targets[0, :2] = 0
    loss = build_loss("cross_entropy", {"ignore_index": 0, "label_smoothing": 0.1})
    want = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=0,
                           label_smoothing=0.1)
    torch.testing.assert_close(loss(logits, targets), want, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="label_smoothing = 2"):
        build_loss("cross_entropy", {"label_smoothing": 2})
    with pytest.raises(ConfigError, match=r"'gamma'.*'mse'"):
        build_loss("mse", {"gamma": 1})


def test_entry_points_give_user_datasets_and_losses(plugin_path: Path) -> None:
    assert "toy_stripes" in known_datasets() and "toy_smooth_l1" in known_losses()
    ds = build_dataset("toy_stripes", None, 4)
    x, y = ds.microbatch(0, 0, 3)
    assert x.shape == (3, 64) and y.shape == (3, 10)
    loss = build_loss("toy_smooth_l1", {"beta": 0.5})
    torch.testing.assert_close(loss(x[:, :10], y), F.smooth_l1_loss(x[:, :10], y, beta=0.5))
    with pytest.raises(ConfigError, match=r"unknown loss 'nope'.*'toy_smooth_l1'"):
        build_loss("nope")


def test_ranks_without_inputs_or_targets_read_no_sample(root: Path) -> None:
    before = current()
    configure(DataRoots.parse(str(root)))
    try:
        job = JobConfig(model="gpt", model_config={"block_size": T}, dataset="tokens",
                        dataset_config={"path": "shards"}, schedule="single")
        data = MicroBatches(job, 2, 0, torch.device("cpu"))
        drawn: list[tuple[int, int]] = []
        draw = data.dataset.microbatch

        def counted(step: int, m: int, size: int, split: str = "train"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
            drawn.append((step, m))
            return draw(step, m, size, split)

        data.dataset.microbatch = counted  # type: ignore[method-assign]
        specs = data.layer_specs(build_layers(job))  # what every rank does at assignment
        assert specs[0][0].shape == (2, T) and drawn == []
        data.get(3, 1)  # the first stage's forwards and the loss stage read
        assert drawn == [(3, 1)]
    finally:
        configure(before)
