"""The layer profiler: exact bytes, stash bytes equal to a real split forward, FLOPs of
linear layers, time scaling, every timed call from overwritten caches; the worker's
Profile RPC and `profile_workers` on real worker processes over loopback."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from torch import nn

from coordinator.profiling import ProfileCache, profile_workers
from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig, build_layers
from pipefb.job.data import build_dataset
from pipefb.job.shapes import TensorSpec, infer_input_specs, spec_of
from pipefb.memory import tensor_bytes
from pipefb.processes import Process
from pipefb.profile import measure as profiler
from pipefb.profile.analytic import analytic_profile, layer_flops
from pipefb.profile.measure import measure_profile
from pipefb.profile.scaling import fixed_part, second_size
from pipefb.profile.summary import median_profile, relative_speeds
from pipefb.runtime.execs import SplitExec
from pipefb.runtime.execs import needs_grad as _needs_grad
from pipefb.sim.costs import Profile, uniform_profile
from protos import server, worker_pb2, worker_pb2_grpc
from protos.convert import ProfileQuery, profile_from_proto, profile_to_proto
from tests.conftest import Credentials, credentials, worker_threads

ROOT = str(Path(__file__).resolve().parent.parent)
F32, I64 = 4, 8  # bytes per element
MB = 4  # micro-batch size of the in-process profiles
MLP = JobConfig(model="mlp", dataset="synthetic", dataset_config={"task": "classification"})
WIDTHS = [64, 128, 128, 128, 10]  # the default mlp: in, 3 hidden, out
GPT_CFG = {"n_layer": 1}  # vocab 256, block 32, n_embd 32, 2 heads, bias (defaults)
GPT = JobConfig(model_config=GPT_CFG)
V, T, C = 256, 32, 32


@pytest.fixture(scope="module")
def mlp_profile() -> Profile:
    with worker_threads():
        return measure_profile(MLP, MB, repeats=3)


@pytest.fixture(scope="module")
def gpt_profile() -> Profile:
    with worker_threads():
        return measure_profile(GPT, MB, warmup=1, repeats=3)


@pytest.fixture(scope="module")
def gpt_analytic() -> Profile:
    return analytic_profile(GPT, MB, flops_per_second=1e9)


def mlp_expected(mb: int) -> list[tuple[int, int, int]]:
    """(input, output, param) bytes of each mlp layer, from the widths alone."""
    rows = [(mb * a * F32, mb * b * F32, (a * b + b) * F32) for a, b in itertools.pairwise(WIDTHS)]
    return [*rows, (mb * 10 * F32 + mb * I64, F32, 0)]  # loss: logits + int64 classes -> scalar


def gpt_expected(mb: int) -> list[tuple[int, int, int]]:
    """(input, output, param) bytes of each gpt layer, from the config alone."""
    act = mb * T * C * F32
    block = (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C)
    return [(mb * T * I64, act, (V * C + T * C) * F32), (act, act, block * F32),
            (act, mb * T * V * F32, (2 * C + C * V) * F32),
            (mb * T * V * F32 + mb * T * I64, F32, 0)]


def byte_rows(profile: Profile) -> list[tuple[int, int, int]]:
    return [(x.input_bytes, x.output_bytes, x.param_bytes) for x in profile.layers]


def test_mlp_bytes_are_exact(mlp_profile: Profile) -> None:
    assert byte_rows(mlp_profile) == mlp_expected(MB)
    assert [x.name for x in mlp_profile.layers] == ["Sequential"] * 3 + ["Linear", "CrossEntropy"]


def test_gpt_bytes_are_exact(gpt_profile: Profile) -> None:
    assert byte_rows(gpt_profile) == gpt_expected(MB)
    assert [x.name for x in gpt_profile.layers] == ["Embedding", "Block", "Head", "CrossEntropy"]


def test_mlp_stash_is_what_linear_and_relu_save(mlp_profile: Profile) -> None:
    """Linear saves its input, ReLU its output; the weights are not counted."""
    saved = [x.saved_bytes for x in mlp_profile.layers]
    assert saved[:3] == [x.input_bytes + x.output_bytes for x in mlp_profile.layers[:3]]
    assert saved[3] == mlp_profile.layers[3].input_bytes


def split_forward_stashes(job: JobConfig, mb: int) -> list[int]:
    """An independent chain of real SplitExec forwards; each layer's stash bytes."""
    layers = build_layers(job)
    x, y = build_dataset(job.dataset, job.dataset_config, job.seed).microbatch(0, 0, mb)
    specs = infer_input_specs(layers, spec_of(x), spec_of(y))
    out = []
    for i, layer in enumerate(layers):
        ex = SplitExec(layer, specs[i], _needs_grad(i, specs[i]))
        x, stash = ex.forward([x, y] if i == len(layers) - 1 else [x])
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        out.append(tensor_bytes(stash.values(), exclude=params))
    return out


