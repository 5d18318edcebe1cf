"""User-style models (tests/plugin_pkg/pipefb_zoo) train exactly on every schedule and
activation policy: parameter-free layers anywhere, frozen layers, BatchNorm's buffers,
in-place ops, dropout, float64, embeddings, torch's TransformerEncoderLayer, a head tied
to the embedding; and a model that cannot be trained is refused at submit with one line
naming its layers."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch

from coordinator.ranks import diagnose
from pipefb.app.cli import main
from pipefb.errors import ConfigError
from pipefb.job.checks import check_job
from pipefb.job.config import JobConfig, build_layers
from pipefb.runtime.checkpoint import load_rank
from pipefb.runtime.evaluate import evaluate
from pipefb.runtime.splitcheck import check_submit
from protos.convert import job_to_proto, plan_from_proto
from tests.conftest import assert_submit_refused
from tests.test_migration import wait_running
from tests.test_transparency import (
    STEPS,
    assert_same_training,
    make_job,
    reference,
    run_on_cluster,
)

DIGITS: dict[str, Any] = {"dataset": "digits", "loss": "cross_entropy"}
TEXT: dict[str, Any] = {"dataset": "text", "loss": "cross_entropy",
                        "dataset_config": {"block_size": 8, "max_bytes": 50_000}}
ZOO: dict[str, dict[str, Any]] = {
    "zoo_relus": DIGITS, "zoo_frozen": DIGITS, "zoo_batchnorm": DIGITS, "zoo_convbn": DIGITS,
    "zoo_inplace": DIGITS, "zoo_dropout": DIGITS, "zoo_double": DIGITS, "zoo_embed": TEXT,
    "zoo_transformer": TEXT, "zoo_bfloat16": DIGITS, "zoo_recurrent": TEXT,
    "zoo_tied": TEXT,  # tests/test_tied.py: its copies, groups, resume, async
    "zoo_max_norm": TEXT,  # an embedding that renormalises its rows in its forward
}
# Models whose split backward runs other kernels than eager autograd: torch's attention
# backward as AOTAutograd traces it differs from its fused eager kernel in the last bits.
# They train with SGD here: AdamW scales a gradient that is zero in exact arithmetic (an
# attention's key bias) up to the learning rate, whatever its rounding noise.
INEXACT = {"zoo_recurrent"}
# (schedule, workers, policy): each model on every sync schedule, the policies rotating
RUNS = [("gpipe", 2, "keep"), ("1f1b", 3, "recompute"), ("gpipe", 3, "offload"),
        ("1f1b", 2, "keep"), ("pipefb", 4, "offload"), ("pipefb", 3, "recompute")]


@pytest.mark.parametrize("model", sorted(ZOO))
@pytest.mark.parametrize(("schedule", "workers", "policy"), RUNS)
def test_a_user_model_trains_as_one_process_does(client: Any, model: str, schedule: str,
                                                 workers: int, policy: str) -> None:
    optimizer = "sgd" if model in INEXACT else "adamw"
    job = make_job(model, schedule, workers, optimizer, policy=policy, **ZOO[model])
    reports, weights = run_on_cluster(client, job)
    assert_same_training(job, reports, weights)
    if model in INEXACT:
        return
    _, want = reference(job)
    different = [name for name, w in want.items() if not torch.equal(weights[name], w)]
    assert different == []  # the same kernels on the same values: bit for bit


def test_frozen_parameters_stay_as_they_were_built(client: Any) -> None:
    job = make_job("zoo_frozen", "pipefb", 4, "adamw", **DIGITS)
    _, weights = run_on_cluster(client, job)
    layers = build_layers(JobConfig(model="zoo_frozen", seed=job.seed, **DIGITS))
    assert torch.equal(weights["layers.0.weight"], layers[0].weight)
    assert torch.equal(weights["layers.2.bias"], layers[2].bias)
    assert torch.equal(weights["layers.3.weight"], layers[3].weight)
    assert not torch.equal(weights["layers.2.weight"], layers[2].weight)


def test_a_refused_model_is_invalid_argument_with_that_line(client: Any) -> None:
    job = make_job("zoo_max_norm_late", "1f1b", 2, "adamw", **TEXT)
    with pytest.raises(grpc.RpcError) as rpc:
        client.submit(job)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details() == f"ConfigError: {REFUSED['zoo_max_norm_late']}"


@pytest.mark.parametrize("groups", [1, 2])
def test_renormalised_rows_end_where_one_process_leaves_them(client: Any, groups: int) -> None:
    """[Note: renormalised rows]: each micro-batch's renorm runs once, in one process's
    order, on every copy of the weight: the forward ranks' and the owners', each group's
    (one group's owner replays the other's micro-batches)."""
    job = make_job("zoo_max_norm", "pipefb", 4, "adamw", groups=groups, **TEXT)
    reports, weights = run_on_cluster(client, job)
    want_losses, want = reference(job)
    if groups == 1:
        assert [r.loss for r in reports] == want_losses
        assert [k for k, v in want.items() if not torch.equal(weights[k], v)] == []
    else:  # the groups' all-reduce adds in another order: a few ulps
        assert_same_training(job, reports, weights)
    initial = build_layers(JobConfig(model="zoo_max_norm", seed=job.seed, **TEXT))[0].weight
    norms = initial.detach().norm(dim=1)
    assert float(norms.min()) > 1.0  # every row the data looks up is renormalised


@pytest.mark.parametrize(("schedule", "workers", "policy"),
                         [("pipefb", 4, "offload"), ("1f1b", 2, "recompute")])
def test_a_frozen_renormalising_embedding_is_renormalised_as_one_process_does(
        client: Any, schedule: str, workers: int, policy: str) -> None:
    """A frozen first layer runs without a backward ([Note: no gradient]); its renorms
    still reach the owner's copy, which the export reads."""
    job = make_job("zoo_max_norm_frozen", schedule, workers, "adamw", policy=policy, **TEXT)
    reports, weights = run_on_cluster(client, job)
    want_losses, want = reference(job)
    assert [r.loss for r in reports] == want_losses
    assert [k for k, v in want.items() if not torch.equal(weights[k], v)] == []
    built = build_layers(JobConfig(model="zoo_max_norm_frozen", seed=job.seed, **TEXT))[0]
    assert not torch.equal(weights["layers.0.weight"], built.weight)  # renormalised


