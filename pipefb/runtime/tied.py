"""Parameters shared by several layers (tied weights): one copy per layer on the ranks,
their gradients summed as one process sums them, the same update on every copy.

[Note: tied parameters] A model may use one `nn.Parameter` in several layers (a GPT-2
head tied to the token embedding). In one process autograd sums the uses' gradients of a
micro-batch into the parameter's one input buffer, the later layer's first (its backward
runs first), and `AccumulateGrad` adds that sum into `.grad` micro-batch after
micro-batch: grad = s_0 + s_1 + ... with s_m = c_last,m + ... + c_first,m. A pipeline's
ranks each build the whole model and keep their own layers, so each rank unties every use
into a copy of its own (`untie`; the copies start equal). The weight owners of the uses
keep each micro-batch's contribution c_u,m of their copies apart (`TiedGrads.take`, after
the layer's backward or its weight-grad half); at OPT the owners that hold a use sum one
(uses x micro-batches) buffer per tied parameter over gloo (`Reducer.sum_`, a
collective among the stages that hold a use: each slot holds one owner's value plus
zeros, which adds exactly), and each computes the same sum in autograd's order from the
same numbers. Every copy so gets the gradient one process gets, bit for bit, and the
same optimizer step from the same state keeps the copies equal; the coordinator
compares their digests (`digests`). The cost: each owner keeps its uses' gradients of
every micro-batch of the step until OPT, and the buffer is (uses x micro-batches) times
the parameter, staged through host memory on a GPU (gloo: NCCL refuses two ranks on one
device, as the workers sharing a machine's one GPU are). The sum runs before the groups'
all-reduce (which then sums each copy in a collective of its own, so every owner of a
copy adds the groups' identical values alike) and before clipping,
which counts the parameter once, at its first use's place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipefb.runtime.allreduce import Reducer
from pipefb.runtime.state import weights_digest


@dataclass(frozen=True)
class TiedParam:
    """One parameter that several layers use."""

    uses: tuple[tuple[int, str], ...]  # (layer, parameter name in it), in layer order
    shape: tuple[int, ...]
    dtype: torch.dtype
    trains: bool  # requires_grad: a frozen tied parameter needs no gradient exchange

    @property
    def name(self) -> str:
        """`{layer}.{param}` of its first use: its name in the model's parameter order."""
        layer, param = self.uses[0]
        return f"{layer}.{param}"

    @property
    def layers(self) -> list[int]:
        """The layers that use it, in order."""
        return [layer for layer, _ in self.uses]