@pytest.mark.parametrize("which", ["mlp", "gpt"])
def test_saved_bytes_equal_a_real_split_forward(which: str, mlp_profile: Profile,
                                                gpt_profile: Profile) -> None:
    profile, job = (mlp_profile, MLP) if which == "mlp" else (gpt_profile, GPT)
    expected = split_forward_stashes(job, MB)
    assert [x.saved_bytes for x in profile.layers] == expected
    assert all(b > 0 for b in expected)


@pytest.mark.parametrize("which", ["mlp", "gpt"])
def test_times_are_positive_and_fixed_parts_at_most_the_total(which: str, mlp_profile: Profile,
                                                              gpt_profile: Profile) -> None:
    profile = mlp_profile if which == "mlp" else gpt_profile
    assert profile.source == "measured" and profile.microbatch_size == MB
    for x in profile.layers:
        assert x.forward_seconds > 0 and x.backward_seconds > 0, x
        assert 0 <= x.forward_fixed_seconds <= x.forward_seconds, x
        assert 0 <= x.backward_fixed_seconds <= x.backward_seconds, x
        # the weight-grad half: some of the backward where the layer has weights, else none
        assert (0 < x.weight_grad_seconds < x.backward_seconds if x.param_bytes
                else x.weight_grad_seconds < x.backward_seconds / 2), x
    assert profile.optimizer_seconds_per_byte > 0
    assert profile.optimizer_fixed_seconds > 0  # a step's per-call cost
    # copying the weights into fresh memory: no faster than 20 GB/s (memory traffic both
    # ways), no slower than a microsecond a byte
    assert 5e-11 < profile.weight_copy_seconds_per_byte < 1e-6
    assert profile.optimizer_state_ratio == pytest.approx(2.0, abs=0.01)  # adamw: 2 moments
    assert profile.data_seconds > 0  # loading the micro-batch was timed


def test_the_optimizer_step_has_a_cost_per_byte_where_the_parameters_are_too_few_to_show_it(
) -> None:
    """A step over two 8-float tensors is no slower than over one of them, within the
    noise; the line is drawn to a step with zeros up to `CONTRAST_BYTES` beside them
    ([Note: optimizer fixed part]), so neither part comes out zero."""
    params = [nn.Parameter(torch.zeros(8)) for _ in range(2)]
    with worker_threads():
        for _ in range(3):
            costs = profiler._optimizer_costs(MLP, params, warmup=1, repeats=3)
            assert 0 < costs.per_byte < 1e-8, costs  # a loose bound, far above AdamW's cost
            assert 0 < costs.fixed < 5e-3, costs
            assert costs.state_ratio > 2  # two moments, and a step count per tensor


