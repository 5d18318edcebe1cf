"""Mixed precision on real clusters: bf16 pipelines equal the one process running the same
autocast, their stash keeps bfloat16, bad precisions are refused at submit; the explicit
split traced under autocast equals eager autocast."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipefb.app.cli import main
from pipefb.job.config import JobConfig
from pipefb.job.losses import build_loss
from pipefb.job.precision import autocast
from pipefb.job.shapes import spec_of
from pipefb.models import build_model
from pipefb.profile.analytic import analytic_profile
from pipefb.profile.measure import measure_profile
from pipefb.runtime.layersplit import LayerSplit
from pipefb.runtime.reference import SingleProcess
from protos.convert import job_to_proto
from tests.conftest import assert_submit_refused
from tests.test_device import needs_cuda
from tests.test_transparency import assert_same_training, make_job, reference, run_on_cluster

# (schedule, workers, groups): combined and split kinds, and two groups where they apply
RUNS = [("gpipe", 2, 1), ("1f1b", 3, 1), ("pipefb", 4, 1), ("pipefb", 4, 2), ("1f1b", 4, 2)]
BF16: dict[str, Any] = {"precision": "bf16", "lr_schedule": "cosine", "warmup_steps": 1,
                        "clip_grad_norm": 0.5, "steps": 4}


def gpt_job(schedule: str, workers: int, groups: int, **extra: Any) -> JobConfig:
    return make_job("gpt", schedule, workers, "adamw", groups=groups, **{**BF16, **extra})


@pytest.mark.parametrize(("schedule", "workers", "groups"), RUNS)
def test_bf16_pipeline_equals_one_process_under_the_same_autocast(
        client: Any, schedule: str, workers: int, groups: int) -> None:
    job = gpt_job(schedule, workers, groups)
    reports, weights = run_on_cluster(client, job)
    want_losses, want_weights = reference(job)
    if groups == 1:  # the same kernels on the same numbers: bit for bit
        assert [r.loss for r in reports] == want_losses
        for name, want in want_weights.items():
            torch.testing.assert_close(weights[name], want, rtol=0, atol=0, msg=name)
    else:  # the groups' all-reduce adds float32 gradients in another order
        assert_same_training(job, reports, weights, atol=1e-6)
    fp32_losses, _ = reference(replace(job, precision="fp32"))
    assert fp32_losses[0] != want_losses[0]  # autocast changed the numbers


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_bf16_offloaded_and_recomputed_layers_equal_one_process(client: Any, policy: str
                                                                 ) -> None:
    """A combined rank's offloaded stash goes through the store in bfloat16; a recomputed
    forward runs the same captured casts again."""
    job = gpt_job("1f1b", 2, 1, policy=policy)
    reports, weights = run_on_cluster(client, job)
    want_losses, want_weights = reference(job)
    assert [r.loss for r in reports] == want_losses
    for name, want in want_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=0, atol=0, msg=name)


def test_bf16_stash_keeps_bfloat16_and_its_bytes_shrink(client: Any) -> None:
    bf16 = gpt_job("pipefb", 2, 1, steps=2)
    stashed = {}
    for job in (bf16, replace(bf16, precision="fp32")):
        reports, _ = run_on_cluster(client, job)
        assert len({sum(w.bytes_stashed for w in r.workers) for r in reports}) == 1
        stashed[job.precision] = sum(w.bytes_stashed for w in reports[0].workers)
    payload = {p: stash_bytes(replace(bf16, precision=p)) for p in stashed}
    # the stash is its tensors' bytes plus the same framing (names, shapes; none where the
    # bytes are counted as handed to the store's writer) in both
    framing = stashed["bf16"] - payload["bf16"]
    assert stashed["fp32"] - payload["fp32"] == framing and 0 <= framing < 0.01 * payload["bf16"]
    # the blocks' matmul inputs and the head's logits halve; the residual stream, the
    # LayerNorm statistics and the loss's log-softmax stay float32 (autocast's choice)
    assert payload["bf16"] < 0.75 * payload["fp32"]


def stash_bytes(job: JobConfig) -> int:
    """The bytes one step's stash of `job` holds, from its layers' traced stash specs."""
    layers = build_model("gpt", job.model_config, seed=job.seed)
    layers.append(build_loss("cross_entropy", {}))
    size = job.microbatch_size
    x = torch.zeros(size, 16, dtype=torch.long)
    targets, total = torch.zeros(size, 16, dtype=torch.long), 0
    with autocast(job.precision, "cpu"):
        for i, layer in enumerate(layers):
            inputs = [x, targets] if i == len(layers) - 1 else [x]
            split = LayerSplit(layer, [spec_of(t) for t in inputs],
                               [i > 0 and j == 0 for j in range(len(inputs))])
            x, stash = split.forward(inputs)
            total += sum(t.nbytes for t in stash.values())
    return total * job.microbatches


def test_the_split_traced_under_autocast_equals_eager_autocast() -> None:
    layers = [*build_model("gpt", {"n_layer": 2, "n_embd": 32, "n_head": 2,
                                   "block_size": 16}, seed=3), build_loss("cross_entropy", {})]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 16), generator=gen)
    y = torch.randint(0, 256, (2, 16), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x
        for layer in layers[:-1]:
            h = layer(h)
        want_loss = layers[-1](h, y)
    want_loss.backward()
    want = [p.grad.clone() for layer in layers for p in layer.parameters()]
    splits, stashes, h = [], [], x
    for i, layer in enumerate(layers):
        inputs = [h, y] if i == len(layers) - 1 else [h]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            split = LayerSplit(layer, [spec_of(t) for t in inputs],
                               [i > 0 and j == 0 for j in range(len(inputs))])
        h, stash = split.forward(inputs)  # the graph holds the casts: no autocast here
        splits.append(split)
        stashes.append(stash)
    assert torch.equal(h, want_loss)
    assert torch.bfloat16 in {t.dtype for t in stashes[1].values()}  # a block's matmul inputs
    assert splits[3].output_spec.dtype == torch.bfloat16  # the head's logits
    grad: torch.Tensor | None = torch.ones((), dtype=h.dtype)
    got: list[torch.Tensor] = []
    for i in reversed(range(len(layers))):
        assert grad is not None
        input_grads, param_grads = splits[i].backward(stashes[i], grad)
        grad, got = input_grads[0], [*param_grads, *got]
    assert all(g.dtype == torch.float32 for g in got)  # float32 master weights' gradients
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


BAD = [({"precision": "fp8"}, "unknown precision 'fp8'"),
       ({"precision": "fp16", "schedule": "pipefb", "mode": "async"},
        "precision 'fp16' runs sync jobs only; this one is 'async'")]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_submit_refuses_bad_precisions_naming_the_value(
        client: Any, fields: dict[str, Any], message: str) -> None:
    assert_submit_refused(client, job_to_proto(make_job("mlp", "1f1b", 2, "sgd")), fields,
                          message)


def test_submit_takes_fp16_on_the_cpu(client: Any) -> None:
    """fp16 runs on the cpu as on CUDA (tests/test_fp16.py trains it)."""
    spec = job_to_proto(make_job("mlp", "1f1b", 2, "sgd", precision="fp16", steps=1))
    job_id = client.stub.SubmitJob(spec, timeout=30).job_id
    reports = list(client.train(job_id))
    assert len(reports) == 1 and reports[0].loss_scale == 2.0**16  # GradScaler's default


def test_local_train_refuses_a_bad_precision_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["local", "train", "--precision", "half", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "unknown precision 'half'" in err and "\n" not in err


# -- on a GPU ------------------------------------------------------------------------------
# CUDA autocast and fp16's loss scaling (their cpu runs are above and in tests/test_fp16.py):
# these run only where a CUDA device is.


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(("schedule", "workers", "groups"), [("1f1b", 4, 1), ("pipefb", 4, 2)])
def test_cuda_mixed_precision_pipeline_equals_one_process(
        client: Any, precision: str, schedule: str, workers: int, groups: int) -> None:
    job = gpt_job(schedule, workers, groups, device="cuda", precision=precision)
    reports, weights = run_on_cluster(client, job)
    single = SingleProcess(replace(job, schedule="single", groups=1))
    want = list(single.run())
    assert [r.skipped for r in reports] == [s.skipped for s in want]
    torch.testing.assert_close(torch.tensor([r.loss for r in reports], dtype=torch.float64),
                               torch.tensor([s.loss for s in want], dtype=torch.float64),
                               rtol=1e-5, atol=0)
    for name, value in single.weights().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_planners_profiles_count_the_autocast_dtypes() -> None:
    """Both profilers see what a bf16 stage holds: the head's bfloat16 logits are half the
    bytes, and each layer's stash is what the runtime stashes (`stash_bytes`)."""
    bf16 = gpt_job("pipefb", 2, 1)
    size = bf16.microbatch_size
    rows = {p: analytic_profile(replace(bf16, precision=p), size, 1e9).layers
            for p in ("bf16", "fp32")}
    head = 3  # embedding, two blocks, head, loss
    assert rows["bf16"][head].output_bytes * 2 == rows["fp32"][head].output_bytes
    assert rows["bf16"][1].input_bytes == rows["fp32"][1].input_bytes  # the residual stream
    for p, layers in rows.items():
        per_microbatch = stash_bytes(replace(bf16, precision=p)) // bf16.microbatches
        assert sum(r.saved_bytes for r in layers) <= per_microbatch
    assert sum(r.saved_bytes for r in rows["bf16"]) < 0.75 * sum(
        r.saved_bytes for r in rows["fp32"])
    measured = measure_profile(bf16, size, warmup=0, repeats=1).layers
    assert [r.saved_bytes for r in measured] == [r.saved_bytes for r in rows["bf16"]]
    assert [r.output_bytes for r in measured] == [r.output_bytes for r in rows["bf16"]]


