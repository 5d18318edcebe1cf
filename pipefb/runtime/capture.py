"""Captures a layer's AOTAutograd forward/backward graphs and classifies its saved tensors."""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from functorch.compile import aot_function, make_boxed_func
from torch import fx

from pipefb.job.shapes import TensorSpec, is_dense, spec_of

# torch's tracing keeps process-wide state (torch.fx's patcher among it): two threads
# tracing at once (a worker's Assign or Migrate beside another RPC) can trip its asserts
_TRACING = threading.Lock()

# [Note: captured graph conventions] (torch 2.13, aot_function, static shapes; checked at
# capture time by `_saved_slots` and pinned in tests/test_split.py)
#   forward  graph: (*params, *buffers, *inputs) -> (output, *saved)
#   backward graph: (*saved, tangent)            -> one grad per primal, in primal order,
#                   None for every primal that does not require a grad (buffers, ints).
# The backward's placeholders carry the names of the forward nodes they receive. Saved
# tensors may be primals (params, buffers, inputs), weight-only derived tensors (such as
# `t = aten.t(weight)`), activations or random masks. Saved SymInts only appear with
# dynamic shapes, which pipefb never traces, and are refused like buffer mutations.
#
# [Note: what travels]
# A saved tensor is *weight-only* when every input of its node is a param/buffer
# placeholder or weight-only, and it is not a seeded random op (rand, bernoulli,
# native_dropout...; torch tags them `nondeterministic_seeded`). Params and buffers saved
# as they are come from the backward worker's own weights; weight-only derived tensors
# are recomputed there from that weight version (cached per `(id, _version)` of each
# weight); everything else is the stash and travels through the offload store.
#
# [Note: weight versions]
# The derived cache key is the `_version` counter of each param and buffer: any in-place
# update through the tensor (optimizer step, `copy_` under no_grad) bumps it. Writes
# through `.data` do not, so weights must never be updated through `.data`.

Kind = Literal["param", "buffer", "derived", "stash"]
# Seeded random ops by name, for ops without torch's `nondeterministic_seeded` tag.
_RANDOM_OPS = frozenset(
    "rand randn rand_like randn_like randint bernoulli native_dropout normal uniform "
    "multinomial randperm".split()
)
TANGENT_PREFIX = "tangents"


class SplitError(ValueError):
    """A layer whose forward/backward cannot be split (the message names the layer).

    Attributes:
        reason: what is wrong, in the words of the layer's author (no graph-node names):
            the submit check's refusal ends with it (`pipefb.runtime.splitcheck`).
    """

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message




@dataclass(frozen=True)
class SavedSlot:
    """One tensor the backward graph takes, and where a backward worker gets it.

    Attributes:
        name: the stash key, param/buffer name or derived node name.
        kind: `param`/`buffer` (the worker's weights), `derived` (recomputed from them)
            or `stash` (shipped from the forward worker).
        index: position among the params, buffers or derived tensors; -1 for `stash`.
        spec: the traced shape and dtype.
        stride: the traced strides when they are dense, else None (any layout works).
    """

    name: str
    kind: Kind
    index: int
    spec: TensorSpec
    stride: tuple[int, ...] | None


