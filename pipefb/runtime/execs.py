"""Layer executors: how a rank runs one layer's forward and backward.

[Note: two executors] A layer whose saved tensors stay in the worker (policy `keep` on a
combined rank) runs under eager autograd, exactly as one process would: nothing crosses a
process, and nothing needs the saved tensors by name (the two run about as fast). A layer
whose saved tensors leave the worker (a PipeFB forward or backward rank, policy `offload`)
runs through its explicit forward/backward split
(`pipefb.runtime.layersplit.LayerSplit`): the forward
returns the stash, the backward needs only the stash. Both accumulate parameter gradients
into `param.grad`, micro-batch after micro-batch, like `loss.backward()` does. Only the
split can run its backward in two parts, input grads first (a stage that sends gradients
on runs it for every layer: [Note: input grads first] in docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from pipefb.job.shapes import TensorSpec
from pipefb.runtime.layersplit import DeferredGrads, LayerSplit

Saved = dict[str, torch.Tensor]
Params = Sequence[torch.Tensor] | None  # a weight version in module order; None: the live one
#: The autocast a layer's forward runs under ([Note: mixed precision] in pipefb.job.precision)
Autocast = Callable[[], AbstractContextManager[object]]


def needs_grad(layer: int, specs: Sequence[TensorSpec], flows: bool | None = None
               ) -> list[bool]:
    """Which inputs of layer `layer` of a layer sequence get a gradient: its first, when
    floating and a gradient flows into it (`flows`, see `grad_flows`; None: every layer
    after the first). Layer 0's input is data and a loss's targets are labels: neither
    needs a gradient."""
    into = layer > 0 if flows is None else flows
    return [into and j == 0 and s.dtype.is_floating_point for j, s in enumerate(specs)]


def grad_flows(layers: Sequence[torch.nn.Module]) -> list[bool]:
    """For each layer of a sequence, whether its input carries a gradient: whether some
    layer before it has a parameter to train.

    [Note: no gradient] Parameter-free and frozen layers at the front take data that
    nothing differentiates, as in one process: they run as `NoGradExec`, keep nothing, and
    a backward that reaches them stops there. A stage whose input gets no gradient still
    sends its previous stage the gradient its schedule promises (zeros, which that stage's
    layers, all of them without a backward, never read)."""
    flows, seen = [], False
    for layer in layers:
        flows.append(seen)
        seen = seen or any(p.requires_grad for p in layer.parameters())
    return flows


def trains(layer: torch.nn.Module, input_requires_grad: Sequence[bool]) -> bool:
    """Whether a layer has a backward at all: an input or a parameter needs a gradient."""
    return any(input_requires_grad) or any(p.requires_grad for p in layer.parameters())


class LayerExec(Protocol):
    """Runs one layer; `saved` is whatever the backward of that micro-batch needs."""

    has_random_ops: bool  # whether the forward draws random numbers (seed it first)
    stash_names: list[str]  # names of the tensors that leave the worker (split only)

    def forward(self, inputs: Sequence[torch.Tensor], params: Params = None,
                update_buffers: bool = True) -> tuple[torch.Tensor, Saved]:
        """Runs the forward (with weight version `params`, default the live ones); returns
        the output and what the backward needs. `update_buffers` False: a recomputed
        forward, which leaves the buffers (BatchNorm's statistics) as they are."""
        ...

    def backward(self, saved: Saved, grad_output: torch.Tensor, params: Params = None
                 ) -> list[torch.Tensor | None]:
        """Runs the backward with the forward's weight version (default the live one),
        accumulating into `param.grad`; returns the input grads."""
        ...

    def weights_changed(self) -> None:
        """Drops anything derived from the weights (called after every in-place update)."""
        ...

    def prepare(self, params: Params = None) -> None:
        """Derives ahead what the backward needs from weight version `params` alone
        (default the live one)."""
        ...


class AutogradExec:
    """Eager autograd; the saved tensors are the autograd graph's own (counted, not moved)."""

    def __init__(self, layer: torch.nn.Module, input_requires_grad: Sequence[bool],
                 has_random_ops: bool = True, copy_inputs: bool = False,
                 autocast: Autocast = nullcontext) -> None:
        self.layer = layer
        self.autocast = autocast  # the forward's; the backward runs outside, as in one process
        self.stash_names: list[str] = []  # nothing leaves the worker
        self.input_requires_grad = list(input_requires_grad)
        self.has_random_ops = has_random_ops  # unknown without tracing: seed to be safe
        # the layer writes into its input in place: it gets a copy of the leaf
        # (`pipefb.job.shapes.writes_its_input`), whose gradient reaches the leaf
        self.copy_inputs = copy_inputs

    def forward(self, inputs: Sequence[torch.Tensor], params: Params = None,
                update_buffers: bool = True) -> tuple[torch.Tensor, Saved]:
        assert params is None  # only sync keep layers run here: weights never lag
        assert update_buffers  # and keep layers are never recomputed
        leaves = [x.detach().requires_grad_(g) for x, g in zip(inputs, self.input_requires_grad,
                                                               strict=True)]
        kept: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept.append(t)  # only to account their bytes; autograd holds them anyway
            return t

        with (torch.enable_grad(), self.autocast(),
              torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            args = [x.clone() if self.copy_inputs and x.requires_grad else x for x in leaves]
            out = self.layer(*args)
        saved = {f"input_{i}": x for i, x in enumerate(leaves)}
        saved.update({f"saved_{i}": t for i, t in enumerate(kept)})
        saved["output"] = out
        return out.detach(), saved

    def backward(self, saved: Saved, grad_output: torch.Tensor, params: Params = None
                 ) -> list[torch.Tensor | None]:
        assert params is None
        torch.autograd.backward(saved["output"], grad_output)
        return [saved[f"input_{i}"].grad if g else None
                for i, g in enumerate(self.input_requires_grad)]

    def weights_changed(self) -> None:
        """Autograd derives nothing ahead of time."""

    def prepare(self, params: Params = None) -> None:
        """Nothing to derive: autograd's backward reads the weights themselves."""


class NoGradExec:
    """A layer that nothing differentiates (no parameter to train, no gradient into its
    input: parameter-free or frozen layers at the front): its forward runs without
    autograd, it saves nothing, and its backward has nothing to compute."""

    def __init__(self, layer: torch.nn.Module, n_inputs: int,
                 autocast: Autocast = nullcontext) -> None:
        self.layer, self.n_inputs, self.autocast = layer, n_inputs, autocast
        self.stash_names: list[str] = []
        self.has_random_ops = True  # unknown without tracing: seed to be safe

    def forward(self, inputs: Sequence[torch.Tensor], params: Params = None,
                update_buffers: bool = True) -> tuple[torch.Tensor, Saved]:
        with torch.no_grad(), self.autocast():
            if update_buffers:
                return self.layer(*inputs), {}
            buffers = [(b, b.clone()) for b in self.layer.buffers()]
            out = self.layer(*inputs)
            for b, before in buffers:
                b.copy_(before)
            return out, {}

    def backward(self, saved: Saved, grad_output: torch.Tensor, params: Params = None
                 ) -> list[torch.Tensor | None]:
        return [None] * self.n_inputs

    def backward_input(self, saved: Saved, grad_output: torch.Tensor, params: Params = None
                       ) -> tuple[list[torch.Tensor | None], DeferredGrads]:
        """As `SplitExec.backward_input`: nothing to compute, now or later."""
        return self.backward(saved, grad_output, params), DeferredGrads([], [])

    def backward_weights(self, deferred: DeferredGrads) -> None:
        """Nothing waits."""

    def weights_changed(self) -> None:
        """Nothing is derived from the weights."""

    def prepare(self, params: Params = None) -> None:
        """Nothing to derive."""


class SplitExec:
    """The explicit forward/backward split; the stash may travel through the offload store."""

    def __init__(self, layer: torch.nn.Module, input_specs: list[TensorSpec],
                 input_requires_grad: Sequence[bool], device: torch.device | None = None
                 ) -> None:
        self.split = LayerSplit(layer, input_specs, input_requires_grad=input_requires_grad,
                                device=device)
        self.params = list(layer.parameters())
        self.has_random_ops = self.split.has_random_ops
        self.stash_names = self.split.stash_names

    def forward(self, inputs: Sequence[torch.Tensor], params: Params = None,
                update_buffers: bool = True) -> tuple[torch.Tensor, Saved]:
        return self.split.forward(inputs, params, update_buffers)

    def backward(self, saved: Saved, grad_output: torch.Tensor, params: Params = None
                 ) -> list[torch.Tensor | None]:
        input_grads, param_grads = self.split.backward(saved, grad_output, params)
        self._accumulate(param_grads)
        return input_grads

    def backward_input(self, saved: Saved, grad_output: torch.Tensor, params: Params = None
                       ) -> tuple[list[torch.Tensor | None], DeferredGrads]:
        """The input-grad part of `backward` ([Note: input grads first] in docs/architecture.md);
        `backward_weights` of what it returns accumulates the rest later."""
        return self.split.backward_input(saved, grad_output, params)

    def backward_weights(self, deferred: DeferredGrads) -> None:
        """The weight-grad part of a `backward_input` call, accumulated into `param.grad`."""
        self._accumulate(self.split.backward_weights(deferred))

    def weights_changed(self) -> None:
        """Forgets the weight-derived tensors of the old version."""
        self.split.weights_changed()

    def prepare(self, params: Params = None) -> None:
        """Derives the weight-derived tensors of version `params` (default the live one)
        now."""
        self.split.derive(params)

    def _accumulate(self, param_grads: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, param_grads, strict=True):
                if not p.requires_grad:
                    continue  # frozen: it keeps no gradient, as under autograd
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)


def split_exec(layer: torch.nn.Module, specs: list[TensorSpec], needs: Sequence[bool],
               device: torch.device | None = None, autocast: Autocast = nullcontext
               ) -> SplitExec | NoGradExec:
    """The split executor of a layer, or `NoGradExec` for one nothing differentiates
    ([Note: no gradient]). The split is traced under `autocast`, so its graphs hold the
    casts and run without it ([Note: mixed precision] in pipefb.job.precision)."""
    if not trains(layer, needs):
        return NoGradExec(layer, len(specs), autocast)
    with autocast():
        return SplitExec(layer, specs, needs, device)
