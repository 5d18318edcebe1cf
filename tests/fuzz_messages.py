"""Hypothesis strategies for any protobuf message, built from its descriptor: every field
set or not, scalars biased to the values that break code (0, -1, the type's extremes,
NaN, empty and odd strings, names the services know), nested messages two deep."""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

# strings the services look for, plus hostile ones
NAMES = ["", "x", "win", "job-0", "mlp", "gpt", "convnet", "digits", "text", "synthetic",
         "cross_entropy", "mse", "sgd", "adamw", "pipefb", "gpipe", "1f1b", "pipedream",
         "single", "auto", "even", "sync", "async", "cpu", "cuda", "keep", "offload",
         "recompute", "forward", "backward", "combined", "RECV_F", "RECV_B", "RECV_W",
         "RECV_L", "EXPORT", "{}", "{bad", '{"hidden": 8}', "[]", "null", "127.0.0.1:1",
         "../../etc", "/etc/passwd", "\x00", "é" * 3, "a" * 300]
_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (
        -(2**31), 2**31 - 1), FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SINT64: (
        -(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 2


def _integer(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, high, -1, 0, 1, 2, 3, 4, 8, 1 << 20, 1 << 31) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(max(low, -4), min(high, 64)),
                     st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _RANGES:
        return _integer(*_RANGES[kind])
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.sampled_from([0.0, -1.0, 1e-3, 1e300, float("nan"), float("inf")]),
                         st.floats(width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64))
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(NAMES), st.text(max_size=16))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from([b"\0" * 4096]))
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [-1, 99])
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return _scalar(field)
    if field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name[
            "value"]
        if value.type == FieldDescriptor.TYPE_MESSAGE:
            return None
        return st.dictionaries(_scalar(key), _scalar(value), max_size=3)
    if depth >= MAX_DEPTH:
        return None
    return fields(field.message_type, depth + 1)


def _per_field(descriptor: Descriptor, depth: int) -> dict[str, st.SearchStrategy[Any]]:
    """Field name -> the strategy of its value (a list for a repeated field)."""
    out: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        value = _value(field, depth)
        if value is None:
            continue
        is_map = (field.type == FieldDescriptor.TYPE_MESSAGE
                  and field.message_type.GetOptions().map_entry)
        repeated = field.is_repeated and not is_map
        out[field.name] = st.lists(value, max_size=4) if repeated else value
    return out


def fields(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments of the message's constructor: any subset of its fields."""
    return st.fixed_dictionaries({}, optional=_per_field(descriptor, depth))


def messages(descriptor: Descriptor) -> st.SearchStrategy[Any]:
    """Messages of the type `descriptor` names, any subset of fields set."""
    cls = message_factory.GetMessageClass(descriptor)
    if not descriptor.fields:  # one message only: repeat it (distinct draws for hypothesis)
        return st.integers().map(lambda _: cls())
    return fields(descriptor).map(lambda kw: cls(**kw))


def mutated(base: Any) -> st.SearchStrategy[Any]:
    """`base` (a valid message) with one to three of its top-level fields set to random
    values: cases that pass the first checks and reach the deeper ones."""
    per_field = _per_field(base.DESCRIPTOR, 0)
    cls = type(base)

    def apply(kw: dict[str, Any]) -> Any:
        out = cls()
        out.CopyFrom(base)
        for name in kw:
            out.ClearField(name)
        out.MergeFrom(cls(**kw))
        return out

    return st.lists(st.sampled_from(sorted(per_field)), min_size=1, max_size=3,
                    unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: per_field[n] for n in names})).map(apply)
