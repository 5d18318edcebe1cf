"""Tensor specs (shape, dtype) and shape propagation through a layer sequence without compute."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call


class SpecError(ValueError):
    """A tensor that does not match its spec (the message names the tensor)."""


class OutputError(SpecError):
    """A layer whose output is not one tensor; `kind` is the output's type name."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one tensor a layer takes or makes.

    Attributes:
        shape: the full shape, micro-batch dimension included.
        dtype: the element type.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of a dense tensor of this spec."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def is_floating(self) -> bool:
        """Whether the dtype is a floating type (and so may carry a gradient)."""
        return self.dtype.is_floating_point

    def zeros(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Returns a zero tensor of this spec."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def example(
        self, device: torch.device | str = "cpu", generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Returns a valid example: standard normal values if floating, zeros otherwise.

        Zeros are a valid index for every embedding and a valid class for every loss, so
        integer examples never fail a bounds check. On the meta device it is a shape
        without storage (the submit check traces layers there: nothing is allocated).
        """
        if torch.device(device).type == "meta":
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        if not self.is_floating:
            return self.zeros(device)
        return torch.randn(self.shape, dtype=self.dtype, generator=generator).to(device)

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` has exactly this shape and dtype."""
        return tuple(tensor.shape) == self.shape and tensor.dtype == self.dtype

    def check(self, value: object, name: str) -> torch.Tensor:
        """Returns `value` if it is a plain dense tensor of this spec.

        Raises:
            SpecError: `value` is no plain tensor, is sparse or on `meta`, or has another
                shape or dtype; the message names it.
        """
        if type(value) not in (torch.Tensor, nn.Parameter):
            raise SpecError(f"{name!r} is a {type(value).__name__}, not a tensor")
        assert isinstance(value, torch.Tensor)
        if value.layout != torch.strided or value.device.type == "meta":
            raise SpecError(f"{name!r} has layout {value.layout} on {value.device}, not data")
        if not self.matches(value):
            shape, expected = list(value.shape), list(self.shape)
            raise SpecError(f"{name!r} is {shape} {value.dtype}, expected {expected} {self.dtype}")
        return value


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    """Returns the spec (shape, dtype) of a tensor, real or fake."""
    return TensorSpec(tuple(int(d) for d in tensor.shape), tensor.dtype)


def requires_grad_for(specs: Sequence[TensorSpec], loss: bool = False) -> list[bool]:
    """Default input-grad flags: floating inputs need one, integers never, targets never.

    Args:
        specs: a layer's input specs.
        loss: whether the layer is the loss layer, whose inputs after the first are targets.
    """
    return [s.is_floating and not (loss and i > 0) for i, s in enumerate(specs)]


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether strides lay the elements out without gaps or overlap (any dim order)."""
    expected = 1
    for size, step in sorted((d for d in zip(shape, stride, strict=True) if d[0] > 1), key=_second):
        if step != expected:
            return False
        expected *= size
    return True


def restride(tensor: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """Returns `tensor` laid out with `stride` (a copy if needed); None keeps any layout."""
    if stride is None or tensor.stride() == stride or tensor.numel() <= 1:
        return tensor
    out = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def _second(pair: tuple[int, int]) -> int:
    return pair[1]


def output_spec(layer: nn.Module, input_specs: Sequence[TensorSpec]) -> TensorSpec:
    """Propagates specs through one layer with fake tensors: nothing is computed.

    Args:
        layer: the layer; its parameters and buffers are only read for their metadata.
        input_specs: the specs of the layer's positional inputs.

    Returns:
        The spec of the layer's single tensor output.

    Raises:
        TypeError: the layer returns something other than one tensor.
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state, device = _fake_state(mode, _state(layer))
        inputs = tuple(torch.empty(s.shape, dtype=s.dtype, device=device) for s in input_specs)
        out = functional_call(layer, state, inputs)
    if not isinstance(out, torch.Tensor):
        kind = type(out).__name__
        raise OutputError(f"layer {type(layer).__name__} returns a {kind}, not one tensor", kind)
    return spec_of(out)


def writes_its_input(layer: nn.Module, input_specs: Sequence[TensorSpec],
                     requires_grad: Sequence[bool]) -> bool:
    """Whether a layer writes in place into an input that needs a gradient (such as
    `nn.ReLU(inplace=True)`), found by a run on fake tensors: such an input must be a copy
    of the received tensor, not the leaf itself, as it is a copy in one process's graph."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state, device = _fake_state(mode, _state(layer))
        inputs = tuple(torch.empty(s.shape, dtype=s.dtype, device=device).requires_grad_(g)
                       for s, g in zip(input_specs, requires_grad, strict=True))
        try:
            with torch.enable_grad():
                functional_call(layer, state, inputs)
        except Exception as error:  # anything else shows in the real forward, as it would
            return isinstance(error, RuntimeError) and "in-place operation" in str(error)
    return False


def written_parameters(layer: nn.Module, input_specs: Sequence[TensorSpec]) -> list[str]:
    """The parameters a layer's forward writes in place (`nn.Embedding(max_norm=...)`
    renormalises its rows), found by a run on fake tensors."""
    return _written(layer, input_specs, dict(layer.named_parameters()))


def written_buffers(layer: nn.Module, input_specs: Sequence[TensorSpec]) -> list[str]:
    """The buffers a layer's forward writes in place (BatchNorm's running statistics),
    found by a run on fake tensors."""
    return _written(layer, input_specs, dict(layer.named_buffers()))


def _written(layer: nn.Module, input_specs: Sequence[TensorSpec],
             real: dict[str, torch.Tensor]) -> list[str]:
    """Which of `real` (the layer's parameters or buffers by name) its forward writes."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state, device = _fake_state(mode, _state(layer))
        before = {n: state[n]._version for n in real}
        inputs = tuple(torch.empty(s.shape, dtype=s.dtype, device=device) for s in input_specs)
        try:
            functional_call(layer, state, inputs)
        except Exception:  # shape propagation ran this forward already; nothing to learn
            return []
        return [n for n in real if state[n]._version != before[n]]


def replays_statistics(layer: nn.Module, input_specs: Sequence[TensorSpec]) -> bool:
    """Whether the buffers a layer's forward writes are running statistics that several
    groups' ranks replay as one process updates them ([Note: group statistics] in
    pipefb.runtime.groupstats): a float32 BatchNorm with torch's own forward, tracking
    running statistics, of a float32 input."""
    norm = nn.modules.batchnorm._BatchNorm
    return (isinstance(layer, norm) and type(layer).forward is norm.forward
            and layer.track_running_stats and layer.running_mean is not None
            and layer.running_mean.dtype == torch.float32
            and bool(input_specs) and input_specs[0].dtype == torch.float32)


def renorms_rows(layer: nn.Module) -> bool:
    """Whether a layer is an `nn.Embedding` with `max_norm` (and torch's own forward): its
    forward renormalises, in place, the weight's rows its input ids look up
    ([Note: renormalised rows] in pipefb.runtime.renorm)."""
    return (isinstance(layer, nn.Embedding) and layer.max_norm is not None
            and type(layer).forward is nn.Embedding.forward)


def infer_input_specs(
    layers: Sequence[nn.Module], input_spec: TensorSpec, target_spec: TensorSpec | None
) -> list[list[TensorSpec]]:
    """Derives the input specs of every layer of a layer sequence from the micro-batch's.

    Every layer but the last takes one tensor; the last layer is the loss and takes
    `(x, targets)`. Shapes propagate through fake tensors, so any worker can derive every
    layer's specs without the weights' values and without compute (nor any draw from the
    global random generator).

    Args:
        layers: the layer sequence, loss layer last.
        input_spec: the spec of a micro-batch's inputs.
        target_spec: the spec of a micro-batch's targets; None when the sequence has no
            loss layer (every layer then takes one tensor).

    Returns:
        One list of input specs per layer, in order.

    Raises:
        ValueError: `layers` is empty.
        SpecError: a layer does not take what the one before it makes (or the micro-batch),
            or the loss layer does not make a scalar; names the layer and the shapes.
    """
    if not layers:
        raise ValueError("infer_input_specs needs at least one layer, got an empty sequence")
    specs: list[list[TensorSpec]] = []
    current = input_spec
    for i, layer in enumerate(layers):
        is_loss = target_spec is not None and i == len(layers) - 1
        layer_specs = [current, target_spec] if is_loss and target_spec else [current]
        specs.append(layer_specs)
        if i < len(layers) - 1 or is_loss:
            current = _checked_output(i, layer, layer_specs)
    if target_spec is not None and current.shape != ():
        raise SpecError(f"the loss layer {type(layers[-1]).__name__} makes shape "
                        f"{list(current.shape)}, not a scalar")
    return specs


def _checked_output(i: int, layer: nn.Module, specs: Sequence[TensorSpec]) -> TensorSpec:
    """`output_spec`, with a shape error of the layer's own code as a SpecError."""
    try:
        with warnings.catch_warnings():  # torch warns before it fails (e.g. broadcasting)
            warnings.simplefilter("ignore")
            return output_spec(layer, specs)
    except OutputError as error:
        if error.kind == "NoneType":
            raise OutputError(f"layer {i} ({type(layer).__name__}) returns None, not one "
                              "tensor (does its forward return its result?)", error.kind
                              ) from None
        raise OutputError(
            f"layer {i} ({type(layer).__name__}) returns a {error.kind}, not one tensor: each "
            "layer hands the next exactly one tensor (tuples and dicts between layers are not "
            "carried; put the layers that pass them into one layer)", error.kind) from None
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        shapes = ", ".join(f"{list(s.shape)} {s.dtype}" for s in specs)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecError(f"layer {i} ({type(layer).__name__}) does not take {shapes}: "
                        f"{reason}") from None


def _state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers by dotted name (shared tensors once)."""
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}


def _fake_state(mode: FakeTensorMode, real: dict[str, torch.Tensor]
                ) -> tuple[dict[str, torch.Tensor], torch.device]:
    """Fake copies of a layer's parameters and buffers, and the device its fake inputs
    go on: the weights' own, except that under CUDA's autocast a layer still on the cpu
    is run on fake CUDA tensors, since autocast casts only tensors of its own device type
    and each rank must expect the dtypes the real run on CUDA makes ([Note: mixed
    precision] in pipefb.job.precision). A parameter's fake copy is an `nn.Parameter`
    either way, as `mode.from_tensor` makes it, for a forward that asks."""
    device = next(iter(real.values())).device if real else torch.device("cpu")
    if device.type == "cpu" and torch.is_autocast_enabled("cuda") \
            and torch.cuda.is_available():
        cuda = torch.device("cuda")
        return {n: _fake_cuda(t, cuda) for n, t in real.items()}, cuda
    return {n: mode.from_tensor(t) for n, t in real.items()}, device


def _fake_cuda(real: torch.Tensor, cuda: torch.device) -> torch.Tensor:
    """A fake CUDA tensor (made under an active FakeTensorMode) of `real`'s metadata."""
    fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=cuda)
    if isinstance(real, nn.Parameter):
        return nn.Parameter(fake, requires_grad=real.requires_grad)
    return fake.requires_grad_(real.requires_grad)