def test_restricted_layers_are_timed_alone_and_leave_the_rng_alone(mlp_profile: Profile) -> None:
    state = torch.get_rng_state()
    with worker_threads():
        part = measure_profile(MLP, MB, layers=range(1, 3), warmup=0, repeats=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert byte_rows(part) == byte_rows(mlp_profile)
    assert [x.saved_bytes for x in part.layers] == [x.saved_bytes for x in mlp_profile.layers]
    timed = [x.forward_seconds > 0 and x.backward_seconds > 0 for x in part.layers]
    assert timed == [False, True, True, False, False]
    assert all(x.forward_fixed_seconds == 0 for i, x in enumerate(part.layers) if i not in (1, 2))


def test_the_fixed_part_is_the_line_through_two_sizes_at_zero_samples() -> None:
    # 2 ms at 2 samples, 5 ms at 8: 0.5 ms per sample, so 1 ms at 0 samples
    assert fixed_part(2e-3, 5e-3, (2, 8)) == pytest.approx(1e-3)
    assert fixed_part(4e-3, 5e-3, (2, 8)) == pytest.approx(3.667e-3, rel=1e-3)
    assert fixed_part(1e-3, 5e-3, (2, 8)) == 0.0  # steeper than proportional: none fixed
    assert fixed_part(6e-3, 5e-3, (2, 8)) == 5e-3  # the small call slower: all fixed
    assert fixed_part(3e-3, 3e-3, (1, 1)) == 3e-3  # one sample: the call is all fixed
    # the line from a larger second size: 5 ms at 8 samples, 11 ms at 32
    assert fixed_part(11e-3, 5e-3, (32, 8)) == pytest.approx(3e-3)
    # four times the size within the batch, else a quarter of it
    assert [second_size(n, 32) for n in (1, 3, 8, 9, 16, 32, 64)] == [4, 12, 32, 32, 32, 8, 16]
    assert [second_size(n, n) for n in (1, 3, 4, 8)] == [1, 1, 1, 2]


def test_at_scales_bytes_by_samples_and_times_beyond_the_fixed_part(
        mlp_profile: Profile) -> None:
    assert mlp_profile.at(MB) is mlp_profile
    big = mlp_profile.at(3 * MB)
    assert big.microbatch_size == 3 * MB
    assert byte_rows(big)[:4] == mlp_expected(3 * MB)[:4]
    for x, y in zip(mlp_profile.layers, big.layers, strict=True):
        assert y.saved_bytes == 3 * x.saved_bytes and y.param_bytes == x.param_bytes
        fixed = x.forward_fixed_seconds
        assert y.forward_seconds == pytest.approx(fixed + 3 * (x.forward_seconds - fixed))
        assert y.forward_fixed_seconds == fixed
        assert y.weight_grad_seconds == pytest.approx(  # the same share of the backward
            y.backward_seconds * x.weight_grad_seconds / x.backward_seconds)


def test_every_timed_call_starts_from_overwritten_caches(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    events: list[str] = []
    written: list[int] = []
    real_evict, real_timed = profiler._Caches.evict, profiler._timed

    def evict(self: profiler._Caches) -> None:
        real_evict(self)
        written.append(int(self.buffer[-1]))
        events.append("evict")

    def timed(fn: object) -> object:
        events.append("timed")
        return real_timed(fn)  # type: ignore[arg-type]

    monkeypatch.setattr(profiler._Caches, "evict", evict)
    monkeypatch.setattr(profiler, "_timed", timed)
    with worker_threads():
        measure_profile(MLP, MB, warmup=1, repeats=2)
    timed_calls = [k for k, e in enumerate(events) if e == "timed"]
    evicted = [k for k in timed_calls if k > 0 and events[k - 1] == "evict"]
    # the warm-up round's calls are untimed: each timed round's are all cold
    n_layers = len(WIDTHS)  # 4 linear layers and the loss
    per_round = profiler.IN_FLIGHT * (1 + 2 * n_layers)  # load, forwards, backwards
    # full and small runs; 1 + 2 OPT steps over every parameter (0.13 MB), over them with
    # zeros up to CONTRAST_BYTES, and over the smallest alone; 2 + 2 weight copies
    assert profiler.CONTRAST_BYTES > tensor_bytes(p for x in build_layers(MLP)
                                                  for p in x.parameters())
    assert len(evicted) == 2 * 2 * per_round + 3 * 3 + profiler.KEPT_COPIES + 2
    assert len(written) == len(evicted) and len(set(written)) > 1  # new bytes each time
    assert profiler.EVICT_BYTES >= 64 << 20


def test_analytic_flops_of_linear_layers_are_two_per_multiply_add() -> None:
    profile = analytic_profile(MLP, MB, flops_per_second=1.0)  # seconds == FLOPs
    forward = [x.forward_seconds for x in profile.layers]
    assert forward == [2 * a * b * MB for a, b in itertools.pairwise(WIDTHS)] + [0]
    backward = [x.backward_seconds for x in profile.layers]
    assert backward[0] == forward[0]  # layer 0's input is data: only the weight gradient
    assert backward[1:4] == [2 * f for f in forward[1:4]]  # input and weight gradients
    assert layer_flops(nn.Linear(5, 7), [TensorSpec((3, 5), torch.float32)], [False]) == (
        2 * 5 * 7 * 3, 2 * 5 * 7 * 3)


def test_analytic_times_scale_inversely_with_the_flop_rate(gpt_analytic: Profile) -> None:
    slow = gpt_analytic
    fast = analytic_profile(GPT, MB, flops_per_second=4e9)
    for s, f in zip(slow.layers, fast.layers, strict=True):
        assert f.forward_seconds == pytest.approx(s.forward_seconds / 4, rel=1e-12)
        assert f.backward_seconds == pytest.approx(s.backward_seconds / 4, rel=1e-12)
    assert slow.layers[1].forward_seconds > 0 and slow.source == "analytic"
    with_io = analytic_profile(GPT, MB, flops_per_second=1e9, bytes_per_second=1e9,
                               launch_seconds=1e-3)
    for s, w in zip(slow.layers, with_io.layers, strict=True):
        assert w.forward_fixed_seconds == w.backward_fixed_seconds == 1e-3
        moved = s.input_bytes + s.param_bytes + s.output_bytes
        assert w.forward_seconds == pytest.approx(s.forward_seconds + 1e-3 + moved / 1e9)


def test_analytic_bytes_equal_measured_bytes(mlp_profile: Profile, gpt_profile: Profile,
                                            gpt_analytic: Profile) -> None:
    mlp_analytic = analytic_profile(MLP, MB, flops_per_second=1e9)
    for analytic, measured in ((mlp_analytic, mlp_profile), (gpt_analytic, gpt_profile)):
        assert byte_rows(analytic) == byte_rows(measured)
        assert ([x.saved_bytes for x in analytic.layers]
                == [x.saved_bytes for x in measured.layers])


def test_analytic_optimizer_state_ratio_is_the_optimizer_s() -> None:
    sgd = analytic_profile(replace(MLP, optimizer="sgd"), MB, 1e9, bytes_per_second=1e9)
    assert sgd.optimizer_state_ratio == 1.0  # one momentum buffer per parameter
    assert sgd.optimizer_seconds_per_byte == pytest.approx(5 / 1e9)
    assert sgd.weight_copy_seconds_per_byte == pytest.approx(2 / 1e9)  # read and written


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"microbatch_size": 0}, "micro-batch size 0"), ({"microbatch_size": True}, "True"),
    ({"warmup": -1}, "warmup -1"), ({"repeats": 0}, "repeats 0"),
    ({"repeats": 2**31 - 1}, "repeats 2147483647 must be an integer in 1..100"),
    ({"microbatch_size": 10**6}, "1000000 must be an integer in 1..65536"),
    ({"layers": range(3, 2)}, "range(3, 2)"), ({"layers": range(0, 6)}, "range(0, 6)"),
    ({"layers": range(0, 4, 2)}, "range(0, 4, 2)")])