def test_plan_auto_trains_a_renormalising_embedding_as_one_process_does(client: Any) -> None:
    """The profiler and planner take it too (its trace has max_norm off)."""
    job = replace(make_job("zoo_max_norm", "1f1b", 2, "adamw", **TEXT), schedule="auto",
                  plan="auto")
    job_id = client.submit(job).job_id
    reports, weights = list(client.train(job_id)), client.weights(job_id)
    plan = plan_from_proto(client.status(job_id).plan)
    assert plan.mode == "sync"
    # one process on the plan's micro-batches
    assert_same_training(replace(job, schedule="single", plan="even",
                                 microbatches=plan.microbatches), reports, weights)


def test_pipedream_trains_a_renormalising_embedding(client: Any) -> None:
    """PipeDream renormalises the live weights of the rank that owns them, in its
    forwards' order; it trains (no one-process reference to equal)."""
    job = make_job("zoo_max_norm", "pipedream", 3, "adamw", steps=6, **TEXT)
    reports, weights = run_on_cluster(client, job)
    losses = [r.loss for r in reports]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
    single = build_layers(JobConfig(model="zoo_max_norm", seed=job.seed, **TEXT))[0]
    assert not torch.equal(weights["layers.0.weight"], single.weight)


def test_batchnorm_statistics_are_exported_and_used_by_the_held_out_evaluation(client: Any
                                                                              ) -> None:
    """PipeFB's forward ranks run the forwards, so their BatchNorm statistics are the
    model's ([Note: buffer owners]); the held-out evaluation reads them."""
    job = make_job("zoo_batchnorm", "pipefb", 4, "adamw", **DIGITS)
    _, weights = run_on_cluster(client, job)
    _, want = reference(job)
    stats = sorted(k for k in want if "running" in k or "num_batches" in k)
    assert stats == ["layers.1.num_batches_tracked", "layers.1.running_mean",
                     "layers.1.running_var", "layers.4.num_batches_tracked",
                     "layers.4.running_mean", "layers.4.running_var"]
    assert all(torch.equal(weights[k], want[k]) for k in stats)
    assert int(weights["layers.1.num_batches_tracked"]) == STEPS * job.microbatches
    trained = evaluate(job, weights)
    assert trained == evaluate(job, want)
    initial = evaluate(job, {k: v for k, v in weights.items() if k not in stats})
    assert trained["loss"] != initial["loss"]


