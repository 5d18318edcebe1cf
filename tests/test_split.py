"""Tests of pipefb.runtime.layersplit and pipefb.job.shapes: the split against eager autograd,
layer by layer."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipefb.codec import pack, unpack
from pipefb.job.losses import MSE, CrossEntropy
from pipefb.job.shapes import (
    SpecError,
    TensorSpec,
    infer_input_specs,
    output_spec,
    requires_grad_for,
    restride,
    spec_of,
)
from pipefb.runtime.layersplit import LayerSplit, SplitError, StashError

V, T, C, H = 32, 8, 16, 2  # vocabulary, sequence, channels, heads of the tiny GPT layers
aten = torch.ops.aten


class Embed(nn.Module):
    """Token embedding plus a learned positional embedding parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.pos = nn.Parameter(torch.randn(T, C) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block with hand-written causal attention."""

    def __init__(self, c: int = C, t: int = T, h: int = H) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).view(1, 1, t, t)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.h))  # (B, H, T, T)
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class Dropped(nn.Module):
    """Linear then dropout: the mask is random and must travel."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(C, C), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


@dataclass(frozen=True)
class Case:
    """A layer, how to make its inputs, its input-grad flags, and whether forward is seeded."""

    name: str
    layer: Callable[[], nn.Module]
    inputs: Callable[[], list[torch.Tensor]]
    flags: list[bool] | None = None
    seeded: bool = False


def _x(*shape: int) -> Callable[[], list[torch.Tensor]]:
    return lambda: [torch.randn(*shape)]


CASES = [
    Case("linear", lambda: nn.Linear(C, 8), _x(4, C)),
    Case("linear_relu", lambda: nn.Sequential(nn.Linear(C, 8), nn.ReLU()), _x(4, C)),
    Case("layernorm_gelu", lambda: nn.Sequential(nn.LayerNorm(C), nn.GELU()), _x(2, T, C)),
    Case("embedding", Embed, lambda: [torch.randint(0, V, (2, T))]),
    Case("block", Block, _x(2, T, C)),
    Case(
        "conv",
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        _x(2, 3, 8, 8),
    ),
    Case(
        "cross_entropy", CrossEntropy, lambda: [torch.randn(2, T, V), torch.randint(0, V, (2, T))]
    ),
    Case("mse", MSE, lambda: [torch.randn(4, C), torch.randn(4, C)], flags=[True, False]),
    Case("relu", nn.ReLU, _x(4, C)),
    Case("dropout", Dropped, _x(4, C), seeded=True),
]
IDS = [c.name for c in CASES]


def build(case: Case) -> tuple[nn.Module, list[torch.Tensor], LayerSplit]:
    torch.manual_seed(0)
    layer = case.layer()
    inputs = case.inputs()
    return layer, inputs, LayerSplit(layer, [spec_of(x) for x in inputs], case.flags)


def eager(
    layer: nn.Module,
    inputs: list[torch.Tensor],
    flags: list[bool],
    grad: torch.Tensor | None,
    seed: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor]]:
    """Output, input grads and param grads of plain autograd on the same layer."""
    xs = [x.clone().requires_grad_(f) for x, f in zip(inputs, flags, strict=True)]
    if seed is not None:
        torch.manual_seed(seed)
    out = layer(*xs)
    grad = torch.ones_like(out) if grad is None else grad
    params = list(layer.parameters())
    wanted = [x for x in xs if x.requires_grad] + params
    got = list(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    n = len(wanted) - len(params)
    it = iter(got[:n])
    input_grads = [next(it) if x.requires_grad else None for x in xs]
    return (
        out.detach(),
        input_grads,
        [torch.zeros_like(p) if g is None else g for g, p in zip(got[n:], params, strict=True)],
    )


def run_split(split: LayerSplit, inputs: list[torch.Tensor], seeded: bool):
    if seeded:
        torch.manual_seed(7)
    return split.forward(inputs)


def assert_same(actual, expected) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def assert_all_same(actual: list, expected: list) -> None:
    """Grads equal one for one, bit for bit (None where the other is None)."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert_same(got, want)


def grad_for(split: LayerSplit) -> torch.Tensor:
    return torch.randn(split.output_spec.shape, generator=torch.Generator().manual_seed(1))


def forward_case(case: Case) -> tuple[nn.Module, list[torch.Tensor], LayerSplit, torch.Tensor,
                                      dict[str, torch.Tensor], torch.Tensor]:
    """The case's layer, inputs and split, the split's output and stash, an output grad."""
    layer, inputs, split = build(case)
    out, stash = run_split(split, inputs, case.seeded)
    return layer, inputs, split, out, stash, grad_for(split)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_split_matches_eager(case: Case) -> None:
    layer, inputs, split, out, stash, grad = forward_case(case)
    input_grads, param_grads = split.backward(stash, grad)
    ref_out, ref_in, ref_params = eager(
        layer, inputs, split.input_requires_grad, grad, seed=7 if case.seeded else None
    )
    assert_same(out, ref_out)
    assert len(input_grads) == len(inputs)
    assert_all_same(input_grads, ref_in)
    assert len(param_grads) == len(split.param_names)
    assert_all_same(param_grads, ref_params)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stash_holds_no_weight_or_derived_tensor(case: Case) -> None:
    layer, inputs, split = build(case)
    _, stash = run_split(split, inputs, case.seeded)
    assert set(stash) == set(split.stash_names)
    weights = [*layer.parameters(), *layer.buffers()]
    derived = split.derive_graph(*weights)
    ptrs = {t.untyped_storage().data_ptr() for t in [*weights, *derived]}
    for name, tensor in stash.items():
        assert name not in split.param_names and name not in split.derived_names
        assert tensor.untyped_storage().data_ptr() not in ptrs, name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stash_survives_codec_round_trip(case: Case) -> None:
    _, _, split, _, stash, grad = forward_case(case)
    expected = split.backward(stash, grad)
    received = {name: unpack(pack(t)) for name, t in stash.items()}
    got = split.backward(received, grad)
    for a, b in zip([*got[0], *got[1]], [*expected[0], *expected[1]], strict=True):
        if a is None or b is None:
            assert a is b
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_input_part_then_weight_part_give_the_whole_backward_bit_for_bit(case: Case) -> None:
    """[Note: input grads first]: the two halves of the backward graph."""
    _, _, split, _, stash, grad = forward_case(case)
    want_inputs, want_params = split.backward(stash, grad)
    got_inputs, deferred = split.backward_input(stash, grad)
    assert all(isinstance(t, torch.Tensor) for t in deferred.args)  # no tuple is carried
    assert_all_same(got_inputs, want_inputs)
    assert_all_same(split.backward_weights(deferred), want_params)


def test_the_input_part_of_a_linear_computes_no_weight_grad() -> None:
    _, x, split = build(CASES[0])
    inputs, weights, _ = split._halves

    def ops(gm: torch.fx.GraphModule) -> list[object]:
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    assert ops(inputs) == [aten.t.default, aten.mm.default]  # grad_output @ weight: x's grad
    assert ops(weights).count(aten.mm.default) == 1 and aten.sum.dim_IntList in ops(weights)
    assert ops(split.backward_graph).count(aten.mm.default) == 2  # the whole has both
    _, stash = run_split(split, x, False)
    _, deferred = split.backward_input(stash, grad_for(split))
    held = deferred.args  # what a waiting weight half keeps alive: x and the output grad
    assert len(held) == 2 and held[0].data_ptr() == stash["input_0"].data_ptr()
    assert held[1].shape == (4, 8)


def test_linear_conventions() -> None:
    """Pins [Note: captured graph conventions] on the smallest layer."""
    _, _, split = build(CASES[0])
    fw_in = [n.name for n in split.forward_graph.graph.find_nodes(op="placeholder")]
    fw_out = [n.name for n in split.forward_graph.graph.output_node().args[0]]
    bw_in = [n.name for n in split.backward_graph.graph.find_nodes(op="placeholder")]
    assert fw_in == ["primals_1", "primals_2", "primals_3"]  # weight, bias, x
    assert fw_out == ["addmm", "primals_3", "t"]  # output, *saved
    assert bw_in == ["primals_3", "t", "tangents_1"]  # *saved, tangent
    assert len(split.backward_graph.graph.output_node().args[0]) == 3  # a grad per primal
    assert split.stash_names == ["input_0"] and split.derived_names == ["t"]
    assert split.num_derived == 1 and split.param_names == ["weight", "bias"]


def test_non_grad_primals_get_none_from_backward_graph() -> None:
    _, _, split = build(CASES[3])  # embedding: int64 input
    grads = split.backward_graph.graph.output_node().args[0]
    assert len(grads) == 3 and grads[-1] is None
    _, _, mse = build(CASES[7])
    assert mse.backward_graph.graph.output_node().args[0][-1] is None  # targets


def test_block_keeps_buffer_derived_mask_home() -> None:
    _, _, split = build(CASES[4])
    assert split.buffer_names == ["mask"]
    assert "mask" not in split.stash_names
    assert any(
        n.startswith("bitwise_not") or n.startswith("logical_not") for n in split.derived_names
    )


def test_dropout_mask_is_stashed_not_recomputed() -> None:
    layer, inputs, split = build(CASES[-1])
    torch.manual_seed(7)
    _, stash = split.forward(inputs)
    assert any(t.dtype == torch.bool for t in stash.values())
    torch.manual_seed(12345)  # another RNG state at the backward worker
    grad = grad_for(split)
    input_grads, _ = split.backward(stash, grad)
    _, ref_in, _ = eager(layer, inputs, [True], grad, seed=7)
    assert_same(input_grads[0], ref_in[0])


def test_backward_runs_no_forward() -> None:
    layer, inputs, split = build(CASES[4])
    _, stash = split.forward(inputs)
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))
    split.backward(stash, grad_for(split))
    assert not calls
    forward_ops = {
        aten.native_layer_norm.default,
        aten._softmax.default,
        aten.gelu.default,
        aten.addmm.default,
    }  # masked_fill is its own backward: not listed
    bw_ops = {n.target for n in split.backward_graph.graph.nodes if n.op == "call_function"}
    assert not bw_ops & forward_ops, bw_ops & forward_ops


def test_new_weight_version_rederives() -> None:
    layer, inputs, split = build(CASES[0])
    _, stash = split.forward(inputs)
    grad = grad_for(split)
    first, _ = split.backward(stash, grad)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: a new `_version`
    second, _ = split.backward(stash, grad)
    _, ref_in, _ = eager(layer, inputs, [True], grad)  # new weights, same saved input
    assert_same(second[0], ref_in[0])
    assert_same(second[0], 2.0 * first[0])


def test_derive_ahead_serves_the_next_backward() -> None:
    """`derive` after a weight update runs the derive graph once; the backward with those
    weights reuses its tensors and gives the same gradients as deriving on demand."""
    layer, inputs, split = build(CASES[0])
    _, stash = split.forward(inputs)
    grad = grad_for(split)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    split.weights_changed()
    on_demand, _ = split.backward(stash, grad)
    split.weights_changed()
    calls = []
    graph = split.derive_graph
    split.derive_graph = lambda *w: calls.append(1) or graph(*w)  # type: ignore[method-assign]
    split.derive()
    ahead, _ = split.backward(stash, grad)
    assert calls == [1]
    assert_same(ahead[0], on_demand[0])


def test_explicit_params_are_used() -> None:
    layer, inputs, split = build(CASES[0])
    new = [p.detach() * 3.0 for p in layer.parameters()]
    out, stash = split.forward(inputs, new)
    assert_same(out, F.linear(inputs[0], new[0], new[1]))
    input_grads, _ = split.backward(stash, grad_for(split), new)
    assert_same(input_grads[0], grad_for(split) @ new[0])


def test_missing_stash_name_raises_key_error() -> None:
    _, inputs, split = build(CASES[0])
    _, stash = split.forward(inputs)
    with pytest.raises(KeyError, match="input_0"):
        split.backward({k: v for k, v in stash.items() if k != "input_0"}, grad_for(split))


@pytest.mark.parametrize(
    "bad",
    [
        {"input_0": torch.zeros(3, C)},
        {"input_0": torch.zeros(4, C, dtype=torch.float64)},
        {"input_0": "not a tensor"},
        {"input_0": torch.zeros(4, C), "extra": torch.zeros(1)},
        {"input_0": torch.zeros(4, C, device="meta")},
    ],
)
def test_bad_stash_raises_value_error(bad: dict) -> None:
    _, _, split = build(CASES[0])
    with pytest.raises(SpecError):  # StashError is a SpecError is a ValueError
        split.backward(bad, grad_for(split))


def test_hostile_indices_are_refused() -> None:
    _, inputs, split = build(CASES[3])
    _, stash = split.forward(inputs)
    (name,) = split.stash_names
    for value in (V, -1):
        bad = {name: stash[name].clone().fill_(value)}
        with pytest.raises(StashError, match=name):
            split.backward(bad, grad_for(split))
    _, ce_inputs, ce = build(CASES[6])
    _, ce_stash = ce.forward(ce_inputs)
    bad = {
        k: (v.clone().fill_(V + 5) if v.dtype == torch.int64 else v) for k, v in ce_stash.items()
    }
    with pytest.raises(StashError):
        ce.backward(bad, torch.ones(()))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=6), max_size=4),
    st.sampled_from(list({torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8})),
)
def test_random_stash_never_crashes(shape: list[int], dtype: torch.dtype) -> None:
    split = LINEAR_SPLIT
    try:
        split.backward({"input_0": torch.zeros(shape, dtype=dtype)}, torch.zeros(4, 8))
    except (KeyError, ValueError):
        pass


LINEAR_SPLIT = LayerSplit(nn.Linear(C, 8), [TensorSpec((4, C), torch.float32)])


def test_bad_split_arguments() -> None:
    with pytest.raises(ValueError, match="int64"):
        LayerSplit(nn.Embedding(V, C), [TensorSpec((2, T), torch.int64)], [True])
    with pytest.raises(SpecError, match="grad_output"):
        LINEAR_SPLIT.backward({"input_0": torch.zeros(4, C)}, torch.zeros(4, 9))
    with pytest.raises(SplitError):
        LayerSplit(nn.Identity(), [TensorSpec((4, C), torch.float32)], [False])


def test_aliasing_output_layer_splits() -> None:
    layer, inputs = nn.Flatten(), [torch.randn(2, 3, 4)]
    split = LayerSplit(layer, [spec_of(inputs[0])])
    out, stash = split.forward(inputs)
    grads, _ = split.backward(stash, torch.ones(2, 12))
    assert_same(out, inputs[0].flatten(1))
    assert_same(grads[0], torch.ones(2, 3, 4))


def test_tracing_leaves_rng_alone() -> None:
    torch.manual_seed(3)
    layer = Dropped()
    state = torch.get_rng_state()
    LayerSplit(layer, [TensorSpec((4, C), torch.float32)])
    assert torch.equal(torch.get_rng_state(), state)


def test_requires_grad_defaults() -> None:
    specs = [TensorSpec((4, C), torch.float32), TensorSpec((4, C), torch.float32)]
    assert requires_grad_for(specs) == [True, True]
    assert requires_grad_for(specs, loss=True) == [True, False]
    assert requires_grad_for([TensorSpec((2,), torch.int64)]) == [False]


def test_infer_input_specs_gpt() -> None:
    torch.manual_seed(0)
    layers = [Embed(), Block(), Block(), nn.Linear(C, V), CrossEntropy()]
    state = torch.get_rng_state()
    specs = infer_input_specs(
        layers, TensorSpec((2, T), torch.int64), TensorSpec((2, T), torch.int64)
    )
    assert torch.equal(torch.get_rng_state(), state)
    act = TensorSpec((2, T, C), torch.float32)
    assert specs == [
        [TensorSpec((2, T), torch.int64)],
        [act],
        [act],
        [act],
        [TensorSpec((2, T, V), torch.float32), TensorSpec((2, T), torch.int64)],
    ]


def test_infer_input_specs_convnet_and_no_loss() -> None:
    layers = [
        nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Flatten(),
    ]
    specs = infer_input_specs(layers, TensorSpec((2, 3, 8, 8), torch.float32), None)
    assert specs[1] == [TensorSpec((2, 4, 4, 4), torch.float32)]
    assert output_spec(layers[1], specs[1]) == TensorSpec((2, 64), torch.float32)
    with pytest.raises(ValueError):
        infer_input_specs([], TensorSpec((1,), torch.float32), None)


def test_tensor_spec_helpers() -> None:
    spec = TensorSpec((2, 3), torch.int64)
    assert spec.example().dtype == torch.int64 and not spec.example().any()
    assert spec_of(spec.zeros()) == spec
    assert TensorSpec((2,), torch.float32).example().shape == (2,)


def test_restride_restores_traced_layout() -> None:
    x = torch.arange(6.0).view(2, 3)
    y = restride(x, (1, 2))  # column-major, as a transposed saved tensor was traced
    assert y.stride() == (1, 2) and torch.equal(y, x)
    assert restride(x, None) is x


def test_forward_accepts_a_non_contiguous_input_view() -> None:
    """Datasets hand out windows of a longer tensor; the traced graph must still run."""
    emb = nn.Embedding(16, 4)
    window = torch.randint(0, 16, (2, 9))[:, :-1]  # (2, 8) view with stride (9, 1)
    assert not window.is_contiguous()
    split = LayerSplit(emb, [TensorSpec((2, 8), torch.int64)])
    out, _ = split.forward([window])
    torch.testing.assert_close(out, emb(window), rtol=0, atol=0)


def test_has_random_ops_only_for_layers_that_draw_random_numbers() -> None:
    spec = [TensorSpec((2, 8), torch.float32)]
    assert not LayerSplit(nn.Linear(8, 8), spec).has_random_ops
    assert LayerSplit(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), spec).has_random_ops
