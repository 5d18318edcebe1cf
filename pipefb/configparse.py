"""Parses JSON-able config dicts into frozen dataclasses, naming any bad key or value."""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from pipefb.errors import ConfigError

C = TypeVar("C")


def parse_config(cls: type[C], config: dict[str, Any] | None, owner: str) -> C:
    """Builds the frozen dataclass `cls` from a plain dict, checking keys and types.

    Args:
        cls: a dataclass whose fields all have defaults.
        config: the JSON-able values to override; None means all defaults.
        owner: what the config is for (e.g. "model 'gpt'"), used in error messages.

    Returns:
        The dataclass instance (its own `__post_init__` checks value ranges).

    Raises:
        ConfigError: a key that is not a field, or a value of the wrong type.
    """
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(f"config of {owner} must be a dict, got {type(config).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in config.items():
        if key not in names:
            raise ConfigError(f"unknown config key {key!r} for {owner}; known keys: {names}")
        kwargs[key] = coerce(value, hints[key], f"{key!r} of {owner}")
    return cls(**kwargs)


def coerce(value: Any, hint: Any, what: str) -> Any:
    """Returns `value` converted to the annotated type `hint`, or raises ConfigError."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        for arg in get_args(hint):
            try:
                return coerce(value, arg, what)
            except ConfigError:
                continue
        raise ConfigError(f"{what} = {value!r} is not a {hint}")
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(f"{what} = {value!r} is not one of {list(get_args(hint))}")
        return value
    if origin is tuple:
        return _coerce_tuple(value, get_args(hint), what)
    return _coerce_scalar(value, hint, what)


def _coerce_tuple(value: Any, args: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple) or len(value) != len(args):
        raise ConfigError(f"{what} = {value!r} is not a sequence of {len(args)} values")
    pairs = enumerate(zip(value, args, strict=True))
    return tuple(coerce(v, a, f"{what}[{i}]") for i, (v, a) in pairs)


def _coerce_scalar(value: Any, hint: Any, what: str) -> Any:
    if hint is type(None) and value is None:
        return None
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{what} = {value!r} is not finite")
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{what} = {value!r} is not a {name}")


def require(ok: bool, what: str, value: Any, rule: str) -> None:
    """Raises ConfigError "`what` = `value` must be `rule`" unless `ok`."""
    if not ok:
        raise ConfigError(f"{what} = {value!r} must be {rule}")


__all__ = ["coerce", "parse_config", "require"]