def test_a_resumed_batchnorm_job_ends_where_the_uninterrupted_one_does(client: Any,
                                                                        cluster: Any) -> None:
    """The forward ranks write their statistics into the checkpoint and read them back."""
    job = make_job("zoo_batchnorm", "pipefb", 4, "adamw", steps=6, checkpoint_every=3,
                   checkpoint_dir="bn-whole", **DIGITS)
    whole, want = run_on_cluster(client, job)
    first = replace(job, steps=3, checkpoint_dir="bn-parts")
    run_on_cluster(client, first)
    files = sorted(p.name for p in (cluster.checkpoint_root / "bn-parts" / "step-000003"
                                    ).iterdir())
    # the backward ranks 2 and 3, and the forward ranks that hold a BatchNorm
    assert {"rank-2.safetensors", "rank-3.safetensors", "manifest.json"} < set(files)
    rest, got = run_on_cluster(client, replace(first, steps=6, resume=True))
    assert [r.loss for r in rest] == [r.loss for r in whole[3:]]
    assert sorted(got) == sorted(want)
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []


@pytest.mark.parametrize(("schedule", "groups"), [("pipefb", 1), ("1f1b", 2)])
def test_batchnorm_statistics_travel_with_a_migration(client: Any, schedule: str,
                                                      groups: int) -> None:
    """A layer move takes a forward layer's statistics from the rank that ran its forward
    (a PipeFB forward rank, whose backward rank's copy never changes; a combined rank in
    each group): the moved job ends where the unmoved one does."""
    job = make_job("zoo_batchnorm", schedule, 4, "adamw", steps=12, groups=groups, **DIGITS)
    _, want = run_on_cluster(client, job)
    job_id = f"bn-move-{schedule}"
    client.submit(replace(job, job_id=job_id))
    status = wait_running(client, job_id, 3)
    old_fwd, old_bwd = list(status.plan.forward_partition), list(status.plan.backward_partition)
    fwd = next(p for p in ([0, 2, 7], [0, 5, 7]) if p != old_fwd)
    bwd = next(p for p in ([0, 5, 7], [0, 2, 7]) if p != old_bwd) if groups == 1 else []
    client.repartition(job_id, fwd, bwd)
    list(client.train(job_id))
    [move] = client.status(job_id).migrations
    assert not move.rolled_back and move.step < job.steps
    got = client.weights(job_id)
    stats = [k for k in want if "running" in k or "num_batches" in k]
    assert len(stats) == 6
    assert [k for k in stats if not torch.equal(got[k], want[k])] == []
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []


