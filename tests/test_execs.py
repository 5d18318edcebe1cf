"""Layer executors: autograd and the explicit split accumulate like `loss.backward()`, and
stay right across in-place weight updates."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipefb.execs import AutogradExec, SplitExec
from pipefb.optim import build_optimizer
from pipefb.shapes import TensorSpec


class ExpWeight(nn.Module):
    """`x @ exp(2 w)`: its backward needs a tensor derived from the weight that is no view."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * 2).exp()


def train(make_exec: type, layer: nn.Module, steps: int) -> list[torch.Tensor]:
    """Two micro-batches per step with a fused SGD; returns each step's input grads."""
    ex = (SplitExec(layer, [TensorSpec((3, 4), torch.float32)], [True])
          if make_exec is SplitExec else AutogradExec(layer, [True]))
    opt = build_optimizer("sgd", layer.parameters(), 0.5)  # fused: no `_version` bump
    grads = []
    for step in range(steps):
        for mb in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + mb))
            out, saved = ex.forward([x])
            grads.append(ex.backward(saved, torch.ones_like(out))[0])
        opt.step()
        opt.zero_grad(set_to_none=True)
        ex.weights_changed()
    return grads


def test_split_and_autograd_agree_across_fused_weight_updates() -> None:
    layer = ExpWeight()
    split_layer, eager_layer = copy.deepcopy(layer), copy.deepcopy(layer)
    split_grads = train(SplitExec, split_layer, 3)
    eager_grads = train(AutogradExec, eager_layer, 3)
    for got, want in zip(split_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_layer.w, eager_layer.w, rtol=1e-6, atol=1e-7)
    assert not torch.equal(split_layer.w, layer.w)


def test_backward_input_defers_only_the_split_s_weight_grads() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for make in (SplitExec, AutogradExec):
        whole, halves = ExpWeight(), ExpWeight()
        halves.load_state_dict(whole.state_dict())
        execs = [SplitExec(m, [TensorSpec((3, 4), torch.float32)], [True]) if make is SplitExec
                 else AutogradExec(m, [True]) for m in (whole, halves)]
        out, saved = execs[0].forward([x])
        want = execs[0].backward(saved, torch.ones_like(out))[0]
        out, saved = execs[1].forward([x])
        got, weights = execs[1].backward_input(saved, torch.ones_like(out))
        assert torch.equal(got[0], want)
        assert (halves.w.grad is None) == (make is SplitExec)  # autograd defers nothing
        weights()
        assert torch.equal(halves.w.grad, whole.w.grad)
