"""Tied parameters (one `nn.Parameter` on several layers, a GPT-2 head tied to the
embedding) train exactly on every sync schedule: the copies' gradients summed in one
process's order, the copies equal after every step, a resumed job where the
uninterrupted one ends; async mode is refused at submit in one line."""

from __future__ import annotations

import shutil
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch
from torch import nn

from coordinator.results import check_ties_agree
from pipefb.errors import ConfigError, WorkerFailed
from pipefb.job.checks import check_job
from pipefb.job.config import JobConfig, build_layers
from pipefb.runtime.reference import SingleProcess
from pipefb.runtime.tied import autograd_sum, find_ties, secondary_names, tie_stages, untie
from protos import coordinator_pb2
from protos.convert import plan_from_proto
from tests.conftest import worker_threads
from tests.test_migration import wait_running
from tests.test_transparency import MODELS, make_job, reference, run_on_cluster

TEXT: dict[str, Any] = {"dataset": "text", "loss": "cross_entropy",
                        "dataset_config": {"block_size": 8, "max_bytes": 50_000}}
GPT_TIED: dict[str, Any] = {**MODELS["gpt"], "model_config": {**MODELS["gpt"]["model_config"],
                                                              "tie_embeddings": True}}
JOBS: dict[str, dict[str, Any]] = {"zoo_tied": {"model": "zoo_tied", **TEXT}, "gpt": GPT_TIED,
                                   "zoo_tied3": {"model": "zoo_tied3", **TEXT}}
pytestmark = pytest.mark.usefixtures("plugin_path")  # the zoo's entry points
# (schedule, workers, policy): combined and split kinds, the ties on two, three and four
# stages' owners, every activation policy
RUNS = [("gpipe", 2, "keep"), ("1f1b", 3, "recompute"), ("1f1b", 4, "offload"),
        ("pipefb", 4, "offload"), ("pipefb", 3, "recompute")]


def tied_job(name: str, schedule: str, workers: int, **extra: Any) -> JobConfig:
    fields = {**JOBS[name], **extra}
    return make_job(fields.pop("model"), schedule, workers, "adamw", **fields)


def tie_names(job: JobConfig) -> tuple[str, str]:
    """The weight names of the first and the last use of the model's one tie (zoo_tied3's
    middle use is checked by the bit-equality with `single`)."""
    (tie,) = find_ties(build_layers(job))
    (first, a), (last, b) = tie.uses[0], tie.uses[-1]
    return f"layers.{first}.{a}", f"layers.{last}.{b}"


def assert_bit_equal(job: JobConfig, reports: list[Any], weights: dict[str, torch.Tensor]
                     ) -> None:
    want_losses, want = reference(job)
    assert [r.loss for r in reports] == want_losses
    assert sorted(weights) == sorted(want)
    assert [k for k, v in want.items() if not torch.equal(weights[k], v)] == []


@pytest.mark.parametrize("model", sorted(JOBS))
@pytest.mark.parametrize(("schedule", "workers", "policy"), RUNS)
def test_a_tied_model_trains_bit_for_bit_as_one_process(client: Any, model: str,
                                                        schedule: str, workers: int,
                                                        policy: str) -> None:
    job = tied_job(model, schedule, workers, policy=policy, check_groups_every=1)
    reports, weights = run_on_cluster(client, job)
    assert_bit_equal(job, reports, weights)
    first, last = tie_names(job)
    assert torch.equal(weights[first], weights[last])  # the copies stay one parameter
    # every owner of a copy sent its digest after every step, all equal
    for report in reports:
        digests = [d for w in report.workers for d in w.tied_digests.values()]
        assert len(digests) >= 1 and len(set(digests)) == 1


def test_clipping_counts_a_tied_parameter_once(client: Any) -> None:
    """torch's clip_grad_norm_ in one process sees the parameter once; the owners of its
    two copies count it at its first use and scale both by the same norm."""
    job = tied_job("zoo_tied", "pipefb", 4, clip_grad_norm=0.05)
    reports, weights = run_on_cluster(client, job)
    assert_bit_equal(job, reports, weights)
    with worker_threads():
        want = [s.grad_norm for s in SingleProcess(replace(job, schedule="single")).run()]
    assert [r.grad_norm for r in reports] == want and all(n > 0.05 for n in want)