def is_random(node: fx.Node) -> bool:
    """Whether an fx node draws from a random generator (its value cannot be recomputed)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return True
        return target._schema.name.split("::")[-1] in _RANDOM_OPS
    return getattr(target, "__name__", "") in _RANDOM_OPS


def weight_only_nodes(graph: fx.Graph, n_weights: int) -> set[fx.Node]:
    """The nodes of a forward graph that depend on its first `n_weights` placeholders only.

    See [Note: what travels]: random ops and whatever consumes them are excluded.
    """
    placeholders = list(graph.find_nodes(op="placeholder"))
    only: set[fx.Node] = set(placeholders[:n_weights])
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "get_attr") and not is_random(node):
            if all(arg in only for arg in node.all_input_nodes):
                only.add(node)
    return only


def derive_module(
    forward: fx.GraphModule, n_weights: int, targets: list[fx.Node]
) -> fx.GraphModule:
    """Prunes a forward graph to `(*params, *buffers) -> targets` (all weight-only nodes)."""
    needed = _ancestors(targets)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in forward.graph.nodes:
        if node.op == "placeholder" and len(env) < n_weights:
            env[node] = graph.placeholder(node.name)
        elif node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[t] for t in targets))
    return fx.GraphModule(forward, graph)


def _ancestors(targets: list[fx.Node]) -> set[fx.Node]:
    """The nodes `targets` are computed from, themselves included."""
    needed: set[fx.Node] = set()
    stack = list(targets)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return needed


def split_backward(
    backward: fx.GraphModule, n_weights: int
) -> tuple[fx.GraphModule, fx.GraphModule, list[int]]:
    """Splits a backward graph into its input-grad part and its weight-grad part.

    [Note: input grads first] A stage's input gradient is what the previous stage waits
    for; its weight gradients only the optimizer step needs. So the backward is cut in two:

        input  graph: (*saved, tangent)                  -> (*input grads, *carries)
        weight graph: (*some of saved, tangent, *carries) -> (*param grads, *buffer grads)

    The input graph holds every node an input grad depends on; the weight graph holds the
    rest of what the weight grads need, and takes the input graph's intermediates it
    reads (the carries: such as a linear's output gradient, whose product with the saved
    input is the weight's gradient) and only the arguments it reads (their positions are
    returned third), so a waiting weight half holds no more than it needs. Every node
    runs once, on the same values as in the whole graph, so the two parts give bit for
    bit the grads the whole one does.
    """
    outs = list(cast("Sequence[fx.Node | None]", backward.graph.output_node().args[0]))
    first = _ancestors([n for n in outs[n_weights:] if n is not None])
    rest = _ancestors([n for n in outs[:n_weights] if n is not None]) - first
    # a node of the input part with several outputs (layer norm's backward gives the input,
    # weight and bias grads at once) hands on the tensors it made, never the tuple
    moved = {n for n in rest if n.target is operator.getitem and n.args[0] in first}
    first, rest = first | moved, rest - moved
    carries = [n for n in backward.graph.nodes if n in first and n.op != "placeholder"
               and (n in outs[:n_weights] or any(u in rest for u in n.users))]
    inputs, weights = fx.Graph(), fx.Graph()
    env_in: dict[fx.Node, fx.Node] = {}
    env_w: dict[fx.Node, fx.Node] = {}
    read = [k for k, node in enumerate(placeholders(backward))
            if node in outs[:n_weights] or any(u in rest for u in node.users)]
    for node in placeholders(backward):
        env_in[node] = inputs.placeholder(node.name)
    for k in read:
        node = placeholders(backward)[k]
        env_w[node] = weights.placeholder(node.name)
    for node in carries:
        env_w[node] = weights.placeholder(f"carry_{node.name}")
    for node in backward.graph.nodes:
        if node.op == "placeholder" or node.op == "output":
            continue
        if node in first:
            env_in[node] = inputs.node_copy(node, lambda n: env_in[n])
        elif node in rest:
            env_w[node] = weights.node_copy(node, lambda n: env_w[n])
    inputs.output((*(None if n is None else env_in[n] for n in outs[n_weights:]),
                   *(env_in[n] for n in carries)))
    weights.output(tuple(None if n is None else env_w[n] for n in outs[:n_weights]))
    return fx.GraphModule(backward, inputs), fx.GraphModule(backward, weights), read


def capture(
    fn: Callable[..., torch.Tensor], args: list[torch.Tensor]
) -> dict[str, fx.GraphModule]:
    """Runs `fn` once through aot_function and returns the graphs it compiled ('fw', 'bw')."""
    graphs: dict[str, fx.GraphModule] = {}

    def compiler(kind: str) -> Callable[[fx.GraphModule, Any], Any]:
        def compile_(gm: fx.GraphModule, _example: Any) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compile_

    compiled = aot_function(fn, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    cuda = sorted({a.device for a in args if a.device.type == "cuda"}, key=str)
    with _TRACING, torch.random.fork_rng(devices=cuda):  # tracing must not move the RNG
        out = compiled(*args)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            torch.autograd.backward(out, torch.ones_like(out))
    return graphs


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    """The placeholder nodes of a graph module, in order."""
    return list(gm.graph.find_nodes(op="placeholder"))


def val_spec(node: fx.Node) -> tuple[TensorSpec, tuple[int, ...] | None]:
    """The traced spec of a node and its strides when they are dense."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise SplitError(f"saved value {node.name!r} is {type(val).__name__}, not a tensor",
                         "its backward keeps a value that is not a tensor (a size or number "
                         "its forward computed), which the stash cannot carry")
    stride = tuple(int(s) for s in val.stride())
    return spec_of(val), stride if is_dense(tuple(val.shape), stride) else None
