"""Summaries of several workers' profiles of one job: the per-layer median profile, and
each worker's speed relative to the median."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

from pipefb.errors import ConfigError
from pipefb.sim.costs import LayerProfile, Profile

_BYTES = ("input_bytes", "output_bytes", "saved_bytes", "param_bytes")


def median_profile(profiles: Sequence[Profile]) -> Profile:
    """The per-layer median of profiles of the same job measured on several workers.

    Every time field, both optimizer fields and the data time are medians; the bytes must
    agree.

    Raises:
        ConfigError: no profiles, or profiles of different layers, sizes or bytes.
    """
    if not profiles:
        raise ConfigError("median_profile needs at least one profile")
    for k, p in enumerate(profiles):
        _check_same(profiles[0], p, k)
    rows = (_median_layer([p.layers[i] for p in profiles]) for i in range(profiles[0].n_layers))
    return replace(profiles[0], layers=tuple(rows),
                   optimizer_seconds_per_byte=statistics.median(
                       p.optimizer_seconds_per_byte for p in profiles),
                   optimizer_fixed_seconds=statistics.median(
                       p.optimizer_fixed_seconds for p in profiles),
                   optimizer_state_ratio=statistics.median(
                       p.optimizer_state_ratio for p in profiles),
                   data_seconds=statistics.median(p.data_seconds for p in profiles),
                   weight_copy_seconds_per_byte=statistics.median(
                       p.weight_copy_seconds_per_byte for p in profiles))


def _median_layer(rows: list[LayerProfile]) -> LayerProfile:
    def median(get: Callable[[LayerProfile], float]) -> float:
        return statistics.median(get(r) for r in rows)

    return replace(rows[0], forward_seconds=median(lambda r: r.forward_seconds),
                   backward_seconds=median(lambda r: r.backward_seconds),
                   forward_fixed_seconds=median(lambda r: r.forward_fixed_seconds),
                   backward_fixed_seconds=median(lambda r: r.backward_fixed_seconds),
                   weight_grad_seconds=median(lambda r: r.weight_grad_seconds))


def _check_same(first: Profile, other: Profile, k: int) -> None:
    """Refuses profile `k` unless it has the same size, layers and bytes as profile 0."""
    if (other.microbatch_size, other.n_layers) != (first.microbatch_size, first.n_layers):
        raise ConfigError(f"profile {k} has {other.n_layers} layers at micro-batch size "
                          f"{other.microbatch_size}, profile 0 {first.n_layers} at "
                          f"{first.microbatch_size}")
    for i, (a, b) in enumerate(zip(first.layers, other.layers, strict=True)):
        for f in _BYTES:
            if getattr(a, f) != getattr(b, f):
                raise ConfigError(f"profile {k} has {f} {getattr(b, f)} for layer {i}, "
                                  f"profile 0 {getattr(a, f)}")


def relative_speeds(profiles: Sequence[Profile]) -> list[float]:
    """Each profile's speed: the median total layer time (forward + backward) over its own.

    Raises:
        ConfigError: no profiles, or a profile whose layers took no time.
    """
    totals = [p.forward_seconds(range(p.n_layers)) + p.backward_seconds(range(p.n_layers))
              for p in profiles]
    if not totals:
        raise ConfigError("relative_speeds needs at least one profile")
    if min(totals) <= 0:
        raise ConfigError(f"profile {totals.index(min(totals))} has no timed layer")
    middle = statistics.median(totals)
    return [middle / t for t in totals]