def test_a_yaml_job_file_sets_the_precision(
        cluster: Any, client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: mlp\ndataset: digits\nloss: cross_entropy\nschedule: pipefb\n"
                   "workers: 2\nbatch_size: 8\nmicrobatches: 2\nsteps: 2\noptimizer: sgd\n"
                   "lr: 0.05\nprecision: bf16\njob_id: yaml-bf16\n")
    assert main(["submit", "--coordinator", cluster.coordinator, str(job), "--follow"]) == 0
    assert client.status("yaml-bf16").spec.precision == "bf16"
    reports = list(client.train("yaml-bf16"))
    want, _ = reference(JobConfig.from_dict({
        "model": "mlp", "dataset": "digits", "loss": "cross_entropy", "schedule": "pipefb",
        "workers": 2, "batch_size": 8, "microbatches": 2, "steps": 2, "optimizer": "sgd",
        "lr": 0.05, "precision": "bf16"}))
    assert [r.loss for r in reports] == want


def test_fake_cuda_weights_keep_their_parameter_type() -> None:
    """The fake CUDA copies shape propagation runs a CUDA job's layer on (under CUDA's
    autocast) are `nn.Parameter`s where the weights are, as `from_tensor` copies are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipefb.job.shapes import _fake_cuda

    layer = torch.nn.BatchNorm1d(3)
    layer.bias.requires_grad_(False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = torch.device("cuda")
        weight, bias = _fake_cuda(layer.weight, cuda), _fake_cuda(layer.bias, cuda)
        buffer = _fake_cuda(layer.running_mean, cuda)
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert isinstance(bias, torch.nn.Parameter) and not bias.requires_grad
    assert not isinstance(buffer, torch.nn.Parameter) and not buffer.requires_grad
    assert weight.device.type == buffer.device.type == "cuda" and weight.shape == (3,)
