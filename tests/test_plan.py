"""The partitioner: exact against brute force on random costs, and fast at scale."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefb.errors import ConfigError
from pipefb.plan.partition import partition


def bottleneck(costs: Sequence[float], bounds: Sequence[int]) -> float:
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def brute_force(costs: Sequence[float], stages: int) -> float:
    n = len(costs)
    return min(bottleneck(costs, (0, *cut, n))
               for cut in itertools.combinations(range(1, n), stages - 1))


@st.composite
def problems(draw: st.DrawFn, values: st.SearchStrategy[float]) -> tuple[list[float], int]:
    costs = draw(st.lists(values, min_size=1, max_size=10))
    return costs, draw(st.integers(1, len(costs)))


@settings(max_examples=300, deadline=None)
@given(problems(st.integers(0, 50).map(float)))
def test_bottleneck_equals_brute_force_on_integer_costs(problem: tuple[list[float], int]) -> None:
    costs, stages = problem
    bounds = partition(costs, stages)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == stages + 1
    assert all(a < b for a, b in itertools.pairwise(bounds))  # every stage has a layer
    assert bottleneck(costs, bounds) == brute_force(costs, stages)


@settings(max_examples=300, deadline=None)
@given(problems(st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)))
def test_bottleneck_equals_brute_force_on_float_costs(problem: tuple[list[float], int]) -> None:
    costs, stages = problem
    assert bottleneck(costs, partition(costs, stages)) == pytest.approx(
        brute_force(costs, stages), rel=1e-9, abs=1e-9)


def test_uneven_costs_get_an_uneven_split() -> None:
    costs = [50.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 50.0]  # a big embedding and head
    bounds = partition(costs, 4)
    assert bounds[1] == 1 and bounds[-2] == 7  # each gets a stage of its own
    assert bottleneck(costs, bounds) == 50.0


def greedy_optimum(costs: Sequence[int], stages: int) -> int:
    """The optimal bottleneck of integer costs by binary search on the answer: an independent
    method (a limit is feasible when greedy packing needs at most `stages` ranges)."""
    def ranges(limit: int) -> int:
        count, run = 1, 0
        for c in costs:
            if run + c > limit:
                count, run = count + 1, 0
            run += c
        return count

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ranges(mid) <= stages else (mid + 1, hi)
    return lo


def test_two_hundred_layers_on_sixty_four_stages() -> None:
    """The planner's scale (issue 4): exact there too. Its time is in the closing note."""
    costs = [(i * 7919) % 101 + 1 for i in range(200)]
    bounds = partition([float(c) for c in costs], 64)
    assert len(bounds) == 65
    assert bottleneck(costs, bounds) == greedy_optimum(costs, 64)


@pytest.mark.parametrize(("costs", "stages", "named"), [
    ([1.0, 2.0], 3, "3 stages"), ([1.0], 0, "0 stages"), ([1.0, -1.0], 1, ">= 0")])
def test_impossible_splits_are_refused(costs: list[float], stages: int, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        partition(costs, stages)
