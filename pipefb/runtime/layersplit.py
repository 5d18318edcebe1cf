"""The explicit forward/backward split of one layer, captured once with AOTAutograd."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import cast

import torch
from torch import fx, nn
from torch.func import functional_call

from pipefb.job.shapes import (
    SpecError,
    TensorSpec,
    renorms_rows,
    requires_grad_for,
    restride,
    spec_of,
)
from pipefb.runtime.capture import (
    TANGENT_PREFIX,
    Kind,
    SavedSlot,
    SplitError,
    capture,
    derive_module,
    is_random,
    placeholders,
    split_backward,
    val_spec,
    weight_only_nodes,
)

__all__ = ["DeferredGrads", "LayerSplit", "SplitError", "StashError", "is_random"]

# the reason of a split whose graphs are not in the form the split runs
_UNLIKE = ("its traced forward and backward are not (output, saved tensors) and "
           "(saved tensors, output gradient) -> one gradient per input and parameter")


class StashError(SpecError):
    """A stash that does not fit the traced layer (the bad name or value is named)."""


class LayerSplit:
    """A layer's forward and backward as two separately callable graphs.

    A forward worker calls `forward` and ships the stash; a backward worker, which never
    ran that forward, calls `backward` with the stash, the output gradient and the weight
    version the forward used. See [Note: captured graph conventions].

    Attributes:
        param_names: the layer's parameters, in `named_parameters` order.
        buffer_names: the layer's buffers, in `named_buffers` order.
        stash_names: the saved tensors that travel, in backward-graph order.
        derived_names: the weight-only saved tensors a backward worker recomputes.
        input_specs, input_requires_grad, output_spec: the traced signature.
        forward_graph, backward_graph, derive_graph: the captured and pruned fx graphs.
    """

    def __init__(
        self,
        layer: nn.Module,
        input_specs: Sequence[TensorSpec],
        input_requires_grad: Sequence[bool] | None = None,
        *,
        cache_size: int = 2,
        device: torch.device | None = None,
    ) -> None:
        """Traces `layer` once on example inputs of `input_specs`.

        Args:
            layer: the layer; traced in its current train/eval mode.
            input_specs: the specs of its positional inputs.
            input_requires_grad: which inputs get a grad; default `requires_grad_for`.
            cache_size: how many weight versions keep their derived tensors.
            device: where it computes; default: where its weights live (CPU for a layer
                without any). A layer without weights traces constants on this device.

        Raises:
            ValueError: an integer input marked as requiring a grad, or a flag count that
                does not match the inputs.
            SplitError: the layer returns no single tensor, mutates a buffer, has no
                gradient at all, or saves non-tensors.
        """
        self.layer = layer
        self._home = device
        self.input_specs = list(input_specs)
        self.input_requires_grad = self._grad_flags(input_requires_grad)
        self.param_names = [n for n, _ in layer.named_parameters()]
        self.buffer_names = [n for n, _ in layer.named_buffers()]
        # [Note: weights in place] New weight versions are copied into these same tensors
        # (optimizer steps, weight pushes), so the lists are taken once, not per call.
        self._param_list: list[torch.Tensor] = [p for _, p in layer.named_parameters()]
        self._buffer_list: list[torch.Tensor] = [b for _, b in layer.named_buffers()]
        self.param_specs = [spec_of(p) for p in self._own_params()]
        graphs = self._trace()
        self.forward_graph, self.backward_graph = graphs["fw"], graphs["bw"]
        self.output_spec, self._tangent_stride = self._tangent()
        self._slots = self._saved_slots()
        self.stash_names = [s.name for s in self._slots if s.kind == "stash"]
        self.derived_names = [s.name for s in self._slots if s.kind == "derived"]
        # Whether the forward draws random numbers: only then must the caller seed it.
        self.has_random_ops = any(is_random(n) for n in self.forward_graph.graph.nodes)
        self._index_bounds = self._embedding_bounds()
        self._cache: OrderedDict[
            tuple[tuple[int, int], ...], tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]
        ] = OrderedDict()
        self._cache_size = cache_size

    @property
    def num_derived(self) -> int:
        """How many saved tensors are derived from the weights alone (never stashed)."""
        return len(self.derived_names)

    def forward(
        self, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor] | None = None,
        update_buffers: bool = True,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Runs the captured forward graph without autograd.

        Args:
            inputs: the layer's inputs, of `input_specs`.
            params: the weight version to use, in `param_names` order; default the
                layer's current parameters. Buffers are always the layer's.
            update_buffers: write the buffers' new values (BatchNorm's statistics) into
                the layer ([Note: mutated buffers]); False for a recomputed forward, whose
                micro-batch updated them already.

        Returns:
            The output and the stash: the tensors of `stash_names` (they may alias the
            inputs or the output).

        Raises:
            SpecError: an input or param of the wrong count, shape or dtype.
        """
        # The graphs were traced on contiguous examples; a view (a text window) is copied.
        inputs = [t.contiguous() for t in self._check_all("input", inputs, self.input_specs)]
        weights = [*self._params(params), *self._buffers()]
        with torch.no_grad():
            outs = self.forward_graph(*weights, *inputs)
            n_new = len(self.mutated_buffers)
            if update_buffers:
                for k, value in zip(self.mutated_buffers, outs[:n_new], strict=True):
                    self._buffer_list[k].copy_(value)
        n_user = len(outs) - len(self._slots)
        stash = {s.name: outs[n_user + i] for i, s in enumerate(self._slots) if s.kind == "stash"}
        return outs[n_new], stash

    def backward(
        self,
        stash: Mapping[str, torch.Tensor],
        grad_output: torch.Tensor,
        params: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Runs only the captured backward graph; the forward is never re-run.

        Args:
            stash: the tensors of `stash_names`, as `forward` returned them (any strides).
            grad_output: the gradient of the loss with respect to the layer's output.
            params: the weight version the forward used; default the layer's current ones.

        Returns:
            The input grads (None where `input_requires_grad` is False) and the param
            grads in `param_names` order (zeros for a param that got none).

        Raises:
            KeyError: a stash name is missing (the message names it).
            SpecError: a stash tensor, `grad_output` or param of a bad type, shape or dtype.
            StashError: an unexpected stash name, an index out of range, or a backward
                that fails on the stash's values (both are ValueErrors).
        """
        params = self._params(params)
        grads = _run(self.backward_graph, self._backward_args(stash, grad_output, params))
        n_w = len(self.param_names) + len(self.buffer_names)
        return self._input_grads(grads[n_w:]), self._param_grads(grads[: len(params)], params)

    def backward_input(
        self,
        stash: Mapping[str, torch.Tensor],
        grad_output: torch.Tensor,
        params: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], DeferredGrads]:
        """Runs only the input-grad part of the backward (see [Note: input grads first]).

        Takes and checks what `backward` does; returns the input grads now and what
        `backward_weights` needs for the param grads later.
        """
        params = self._params(params)
        args = self._backward_args(stash, grad_output, params)
        inputs_graph, _, read = self._halves
        outs = _run(inputs_graph, args)
        n_in = len(self.input_specs)
        carries = cast("list[torch.Tensor]", outs[n_in:])  # nodes' values: never None
        return (self._input_grads(outs[:n_in]),
                DeferredGrads([*(args[k] for k in read), *carries], params))

    def backward_weights(self, deferred: DeferredGrads) -> list[torch.Tensor]:
        """The param grads of a `backward_input` call, in `param_names` order (zeros for a
        param that got none): together, bit for bit what `backward` returns."""
        _, weights_graph, _ = self._halves
        grads = _run(weights_graph, deferred.args)
        return self._param_grads(grads[: len(deferred.params)], deferred.params)

    def cut(self) -> None:
        """Cuts the backward into its input-grad and weight-grad halves now (the first
        `backward_input` would), so a graph the cut cannot take shows at once."""
        self._halves  # noqa: B018 (a cached property: reading it cuts)

    @cached_property
    def _halves(self) -> tuple[fx.GraphModule, fx.GraphModule, list[int]]:
        return split_backward(self.backward_graph, len(self.param_names) + len(self.buffer_names))

    def _backward_args(self, stash: Mapping[str, torch.Tensor], grad_output: torch.Tensor,
                       params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The backward graph's arguments: the saved tensors from where each lives, then
        the output gradient (each checked)."""
        buffers = self._buffers()
        stashed = self._check_stash(stash)
        grad = restride(self.output_spec.check(grad_output, "grad_output"), self._tangent_stride)
        sources: dict[Kind, Sequence[torch.Tensor]] = {
            "param": params,
            "buffer": buffers,
            "derived": self._derived(params, buffers),
        }
        args = [
            stashed[s.name] if s.kind == "stash" else sources[s.kind][s.index] for s in self._slots
        ]
        return [*args, grad]

    def _grad_flags(self, flags: Sequence[bool] | None) -> list[bool]:
        """Validates the input-grad flags against the input specs."""
        if flags is None:
            return requires_grad_for(self.input_specs)
        if len(flags) != len(self.input_specs):
            raise ValueError(
                f"{len(flags)} input_requires_grad flags for {len(self.input_specs)} inputs"
            )
        for spec, flag in zip(self.input_specs, flags, strict=True):
            if flag and not spec.is_floating:
                raise ValueError(f"an input of dtype {spec.dtype} cannot require a grad")
        return list(flags)

    def _trace(self) -> dict[str, fx.GraphModule]:
        """Captures the graphs; outputs that alias an input are cloned (else no backward)."""
        params = [p.detach().requires_grad_(p.requires_grad) for p in self._own_params()]
        gen = torch.Generator().manual_seed(0)  # example values never touch the global RNG
        inputs = [
            s.example(self._device(), gen).requires_grad_(g)
            for s, g in zip(self.input_specs, self.input_requires_grad, strict=True)
        ]
        # An output that aliases an input gets no backward unless cloned; a layer that
        # writes into its input (an in-place activation) gives its input's new value a
        # tangent of its own unless it writes into a copy, as it does in one process's graph.
        # [Note: mutated buffers] A forward that updates buffers (BatchNorm's running
        # statistics) is traced on copies of them, so tracing changes no statistic; the
        # captured forward returns their new values first (AOTAutograd's functionalised
        # input mutations, in input order), and `forward` writes them into the layer's
        # buffers, once per micro-batch, as one process's forward does.
        for copy_inputs, clone in ((False, False), (False, True), (True, False), (True, True)):
            buffers = [b.clone() for b in self._buffers()]
            versions = [b._version for b in (*params, *buffers)]
            with _without_renorm(self.layer):  # [Note: renormalised rows]
                graphs = capture(self._functional(clone, copy_inputs),
                                 [*params, *buffers, *inputs])
            if "bw" in graphs and len(_tangents(graphs["bw"])) == 1:
                written = [k for k, (t, v) in enumerate(zip((*params, *buffers), versions,
                                                            strict=True)) if t._version != v]
                if any(k < len(params) for k in written):
                    raise SplitError(f"layer {type(self.layer).__name__} writes into its "
                                     "parameters in its forward: not supported",
                                     "it writes into its parameters in its forward")
                self.mutated_buffers = [k - len(params) for k in written]
                return graphs
        raise SplitError(f"layer {type(self.layer).__name__} has no gradient to split",
                         "its backward does not take exactly one gradient, its output's: "
                         "the output is not differentiable in its input and parameters (a "
                         "detach?), or the forward also writes into another tensor that "
                         "needs a gradient")

    def _functional(self, clone: bool, copy_inputs: bool) -> Callable[..., torch.Tensor]:
        """The layer as a function of `(*params, *buffers, *inputs)`; with `copy_inputs`,
        the layer gets copies of the inputs that need a gradient."""
        names = [*self.param_names, *self.buffer_names]
        grads = self.input_requires_grad

        def fn(*args: torch.Tensor) -> torch.Tensor:
            inputs = tuple(x.clone() if copy_inputs and g else x
                           for x, g in zip(args[len(names):], grads, strict=True))
            out = functional_call(self.layer, dict(zip(names, args, strict=False)), inputs)
            if not isinstance(out, torch.Tensor):
                raise SplitError(f"layer {type(self.layer).__name__} returned {type(out).__name__}")
            return out.clone() if clone else out

        return fn

    def _tangent(self) -> tuple[TensorSpec, tuple[int, ...] | None]:
        """The spec and strides of the single tangent of the backward graph."""
        tangents = _tangents(self.backward_graph)
        if len(tangents) != 1:
            raise SplitError(f"backward graph takes {len(tangents)} tangents, expected 1",
                             f"its backward takes {len(tangents)} gradients, not one (its "
                             "output's)")
        return val_spec(tangents[0])

    def _saved_slots(self) -> list[SavedSlot]:
        """Classifies every saved tensor (see [Note: what travels])."""
        saved = self._saved_nodes()
        primals = placeholders(self.forward_graph)
        outs = list(cast("Sequence[fx.Node]", self.forward_graph.graph.output_node().args[0]))
        outs = outs[len(self.mutated_buffers):]  # the buffers' new values come first
        n_grads = len(cast("Sequence[object]", self.backward_graph.graph.output_node().args[0]))
        if n_grads != len(primals):
            raise SplitError(f"backward returns {n_grads} grads for {len(primals)} primals",
                             _UNLIKE)
        if len(outs) - len(saved) != 1 or [o.name for o in outs[1:]] != [n.name for n in saved]:
            raise SplitError(f"forward outputs {[o.name for o in outs]} are not (output, *{saved})",
                             _UNLIKE)
        n_p, n_w = len(self.param_names), len(self.param_names) + len(self.buffer_names)
        only = weight_only_nodes(self.forward_graph.graph, n_w)
        slots: list[SavedSlot] = []
        derived: list[fx.Node] = []
        for node in outs[1:]:
            spec, stride = val_spec(node)
            pos = primals.index(node) if node.op == "placeholder" else -1
            if 0 <= pos < n_p:
                slots.append(SavedSlot(self.param_names[pos], "param", pos, spec, stride))
            elif 0 <= pos < n_w:
                slots.append(
                    SavedSlot(self.buffer_names[pos - n_p], "buffer", pos - n_p, spec, stride)
                )
            elif node in only:
                slots.append(SavedSlot(node.name, "derived", len(derived), spec, stride))
                derived.append(node)
            else:
                name = f"input_{pos - n_w}" if pos >= 0 else node.name
                slots.append(SavedSlot(name, "stash", -1, spec, stride))
        self.derive_graph = derive_module(self.forward_graph, n_w, derived)
        return slots

    def _embedding_bounds(self) -> dict[str, int]:
        """Stash names used as embedding indices in the backward, with their bound.

        Out-of-range indices are silently dropped on CPU and unchecked on some devices, so
        a hostile stash is refused before the backward runs.
        """
        names = {n.name: s.name for n, s in zip(self._saved_nodes(), self._slots, strict=True)}
        bounds: dict[str, int] = {}
        for node in self.backward_graph.graph.find_nodes(
            op="call_function", target=torch.ops.aten.embedding_dense_backward.default
        ):
            index, count = node.args[1], node.args[2]
            if isinstance(index, fx.Node) and index.name in names and isinstance(count, int):
                bounds[names[index.name]] = count
        return bounds

    def _saved_nodes(self) -> list[fx.Node]:
        """The backward graph's saved-tensor placeholders, in order."""
        return [
            n for n in placeholders(self.backward_graph) if not n.name.startswith(TANGENT_PREFIX)
        ]

    def _device(self) -> torch.device:
        """Where the layer computes: the device given, else where its weights live (CPU for
        a layer without any)."""
        if self._home is not None:
            return self._home
        weights = [*self._own_params(), *self._buffers()]
        return weights[0].device if weights else torch.device("cpu")

    def _own_params(self) -> list[torch.Tensor]:
        """The layer's parameters, in `param_names` order (see [Note: weights in place])."""
        return self._param_list

    def _buffers(self) -> list[torch.Tensor]:
        """The layer's buffers, in `buffer_names` order."""
        return self._buffer_list

    def _params(self, params: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """The given weight version (validated) or the layer's current one."""
        if params is None:
            return self._own_params()
        return self._check_all("param", params, self.param_specs, self.param_names)

    def _check_all(
        self,
        what: str,
        values: Sequence[torch.Tensor],
        specs: list[TensorSpec],
        names: list[str] | None = None,
    ) -> list[torch.Tensor]:
        """Validates a sequence of tensors against their specs."""
        if len(values) != len(specs):
            raise SpecError(f"{len(values)} {what}s given, the layer takes {len(specs)}")
        names = names or [f"{what}_{i}" for i in range(len(specs))]
        return [s.check(v, n) for n, v, s in zip(names, values, specs, strict=True)]

    def _check_stash(self, stash: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validates a stash (names, types, specs, index ranges) and restores strides."""
        if not isinstance(stash, Mapping):
            raise StashError(f"stash is a {type(stash).__name__}, not a mapping")
        unexpected = sorted(str(k) for k in stash if k not in self.stash_names)
        if unexpected:
            raise StashError(
                f"stash has unexpected names {unexpected}; expected {self.stash_names}"
            )
        device = self._device()
        out: dict[str, torch.Tensor] = {}
        for slot in (s for s in self._slots if s.kind == "stash"):
            if slot.name not in stash:
                raise KeyError(f"stash lacks {slot.name!r}; expected {self.stash_names}")
            tensor = slot.spec.check(stash[slot.name], slot.name).detach()
            self._check_bounds(slot.name, tensor)
            out[slot.name] = restride(tensor.to(device), slot.stride)
        return out

    def _check_bounds(self, name: str, tensor: torch.Tensor) -> None:
        """Refuses embedding indices outside `[0, num_embeddings)`."""
        bound = self._index_bounds.get(name)
        if bound is not None and tensor.numel() and (tensor.min() < 0 or tensor.max() >= bound):
            raise StashError(f"stash {name!r} holds indices outside [0, {bound})")

    def derive(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """Derives the weight-only saved tensors of weight version `params` (default the
        current weights) now, so that the next `backward` with them finds them (a backward
        rank calls this while it waits for the next step's stash)."""
        self._derived(self._params(params), self._buffers())

    def weights_changed(self) -> None:
        """Forgets every derived tensor: call after updating weights in place.

        `_version` alone does not catch every in-place update (fused optimizer steps and
        writes through `.data` leave it unchanged), so the owner of the weights says so.
        """
        self._cache.clear()

    def _derived(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The weight-only saved tensors of this weight version, derived once per version."""
        if not self.derived_names:
            return []
        weights = (*params, *buffers)
        key = tuple((id(w), w._version) for w in weights)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key][1]
        with torch.no_grad():
            derived: list[torch.Tensor] = list(self.derive_graph(*weights))
        self._cache[key] = (weights, derived)  # holding `weights` keeps their ids unique
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return derived

    @staticmethod
    def _param_grads(
        grads: Sequence[torch.Tensor | None], params: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The param grads, zeros for a param that got none."""
        return [g if g is not None else torch.zeros_like(p)
                for g, p in zip(grads, params, strict=True)]

    def _input_grads(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The input grads: None where `input_requires_grad` is False, zeros where an input
        that needs one got none."""
        return [None if not need else g if g is not None else spec.zeros()
                for g, spec, need in zip(grads, self.input_specs, self.input_requires_grad,
                                         strict=True)]


@dataclass
class DeferredGrads:
    """What `LayerSplit.backward_weights` needs: the backward's arguments its weight half
    reads, the input half's carries, and the weight version the forward used."""

    args: list[torch.Tensor]
    params: list[torch.Tensor]


@contextmanager
def _without_renorm(layer: nn.Module) -> Iterator[None]:
    """An `nn.Embedding(max_norm=...)` layer with `max_norm` off: its renorm is the
    runtime's, outside the traced graphs ([Note: renormalised rows] in
    pipefb.runtime.renorm)."""
    if not renorms_rows(layer):
        yield
        return
    assert isinstance(layer, nn.Embedding)
    max_norm, layer.max_norm = layer.max_norm, None
    try:
        yield
    finally:
        layer.max_norm = max_norm


def _tangents(backward: fx.GraphModule) -> list[fx.Node]:
    """The tangent placeholders of a backward graph (one per differentiable output)."""
    return [n for n in placeholders(backward) if n.name.startswith(TANGENT_PREFIX)]


def _run(graph: fx.GraphModule, args: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Runs a captured backward graph (part) without autograd.

    Raises:
        StashError: it fails on the given values (such as an index out of range).
    """
    with torch.no_grad():
        try:
            return list(graph(*args))
        except (RuntimeError, IndexError) as exc:
            raise StashError(f"backward failed on the given stash: {exc}") from exc