def test_bad_measure_arguments_are_named(kwargs: dict[str, object], named: str) -> None:
    args: dict[str, object] = {"microbatch_size": MB, **kwargs}
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        measure_profile(MLP, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"flops_per_second": 0.0}, "flops_per_second 0.0"),
    ({"flops_per_second": math.nan}, "flops_per_second nan"),
    ({"bytes_per_second": -1.0}, "bytes_per_second -1.0"),
    ({"launch_seconds": math.inf}, "launch_seconds inf")])
def test_bad_analytic_arguments_are_named(kwargs: dict[str, float], named: str) -> None:
    args = {"flops_per_second": 1e9, **kwargs}
    with pytest.raises(ConfigError, match=named):
        analytic_profile(MLP, MB, **args)


def test_median_profile_and_relative_speeds_of_known_profiles() -> None:
    profiles = [uniform_profile(3, forward=f, backward=2 * f) for f in (1.0, 2.0, 3.0)]
    median = median_profile(profiles)
    assert [x.forward_seconds for x in median.layers] == [2.0] * 3
    assert [x.backward_seconds for x in median.layers] == [4.0] * 3
    assert relative_speeds(profiles) == pytest.approx([2.0, 1.0, 2 / 3])
    other = replace(profiles[1], layers=(replace(profiles[1].layers[0], saved_bytes=1),
                                         *profiles[1].layers[1:]))
    with pytest.raises(ConfigError, match="saved_bytes 1 for layer 0"):
        median_profile([profiles[0], other])


def test_profile_message_round_trips(mlp_profile: Profile) -> None:
    assert profile_from_proto(profile_to_proto(mlp_profile, 3)) == mlp_profile
    query = ProfileQuery(MLP, 2, range(1, 4), warmup=0, repeats=7)
    assert ProfileQuery.from_proto(query.to_proto()) == query
    assert ProfileQuery.from_proto(ProfileQuery(MLP, 2).to_proto()) == ProfileQuery(MLP, 2)


# -- the Profile RPC on real worker processes -------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    """The workers' service credential; this module calls them as the coordinator does."""
    return credentials(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, keys: Credentials
            ) -> Iterator[list[str]]:
    """Two worker processes with one torch thread each, on loopback."""
    env = {**os.environ, "PYTHONPATH": ROOT, **keys.env}
    log_dir = tmp_path_factory.mktemp("profile-workers")
    procs = [Process(f"worker{k}", ["-m", "worker", "--listen", "127.0.0.1:0", "--threads", "1"],
                     log_dir, env) for k in range(2)]
    try:
        yield [p.wait_ready() for p in procs]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def stubs(workers: list[str], keys: Credentials
          ) -> Iterator[list[worker_pb2_grpc.StageWorkerStub]]:
    channels = [server.channel(a, keys.coordinator) for a in workers]
    yield [worker_pb2_grpc.StageWorkerStub(ch) for ch in channels]
    for ch in channels:
        ch.close()


