"""The user's data on a real cluster: a submit naming a file out of the data roots is
refused in one line and reads nothing; token shards and arrays train exactly as `single`
on 1f1b and pipefb, in groups; a resumed job draws what the uninterrupted one drew; user
datasets and losses come through entry points."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from pipefb.job.config import JobConfig
from pipefb.job.dataroots import DataRoots, configure, current
from pipefb.runtime.manifest import committed
from tests.test_transparency import assert_same_training, make_job, run_on_cluster

SECRET = b"AKIA-the-store-password-29byte"  # 30 bytes an attacker wants to read
GPT = {"model_config": {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                        "block_size": 16}, "loss": "cross_entropy"}
TOKENS = {**GPT, "dataset": "tokens", "dataset_config": {"path": "corpus"}}
ARRAYS = {"model_config": {"hidden": 32, "depth": 3}, "loss": "cross_entropy",
          "dataset": "arrays", "dataset_config": {"path": "digits"}}


@pytest.fixture(scope="module")
def data(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The cluster's data root with a token corpus, arrays of digits, a link out and a
    secret beside the root; this process (the `single` references) reads the same root."""
    root: Path = cluster.data_root
    rng = np.random.default_rng(1)
    (root / "corpus").mkdir(exist_ok=True)
    for i in range(2):
        rng.integers(0, 256, 700, dtype=np.uint16).tofile(root / "corpus" / f"train-{i}.bin")
    (root / "digits").mkdir(exist_ok=True)
    np.save(root / "digits" / "inputs.npy", rng.random((120, 64), dtype=np.float32))
    np.save(root / "digits" / "targets.npy", rng.integers(0, 10, 120))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.bin").write_bytes(SECRET)
    if not (root / "link.bin").is_symlink():
        (root / "link.bin").symlink_to(outside / "secret.bin")
    before = current()
    configure(DataRoots.parse(str(root)))
    yield outside
    configure(before)


ATTACKS = ["/etc/passwd", "../../../../etc/passwd", "/proc/self/environ", "link.bin",
           "corpus/../../secret.bin", "no-such-shard.bin"]


@pytest.mark.parametrize("dataset", ["tokens", "text"])
def test_a_submit_naming_a_file_out_of_the_roots_is_refused_alike(
        client: Any, data: Path, dataset: str) -> None:
    details = set()
    for path in [*ATTACKS, str(data / "secret.bin")]:
        job = make_job("gpt", "1f1b", 2, "adamw", **{**GPT, "dataset": dataset,
                       "dataset_config": {"path": path}})
        with pytest.raises(grpc.RpcError) as rpc:
            client.submit(job)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        line = rpc.value.details()
        assert "\n" not in line and "AKIA" not in line and "root:" not in line
        assert "30" not in line.replace(repr(path), "")  # nor the secret's size
        details.add(line.replace(repr(path), "PATH"))
    assert details == {f"DataAccessError: {dataset} dataset path PATH is not readable under the "
                       "data roots (a path relative to a data root the services were given "
                       "with --data-root; absolute paths, '..' and links out of the root are "
                       "refused)"}


def test_bad_token_data_is_refused_at_submit(client: Any, data: Path) -> None:
    small = make_job("gpt", "1f1b", 2, "adamw", **{**TOKENS, "model_config": {
        **GPT["model_config"], "vocab_size": 100}})
    with pytest.raises(grpc.RpcError) as rpc:
        client.submit(small)
    assert rpc.value.details() == ("ConfigError: tokens shard 'corpus/train-0.bin' holds token "
                                   "ids outside the model's vocabulary (vocab_size 100)")


@pytest.mark.parametrize(("schedule", "workers", "groups"),
                         [("1f1b", 2, 1), ("pipefb", 4, 1), ("1f1b", 4, 2)])
@pytest.mark.parametrize(("model", "spec"), [("gpt", TOKENS), ("mlp", ARRAYS)],
                         ids=["tokens", "arrays"])
def test_user_data_trains_exactly_as_single(client: Any, data: Path, model: str,
                                            spec: dict[str, Any], schedule: str, workers: int,
                                            groups: int) -> None:
    # groups sum gradients in another order; AdamW would scale gpt's near-zero key-bias
    # gradient up to the learning rate (see SYNC_RUNS in tests/test_groups.py): SGD there
    job = make_job(model, schedule, workers, "sgd" if groups > 1 else "adamw", groups=groups,
                   **spec)
    reports, weights = run_on_cluster(client, job)
    assert [r.step for r in reports] == [0, 1, 2]
    assert_same_training(job, reports, weights)


def test_a_resumed_job_draws_what_the_uninterrupted_one_drew(client: Any, cluster: Any,
                                                             data: Path) -> None:
    job = make_job("gpt", "pipefb", 4, "adamw", steps=4, checkpoint_every=2,
                   checkpoint_dir="tokens-whole", **TOKENS)
    whole, want = run_on_cluster(client, job)
    first = replace(job, steps=2, checkpoint_dir="tokens-parts")
    run_on_cluster(client, first)
    assert committed(cluster.checkpoint_root / first.checkpoint_dir)[0].step == 2
    rest, got = run_on_cluster(client, replace(first, steps=4, resume=True))
    assert [r.step for r in rest] == [2, 3]
    assert [r.loss for r in rest] == [r.loss for r in whole[2:]]  # bit for bit
    for name, value in want.items():
        assert np.array_equal(got[name].numpy(), value.numpy()), name


def test_a_user_dataset_and_loss_from_entry_points_train_as_single(client: Any) -> None:
    job = make_job("toy", "1f1b", 2, "adamw", dataset="toy_stripes", loss="toy_smooth_l1",
                   loss_config={"beta": 0.5})
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)


def test_cross_entropy_options_train_as_single(client: Any, data: Path) -> None:
    job = make_job("gpt", "pipefb", 4, "adamw", **{**TOKENS, "loss_config": {
        "ignore_index": 7, "label_smoothing": 0.1}})
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    assert isinstance(job, JobConfig) and job.loss_config["ignore_index"] == 7