def test_a_pipedream_checkpoint_holds_the_statistics_of_its_step_boundary(
        client: Any, cluster: Any) -> None:
    """[Note: boundary buffers]: PipeDream's lead forwards of step 3 run before the
    checkpoint of step 3 is written; its statistics are those before them, where a job of
    3 steps ends (its weights too)."""
    job = make_job("zoo_batchnorm", "pipedream", 3, "adamw", steps=6, checkpoint_every=3,
                   checkpoint_dir="bn-pipedream", eval_every=3, **DIGITS)
    reports, _ = run_on_cluster(client, job)
    three = replace(job, steps=3, checkpoint_every=0, checkpoint_dir="", eval_every=0)
    _, want = run_on_cluster(client, three)
    # the held-out evaluation of version 3 reads the same statistics
    [evaluated] = [dict(r.eval) for r in reports if r.eval]
    assert evaluated["loss"] == pytest.approx(evaluate(three, want)["loss"], rel=1e-6)
    saved: dict[str, torch.Tensor] = {}
    for path in (cluster.checkpoint_root / "bn-pipedream" / "step-000003").glob("rank-*"):
        saved.update(load_rank(path)[0])
    # beside them, the old version step 3's lead forwards ran on (what a resume replays)
    assert {k.split(".", 2)[1] for k in saved if k.startswith("kept.")} == {"2"}
    saved = {k: v for k, v in saved.items() if not k.startswith("kept.")}
    assert sorted(saved) == sorted(want)
    stats = [k for k in want if "running" in k or "num_batches" in k]
    assert int(saved["layers.1.num_batches_tracked"]) == 3 * job.microbatches
    assert [k for k in stats if not torch.equal(saved[k], want[k])] == []
    assert [k for k, v in want.items() if not torch.equal(saved[k], v)] == []


# model -> the one line `check_job` (and so SubmitJob and the CLI) refuses it with (the
# tied model's refusal in async mode: tests/test_tied.py)
ONE_TENSOR = ("each layer hands the next exactly one tensor (tuples and dicts between "
              "layers are not carried; put the layers that pass them into one layer)")
RENORMS = "renormalises its rows in its forward (max_norm)"
WRITES = ("in its forward, which a pipeline whose weights live on another rank cannot "
          "follow: not supported (only an nn.Embedding with max_norm, as the first layer, may)")
REFUSED = {
    "zoo_max_norm_late": f"model 'zoo_max_norm_late': layer 1 (Embedding) {RENORMS} but is "
                         "not the first layer: only the first layer's ids are the data every "
                         "rank can draw to replay it; put it first",
    "zoo_max_norm_tied": f"model 'zoo_max_norm_tied': layer 0 (Embedding) {RENORMS} and its "
                         "weight is also layer 2 (Linear) parameter 'weight': not supported "
                         "(that layer's rank would not see the renormalised rows when one "
                         "process's does)",
    "zoo_max_norm_nested": "model 'zoo_max_norm_nested': layer 0 (Lookup) writes into its "
                           f"parameter 'embedding.weight' {WRITES}",
    "zoo_scale_weight": f"model 'zoo_scale_weight': layer 0 (ScaleWeight) writes into its "
                        f"parameter 'fc.weight' {WRITES}",
    "zoo_pair": f"model 'zoo_pair': layer 0 (Pair) returns a tuple, not one tensor: {ONE_TENSOR}",
    "zoo_named": f"model 'zoo_named': layer 0 (Named) returns a dict, not one tensor: "
                 f"{ONE_TENSOR}",
    "zoo_no_output": "model 'zoo_no_output': layer 0 (NoOutput) returns None, not one tensor "
                     "(does its forward return its result?)",
    "zoo_wrong_width": "model 'zoo_wrong_width', dataset 'digits' and loss 'cross_entropy' do "
                       "not fit: layer 1 (WrongWidth) does not take [2, 16] torch.float32: a "
                       "and b must have same reduction dim, but got [2, 16] X [32, 10].",
}
# model -> the line of a refusal by the split's trace at submit ([Note: split at submit] in
# pipefb.runtime.splitcheck): the shape check passes them and `single` trains them
SPLIT = "cannot be split into its forward and backward parts"
UNSPLIT = {
    "zoo_value_backward": f"model 'zoo_value_backward': layer 1 (ClipGrad) {SPLIT}: its forward "
                          "or backward reads tensor values (Python control flow on a tensor, "
                          ".item() or .tolist()), which the split's trace, on shapes alone, "
                          "cannot follow; compute it with tensor ops (torch.where, clamp)",
    "zoo_detached": f"model 'zoo_detached': layer 1 (Detached) {SPLIT}: its backward does not "
                    "take exactly one gradient, its output's: the output is not "
                    "differentiable in its input and parameters (a detach?), or the forward "
                    "also writes into another tensor that needs a gradient",
}