def find_ties(layers: Sequence[nn.Module]) -> list[TiedParam]:
    """The parameters that more than one layer of `layers` uses (a parameter shared inside
    one layer is that layer's own business), ordered by their first use."""
    uses: dict[int, list[tuple[int, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            params[id(p)] = p
            uses.setdefault(id(p), []).append((i, name))
    ties = []
    for key, found in uses.items():
        if len({i for i, _ in found}) > 1:
            p = params[key]
            ties.append(TiedParam(tuple(found), tuple(p.shape), p.dtype, p.requires_grad))
    return sorted(ties, key=lambda t: t.uses[0])


def untie(layers: Mapping[int, nn.Module], ties: Sequence[TiedParam]) -> None:
    """Gives every use after the first of each tie, among `layers`, a parameter of its own
    holding the same values (every name in that layer that shared it points to the new
    one)."""
    for tie in ties:
        for i, name in tie.uses[1:]:
            if i not in layers:
                continue
            layer = layers[i]
            shared = layer.get_parameter(name)
            copy = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            for other, p in layer.named_parameters(remove_duplicate=False):
                if p is shared:
                    owner, _, leaf = other.rpartition(".")
                    setattr(layer.get_submodule(owner), leaf, copy)


def tie_stages(ties: Sequence[TiedParam], backward_partition: Sequence[int]) -> list[int]:
    """The backward stages that own a use of a trained tied parameter: the members of the
    gradient exchange ([Note: tied parameters])."""
    used = {i for tie in ties if tie.trains for i in tie.layers}
    return [s for s in range(len(backward_partition) - 1)
            if any(i in used for i in range(backward_partition[s], backward_partition[s + 1]))]


def secondary_names(ties: Sequence[TiedParam]) -> set[str]:
    """`{layer}.{param}` of every use after the first: copies the model's parameter order
    does not list (it lists each parameter once)."""
    return {f"{i}.{name}" for tie in ties for i, name in tie.uses[1:]}


class TiedGrads:
    """One weight owner's part in summing its tied copies' gradients ([Note: tied
    parameters])."""

    def __init__(self, ties: Sequence[TiedParam], layers: Mapping[int, nn.Module],
                 owned: range, microbatches: int, device: torch.device) -> None:
        """
        Args:
            ties: every tied parameter of the model (the same list on every member).
            layers: this rank's (untied) layers.
            owned: the layers whose backward this rank runs.
            microbatches: the micro-batches of a step, in this rank's group.
            device: where the gradients live.
        """
        self.ties = [t for t in ties if t.trains]
        self.layers, self.owned = layers, owned
        self.microbatches, self.device = microbatches, device
        self.reducer: Reducer | None = None  # the members' exchange; None: one member
        # (step, micro-batch, layer, param) -> that use's gradient of that micro-batch
        self._grads: dict[tuple[int, int, int, str], torch.Tensor] = {}

    def owned_copies(self) -> list[torch.Tensor]:
        """This rank's copies of trained tied parameters whose backward it runs."""
        return [self.layers[i].get_parameter(name) for tie in self.ties
                for i, name in tie.uses if i in self.owned]

    @property
    def holds_any(self) -> bool:
        """Whether this rank owns a use of a trained tied parameter."""
        return any(i in self.owned for tie in self.ties for i in tie.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of the gradients kept until OPT."""
        return sum(g.numel() * g.element_size() for g in self._grads.values())

    def take(self, step: int, m: int, layer: int) -> None:
        """Moves the gradients the backward of (step, m) just put into `layer`'s tied
        copies aside, so the next micro-batch's start from none."""
        for tie in self.ties:
            for i, name in tie.uses:
                if i == layer and i in self.owned:
                    p = self.layers[i].get_parameter(name)
                    if p.grad is not None:
                        self._grads[(step, m, i, name)] = p.grad
                        p.grad = None

    def reduce_(self, step: int) -> None:
        """Sets every owned tied copy's gradient to the whole step's, summed over every
        use and micro-batch in one process's order (a collective of the members)."""
        buffers = [self._buffer(step, tie) for tie in self.ties]
        self._grads = {k: g for k, g in self._grads.items() if k[0] > step}
        if self.reducer is not None:  # gloo, through host memory ([Note: tied parameters])
            staged = [b.cpu() for b in buffers]
            self.reducer.sum_(staged)
            buffers = [b.to(self.device) for b in staged]
        for tie, buffer in zip(self.ties, buffers, strict=True):
            total = autograd_sum(buffer)
            for i, name in tie.uses:
                if i in self.owned:
                    self.layers[i].get_parameter(name).grad = total.clone()

    def _buffer(self, step: int, tie: TiedParam) -> torch.Tensor:
        """(uses, micro-batches, *shape): this rank's contributions, zeros elsewhere."""
        buffer = torch.zeros((len(tie.uses), self.microbatches, *tie.shape), dtype=tie.dtype,
                             device=self.device)
        for u, (i, name) in enumerate(tie.uses):
            for m in range(self.microbatches):
                grad = self._grads.get((step, m, i, name))
                if grad is not None:
                    buffer[u, m] = grad
        return buffer

    def digests(self) -> dict[str, str]:
        """Tie name -> digest of this rank's copies of it (their values; one digest per
        name where the copies here are equal, else each copy's apart so the coordinator
        sees the difference)."""
        out: dict[str, str] = {}
        for tie in self.ties:
            found = {weights_digest({"w": self.layers[i].get_parameter(name).detach()})
                     for i, name in tie.uses if i in self.owned}
            for n, digest in enumerate(sorted(found)):
                out[tie.name if n == 0 else f"{tie.name}#{n}"] = digest
        return out


def autograd_sum(buffer: torch.Tensor) -> torch.Tensor:
    """Sum of a (uses, micro-batches, ...) buffer in the order one process's autograd adds
    them: per micro-batch the last use's gradient first, then micro-batch after
    micro-batch into the accumulated gradient."""
    uses, microbatches = buffer.shape[0], buffer.shape[1]
    total = torch.zeros_like(buffer[0, 0])
    for m in range(microbatches):
        s = buffer[uses - 1, m]
        for u in range(uses - 2, -1, -1):
            s = s + buffer[u, m]
        total = s.clone() if m == 0 else total + s
    return total
