"""BatchNorm's running statistics with two data-parallel groups end where one process leaves
them ([Note: group statistics] in pipefb.runtime.groupstats): the replay of the kernel's
update, bit for bit; whole jobs on gpipe, 1f1b and pipefb against `single`; every group's
copy equal."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch

from pipefb.errors import ConfigError
from pipefb.job.checks import check_job
from pipefb.runtime.checkpoint import load_rank
from pipefb.runtime.evaluate import evaluate
from pipefb.runtime.groupstats import batch_statistics, replay
from tests.test_any_model import DIGITS
from tests.test_transparency import make_job, reference, run_on_cluster

STATS = ("running_mean", "running_var", "num_batches_tracked")


@pytest.mark.parametrize("momentum", [0.1, 0.37, None])
@pytest.mark.parametrize("shape", [(4, 7), (3, 37, 5), (2, 130, 3, 3)])
def test_the_replay_is_the_kernels_update_bit_for_bit(momentum: float | None,
                                                      shape: tuple[int, ...]) -> None:
    """Each of 8 micro-batches' updates, replayed from the statistics before it and the
    micro-batch's recorded statistics, gives the module's own buffers; channel counts below,
    at and past the kernel's vector width; momentum None counts."""
    gen = torch.Generator().manual_seed(len(shape) * 10 + int(100 * (momentum or 0)))
    layer = (torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d)(
        shape[1], momentum=momentum)
    assert layer.running_mean is not None and layer.running_var is not None
    with torch.no_grad():
        layer.running_mean.normal_(generator=gen)
        layer.running_var.uniform_(0.5, 2.0, generator=gen)
    stats = (layer.running_mean.clone(), layer.running_var.clone(),
             layer.num_batches_tracked.clone())
    differ = []
    for k in range(8):
        x = torch.randn(shape, generator=gen) * (k + 1) + k
        stats = replay(stats, batch_statistics(layer, x), momentum)
        layer(x)
        differ += [(k, n) for n, got in zip(STATS, stats, strict=True)
                   if not torch.equal(got, getattr(layer, n))]
    assert differ == []
    assert int(stats[2]) == 8


# (model, schedule, policy): 2 groups of 2 workers each; PipeFB's groups are a forward and
# a backward rank (keep is impossible across the split)
RUNS = [("zoo_batchnorm", "gpipe", "keep"), ("zoo_batchnorm", "1f1b", "recompute"),
        ("zoo_batchnorm", "pipefb", "recompute"), ("zoo_convbn", "1f1b", "keep"),
        ("zoo_convbn", "gpipe", "recompute"), ("zoo_convbn", "pipefb", "offload")]


@pytest.mark.parametrize(("model", "schedule", "policy"), RUNS)
def test_two_groups_end_with_one_processs_statistics(client: Any, cluster: Any, model: str,
                                                     schedule: str, policy: str) -> None:
    """One micro-batch per group: the groups' all-reduce adds two gradients, as one
    process does, so losses, weights and statistics all equal `single`'s bit for bit; and
    each group's copy of every statistic (in its rank file of the last checkpoint) is
    that one."""
    job = make_job(model, schedule, 4, "adamw", groups=2, microbatches=2, steps=3,
                   policy=policy, checkpoint_every=3,
                   checkpoint_dir=f"bn-groups-{model}-{schedule}-{policy}", **DIGITS)
    reports, weights = run_on_cluster(client, job)
    want_losses, want = reference(replace(job, checkpoint_every=0, checkpoint_dir=""))
    assert [r.loss for r in reports] == want_losses
    assert sorted(weights) == sorted(want)
    assert [k for k, v in want.items() if not torch.equal(weights[k], v)] == []
    stats = sorted(k for k in want if k.endswith(STATS))
    assert len(stats) == (6 if model == "zoo_batchnorm" else 3)
    assert int(want[stats[0].rsplit(".", 1)[0] + ".num_batches_tracked"]) == 3 * 2
    copies: dict[str, list[torch.Tensor]] = {k: [] for k in stats}
    root = cluster.checkpoint_root / job.checkpoint_dir / "step-000003"
    for path in sorted(root.glob("rank-*.safetensors")):
        for name, value in load_rank(path)[0].items():
            if name in copies:
                copies[name].append(value)
    assert {k: len(v) for k, v in copies.items()} == dict.fromkeys(stats, 2)  # a group each
    assert [k for k, v in copies.items() if not all(torch.equal(c, want[k]) for c in v)] == []



CUMULATIVE = ("model 'zoo_bn_cumulative': layer 1 (BatchNorm1d) has momentum None (a "
              "cumulative average, whose factor 1 / num_batches_tracked is read from a "
              "buffer's value, which pipefb's traces on shapes alone cannot follow): not "
              "supported; give it a momentum (torch's default is 0.1)")


@pytest.mark.parametrize("groups", [1, 2])
def test_a_cumulative_batchnorm_is_refused_at_submit_in_one_line(plugin_path: Any,
                                                                 groups: int) -> None:
    with pytest.raises(ConfigError) as caught:
        check_job(make_job("zoo_bn_cumulative", "1f1b", 4, "adamw", groups=groups, **DIGITS))
    assert str(caught.value) == CUMULATIVE


def test_the_coordinator_refuses_a_cumulative_batchnorm_as_invalid_argument(client: Any
                                                                            ) -> None:
    with pytest.raises(grpc.RpcError) as rpc:
        client.submit(make_job("zoo_bn_cumulative", "pipefb", 4, "adamw", groups=2, **DIGITS))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details() == f"ConfigError: {CUMULATIVE}"


def test_the_held_out_evaluation_reads_one_processs_statistics(client: Any) -> None:
    """The copy a combined rank keeps for the evaluation of version 2 (taken at its OPT)
    holds the replayed statistics: the evaluation is `single`'s after 2 steps."""
    job = make_job("zoo_batchnorm", "1f1b", 4, "adamw", groups=2, microbatches=2, steps=4,
                   eval_every=2, **DIGITS)
    reports, _ = run_on_cluster(client, job)
    [evaluated] = [dict(r.eval) for r in reports if r.eval]
    _, want = reference(replace(job, steps=2, eval_every=0))
    assert evaluated["loss"] == evaluate(replace(job, steps=2, eval_every=0), want)["loss"]