def test_an_auto_plan_profiles_and_trains_a_tied_model_exactly(client: Any) -> None:
    job = tied_job("zoo_tied", "auto", 3, plan="auto")
    job_id = client.submit(job).job_id
    reports = list(client.train(job_id))
    plan = plan_from_proto(client.status(job_id).plan)
    assert plan.mode == "sync"
    assert_bit_equal(replace(job, schedule="single", plan="", microbatches=plan.microbatches),
                     reports, client.weights(job_id))


def test_two_groups_sum_the_tie_then_across_groups(client: Any) -> None:
    """With two groups each group sums its copies' gradients exactly, then the groups'
    all-reduce adds the two halves of the batch: one process adds the micro-batches in
    another order, so the weights agree within a few ulps (as for untied models), and the
    copies on every rank of both groups stay bit-equal."""
    job = tied_job("zoo_tied", "pipefb", 4, groups=2, check_groups_every=1)
    reports, weights = run_on_cluster(client, job)
    want_losses, want = reference(replace(job, groups=1))
    torch.testing.assert_close(torch.tensor([r.loss for r in reports], dtype=torch.float64),
                               torch.tensor(want_losses, dtype=torch.float64), rtol=1e-5,
                               atol=0)
    for name, value in want.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    first, last = tie_names(job)
    assert torch.equal(weights[first], weights[last])
    for report in reports:
        owners = [w for w in report.workers if w.tied_digests]
        assert {w.group for w in owners} == {0, 1}
        assert len({d for w in owners for d in w.tied_digests.values()}) == 1


def test_a_resumed_tied_job_ends_where_the_uninterrupted_one_does(client: Any, cluster: Any
                                                                  ) -> None:
    job = tied_job("zoo_tied", "1f1b", 3, steps=6, checkpoint_every=3,
                   checkpoint_dir="tied-whole")
    whole, want = run_on_cluster(client, job)
    shutil.rmtree(cluster.checkpoint_root / "tied-whole" / "step-000006")
    rest, got = run_on_cluster(client, replace(job, resume=True))
    assert [r.step for r in rest] == [3, 4, 5]
    assert [r.loss for r in rest] == [r.loss for r in whole[3:]]
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []
    first, last = tie_names(job)
    assert torch.equal(got[first], got[last])


def test_a_move_that_brings_both_uses_onto_one_stage_trains_as_without_it(client: Any
                                                                          ) -> None:
    """PipeFB's backward stages first own one use each (an exchange of two members), then
    a move puts layers 0-3 on one stage (the sum stays on one rank) and back."""
    job = tied_job("zoo_tied", "pipefb", 4, steps=12, job_id="tied-move",
                   check_groups_every=1)
    client.submit(job)
    status = wait_running(client, "tied-move", 3)
    fwd = list(status.plan.forward_partition)
    assert list(status.plan.backward_partition) != [0, 4, 5]
    client.repartition("tied-move", fwd, [0, 4, 5])
    wait_running(client, "tied-move", 7)
    client.repartition("tied-move", fwd, [0, 2, 5])
    reports = list(client.train("tied-move"))
    assert len(client.status("tied-move").migrations) == 2
    assert_bit_equal(job, reports, client.weights("tied-move"))


REFUSED_ASYNC = {
    ("pipedream", ""): "model 'zoo_tied': layer 0 (Embedding) parameter 'weight' is also "
                       "layer 3 (Linear) parameter 'weight'; tied parameters train in sync "
                       "mode only, and schedule 'pipedream' runs in async mode here",
    ("pipefb", "async"): "model 'zoo_tied': layer 0 (Embedding) parameter 'weight' is also "
                         "layer 3 (Linear) parameter 'weight'; tied parameters train in sync "
                         "mode only, and schedule 'pipefb' runs in async mode here",
}


@pytest.mark.parametrize(("schedule", "mode"), sorted(REFUSED_ASYNC))
def test_async_mode_refuses_a_tie_in_one_line_naming_both_layers(schedule: str, mode: str
                                                                  ) -> None:
    with pytest.raises(ConfigError) as caught:
        check_job(tied_job("zoo_tied", schedule, 2, mode=mode))
    assert str(caught.value) == REFUSED_ASYNC[(schedule, mode)]