@pytest.mark.parametrize("model", sorted(REFUSED))
def test_a_model_that_cannot_run_is_refused_at_submit_in_one_line(model: str) -> None:
    extra = TEXT if model.startswith("zoo_max_norm") else DIGITS
    with pytest.raises(ConfigError) as caught:
        check_job(make_job(model, "1f1b", 2, "adamw", **extra))
    assert str(caught.value) == REFUSED[model]


@pytest.mark.parametrize("model", sorted(UNSPLIT))
@pytest.mark.parametrize(("schedule", "workers"), [("pipefb", 4), ("1f1b", 2)])
def test_a_model_whose_split_does_not_trace_is_refused_at_submit(
        client: Any, model: str, schedule: str, workers: int) -> None:
    """Shapes propagate through it, so only the split's trace finds it: at submit, not on
    the workers' Assign; `single` trains it."""
    check_job(make_job(model, schedule, workers, "adamw", **DIGITS))  # the shape check passes
    assert_submit_refused(client, job_to_proto(make_job(model, "1f1b", 2, "adamw", **DIGITS)),
                          {"schedule": schedule, "workers": workers},
                          f"ConfigError: {UNSPLIT[model]}")
    check_submit(make_job(model, "single", 1, "adamw", **DIGITS))


def test_the_cli_refuses_a_model_whose_split_does_not_trace_in_one_line(
        plugin_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["local", "train", "--model", "zoo_value_backward", "--dataset", "digits",
                 "--loss", "cross_entropy", "--schedule", "pipefb", "--workers", "4",
                 "--batch-size", "8", "--microbatches", "4", "--steps", "1"]) == 2
    assert capsys.readouterr().err == f"pipefb: error: {UNSPLIT['zoo_value_backward']}\n"


@pytest.mark.parametrize("model", ["zoo_pair", "zoo_max_norm_late"])
def test_plan_auto_refuses_in_one_line_too(client: Any, plugin_path: Any,
                                           capsys: pytest.CaptureFixture[str], model: str
                                           ) -> None:
    """The coordinator's SubmitJob and the CLI refuse before planning: a status with that
    line, and one `pipefb: error:` line with status 2."""
    extra = TEXT if model.startswith("zoo_max_norm") else DIGITS
    job = replace(make_job(model, "1f1b", 2, "adamw", **extra), schedule="auto", plan="auto")
    with pytest.raises(grpc.RpcError) as rpc:
        client.submit(job)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details() == f"ConfigError: {REFUSED[model]}"
    data = ["--dataset", "text", "--dataset-config", json.dumps(TEXT["dataset_config"])
            ] if extra is TEXT else ["--dataset", "digits"]
    assert main(["local", "train", "--model", model, *data, "--loss", "cross_entropy",
                 "--schedule", "auto", "--plan", "auto", "--workers", "2", "--batch-size", "8",
                 "--microbatches", "4", "--steps", "1"]) == 2
    assert capsys.readouterr().err == f"pipefb: error: {REFUSED[model]}\n"


def test_async_pipefb_refuses_a_renormalising_embedding_and_pipedream_takes_it() -> None:
    with pytest.raises(ConfigError) as caught:
        check_job(make_job("zoo_max_norm", "pipefb", 4, "adamw", mode="async", **TEXT))
    assert str(caught.value) == (
        f"model 'zoo_max_norm': layer 0 (Embedding) {RENORMS}, which async PipeFB cannot "
        "follow: its forward ranks would renormalise an old weight version while the owner "
        "updates the newest; run it in sync mode or with pipedream")
    check_job(make_job("zoo_max_norm", "pipedream", 2, "adamw", **TEXT))


def test_a_failed_call_in_a_job_error_is_one_line_not_the_call_object(client: Any) -> None:
    with pytest.raises(grpc.RpcError) as rpc:
        client.status("no-such-job")
    line = diagnose(rpc.value, None)
    assert line.startswith("NOT_FOUND: ") and "\n" not in line and "<" not in line
    assert line == f"NOT_FOUND: {rpc.value.details()}"