def test_profile_rpc_gives_the_in_process_bytes(stubs: list[worker_pb2_grpc.StageWorkerStub],
                                                mlp_profile: Profile) -> None:
    request = ProfileQuery(MLP, MB, warmup=0, repeats=1).to_proto()
    reply = stubs[0].Profile(request, timeout=120)
    assert reply.torch_threads == 1
    remote = profile_from_proto(reply)
    assert byte_rows(remote) == byte_rows(mlp_profile)
    assert [x.saved_bytes for x in remote.layers] == [x.saved_bytes for x in mlp_profile.layers]
    assert remote.source == "measured" and all(x.forward_seconds > 0 for x in remote.layers)


@pytest.mark.parametrize(("change", "named"), [
    ({"microbatch_size": 0}, "micro-batch size 0"), ({"repeats": 0}, "repeats 0"),
    ({"layers": worker_pb2.LayerRange(start=2, stop=9)}, "range(2, 9)")])
def test_bad_profile_request_is_invalid_argument(stubs: list[worker_pb2_grpc.StageWorkerStub],
                                                 change: dict[str, object], named: str) -> None:
    request = ProfileQuery(MLP, MB).to_proto()
    for field, value in change.items():
        if isinstance(value, worker_pb2.LayerRange):
            request.layers.CopyFrom(value)
        else:
            setattr(request, field, value)
    with pytest.raises(grpc.RpcError) as info:
        stubs[0].Profile(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details()


def test_bad_profile_job_is_invalid_argument(stubs: list[worker_pb2_grpc.StageWorkerStub]
                                             ) -> None:
    request = ProfileQuery(MLP, MB).to_proto()
    request.job.model = "nope"
    with pytest.raises(grpc.RpcError) as info:
        stubs[0].Profile(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope" in info.value.details()


def test_profile_workers_gives_a_complete_profile_and_even_speeds(
        stubs: list[worker_pb2_grpc.StageWorkerStub]) -> None:
    job = replace(MLP, model_config={"hidden": 256})  # layers long enough to time evenly
    profile, speeds, reused = profile_workers(stubs, job, 32, repeats=5)
    assert reused == 0
    assert profile.n_layers == 5 and profile.microbatch_size == 32
    assert all(x.forward_seconds > 0 and x.backward_seconds > 0 for x in profile.layers)
    assert profile.layers[1].param_bytes == (256 * 256 + 256) * F32
    assert profile.optimizer_seconds_per_byte > 0
    assert len(speeds) == 2
    assert all(1 / 3 < s < 3 for s in speeds), speeds
    assert sum(1 / s for s in speeds) == pytest.approx(2.0)  # own totals over their median


def test_a_worker_asked_the_same_again_answers_from_the_cache(
        stubs: list[worker_pb2_grpc.StageWorkerStub], workers: list[str]) -> None:
    """[Note: profile reuse]: a job that differs only in how it would be planned or run
    reuses each worker's reply; another seed, or a forgotten worker, asks again."""
    cache = ProfileCache()
    job = replace(MLP, schedule="gpipe", workers=2, steps=3)
    first, speeds, reused = profile_workers(stubs, job, MB, warmup=0, repeats=1,
                                            cache=(cache, workers))
    assert reused == 0
    planned_otherwise = replace(job, schedule="1f1b", workers=4, steps=9, microbatches=2,
                                plan="auto", memory_cap=1 << 30, groups=2)
    again, speeds_again, reused = profile_workers(stubs, planned_otherwise, MB, warmup=0,
                                                  repeats=1, cache=(cache, workers))
    assert reused == 2 and again == first and speeds_again == speeds  # timings reused
    _, _, reused = profile_workers(stubs, replace(job, seed=1), MB, warmup=0, repeats=1,
                                   cache=(cache, workers))
    assert reused == 0  # other data: asked again
    cache.forget(workers[0])
    remeasured, _, reused = profile_workers(stubs, job, MB, warmup=0, repeats=1,
                                            cache=(cache, workers))
    assert reused == 1 and remeasured != first  # worker 0 timed anew