def test_async_refusal_is_invalid_argument_before_any_worker(client: Any) -> None:
    with pytest.raises(grpc.RpcError) as rpc:
        client.submit(tied_job("zoo_tied", "pipedream", 2))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details() == f"ConfigError: {REFUSED_ASYNC[('pipedream', '')]}"


def test_gpt_ties_its_head_to_the_token_embedding_only_when_asked() -> None:
    tied = build_layers(tied_job("gpt", "1f1b", 2))
    assert tied[-2].lm_head.weight is tied[0].wte.weight
    (tie,) = find_ties(tied)
    assert tie.uses == ((0, "wte.weight"), (len(tied) - 2, "lm_head.weight"))
    assert find_ties(build_layers(make_job("gpt", "1f1b", 2, "adamw"))) == []


@pytest.mark.parametrize("uses", [2, 3])
def test_the_sum_is_autograds_order_bit_for_bit(uses: int) -> None:
    """One parameter used by `uses` layers in a chain, 4 micro-batches accumulated by
    autograd; the same per-use, per-micro-batch gradients through `autograd_sum`."""
    torch.manual_seed(0)
    shared = nn.Parameter(torch.randn(16, 16))
    xs = [torch.randn(8, 16) * 10 ** (m % 3) for m in range(4)]
    for x in xs:
        h = x
        for _ in range(uses):
            h = torch.tanh(h @ shared)
        h.square().sum().backward()
    assert shared.grad is not None
    buffer = torch.zeros(uses, len(xs), 16, 16)
    for m, x in enumerate(xs):
        copies = [nn.Parameter(shared.detach().clone()) for _ in range(uses)]
        h = x
        for copy in copies:
            h = torch.tanh(h @ copy)
        h.square().sum().backward()
        for u, copy in enumerate(copies):
            assert copy.grad is not None
            buffer[u, m] = copy.grad
    assert torch.equal(autograd_sum(buffer), shared.grad)
    # the plain sum (uses first, then micro-batches) is not bit-equal: the order matters
    assert not torch.equal(buffer.sum(dim=1).sum(dim=0), shared.grad)


def test_untie_gives_each_later_use_an_equal_parameter_of_its_own() -> None:
    layers = build_layers(tied_job("zoo_tied", "1f1b", 2))
    ties = find_ties(layers)
    assert [t.uses for t in ties] == [((0, "weight"), (3, "weight"))]
    untie(dict(enumerate(layers)), ties)
    assert layers[3].weight is not layers[0].weight
    assert torch.equal(layers[3].weight, layers[0].weight) and layers[3].weight.requires_grad
    assert find_ties(layers) == []


def test_diverged_copies_fail_the_step_naming_the_parameter_and_ranks() -> None:
    report = coordinator_pb2.StepReport(step=4, workers=[
        coordinator_pb2.WorkerStepStats(rank=2, stage=0, tied_digests={"0.weight": "aa"}),
        coordinator_pb2.WorkerStepStats(rank=3, stage=1, tied_digests={"0.weight": "aa"}),
    ])
    check_ties_agree(report)
    report.workers[1].tied_digests["0.weight"] = "ab"
    with pytest.raises(WorkerFailed) as caught:
        check_ties_agree(report)
    assert str(caught.value) == ("tied copies diverged at step 4: parameter 0.weight on "
                                 "rank 2 (stage 0) and rank 3 (stage 1) differ")


def test_the_exchange_members_are_the_stages_that_own_a_use() -> None:
    layers = build_layers(tied_job("zoo_tied3", "1f1b", 2))  # uses on layers 1, 3 and 5
    ties = find_ties(layers)
    assert [t.layers for t in ties] == [[1, 3, 5]]
    assert secondary_names(ties) == {"3.weight", "5.weight"}
    assert tie_stages(ties, [0, 2, 4, 6, 8]) == [0, 1, 2]
    assert tie_stages(ties, [0, 6, 8]) == [0]  # one stage owns every use: no exchange
    assert tie_stages(ties, [0, 1, 3, 8]) == [1, 2]
    frozen = [replace(t, trains=False) for t in ties]
    assert tie_stages(frozen, [0, 2, 4, 6, 8]) == []  # nothing to sum
