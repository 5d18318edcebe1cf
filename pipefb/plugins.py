"""Builders by name: a built-in one, else an installed package's entry point in a group
(`pipefb.models`, `pipefb.datasets`, `pipefb.losses`), loaded only when a job names it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from pipefb.errors import ConfigError


def find_builder(kind: str, name: str, builtins: Mapping[str, Callable[..., Any]], group: str,
                 known: Iterable[str], kinds: str = "") -> Callable[..., Any]:
    """The builder named `name`: `builtins[name]`, else the entry point of that name in
    `group`.

    Raises:
        ConfigError: no such name (listing `known`), or the entry point fails to load or
            is not callable; `kind` ("model", "dataset", "loss") names what was asked for,
            `kinds` its plural (default `kind` + "s").
    """
    if name in builtins:
        return builtins[name]
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise ConfigError(f"unknown {kind} {name!r}; known {kinds or kind + 's'}: {list(known)}")
    entry = found[0]
    try:
        builder = entry.load()
    except Exception as exc:
        raise ConfigError(f"{kind} plugin {entry.name!r} ({entry.value}) failed to load: "
                          f"{exc!r}") from exc
    if not callable(builder):
        raise ConfigError(f"{kind} plugin {entry.name!r} ({entry.value}) is not callable")
    return builder  # type: ignore[no-any-return]


def plugin_names(group: str, builtins: Iterable[str]) -> list[str]:
    """The names of `group`'s installed entry points that no built-in has, sorted."""
    return sorted({ep.name for ep in entry_points(group=group)} - set(builtins))
