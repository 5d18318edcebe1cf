"""Layer executors: autograd and the explicit split accumulate like `loss.backward()`, and
stay right across in-place weight updates."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipefb.job.optim import build_optimizer
from pipefb.job.shapes import TensorSpec
from pipefb.runtime.execs import AutogradExec, SplitExec


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


def test_split_backward_in_two_halves_accumulates_like_the_whole() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    whole, halves = ExpWeight(), ExpWeight()
    halves.load_state_dict(whole.state_dict())
    execs = [SplitExec(m, [TensorSpec((3, 4), torch.float32)], [True]) for m in (whole, halves)]
    for _ in range(2):  # the second accumulates into the first's grads
        out, saved = execs[0].forward([x])
        want = execs[0].backward(saved, torch.ones_like(out))[0]
        before = None if halves.w.grad is None else halves.w.grad.clone()
        out, saved = execs[1].forward([x])
        got, deferred = execs[1].backward_input(saved, torch.ones_like(out))
        assert torch.equal(got[0], want)
        assert (halves.w.grad is None) if before is None else torch.equal(halves.w.grad, before)
        execs[1].backward_weights(deferred)
        assert torch.equal(halves.w.grad, whole.w.grad)
