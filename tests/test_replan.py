"""The online re-planner's decisions ([Note: online re-planning] in pipefb/planner/replan.py) on
simulated step measurements: a slowed worker gets a move, noise and costly moves do not."""

from __future__ import annotations

import random

import pytest

from pipefb.plan.migration import holders
from pipefb.plan.partition import balanced_plan
from pipefb.plan.plan import Plan
from pipefb.planner.replan import Replanner, ReplanSettings

FORWARD = [3.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0]  # per layer, loss last
BACKWARD = [2 * c for c in FORWARD]
SIZES = {i: (4000 * int(c), 8000 * int(c)) for i, c in enumerate(FORWARD)}


def plan_of(schedule: str, workers: int = 4) -> Plan:
    return balanced_plan(schedule, workers, FORWARD, 8, 4, ("offload" if schedule == "pipefb"
                                                            else "keep",) * len(FORWARD))


Measured = tuple[dict[int, float], dict[int, dict[int, float]]]


def step_seconds(replanner: Replanner, plan: Plan, speeds: dict[int, float],
                 noise: float, rng: random.Random,
                 layer_factors: dict[int, float] | None = None) -> Measured:
    """One step's compute seconds by rank, and by rank and layer: each layer's cost
    (times its factor) over the rank's true speed, times uniform noise of +-`noise`."""
    factors = layer_factors or {}
    layers = {rank: {layer: replanner.prior((kind, layer)) * factors.get(layer, 1.0)
                     / speeds.get(rank, 1.0) * (1 + rng.uniform(-noise, noise))
                     for kind, layer in its}
              for rank, its in replanner.items(plan).items()}
    return {rank: sum(times.values()) for rank, times in layers.items()}, layers


def true_bottleneck(replanner: Replanner, plan: Plan, speeds: dict[int, float],
                    factors: dict[int, float]) -> float:
    """The slowest rank's seconds per step under the true speeds and layer factors."""
    compute, _ = step_seconds(replanner, plan, speeds, 0.0, random.Random(0), factors)
    return max(compute.values())


def run(schedule: str, steps: int, slow: dict[int, float], at: int, noise: float,
        seed: int, settings: ReplanSettings | None = None,
        slow_layers: dict[int, float] | None = None, workers: int = 4
        ) -> list[tuple[int, Plan]]:
    """Steps a replanner through simulated measurements (per rank and per layer); moves
    happen when it decides."""
    plan, rng = plan_of(schedule, workers), random.Random(seed)
    replanner = Replanner(plan, FORWARD, BACKWARD, SIZES, settings)
    moves = []
    for step in range(steps):
        speeds, factors = (slow, slow_layers) if step >= at else ({}, {})
        compute, layers = step_seconds(replanner, plan, speeds, noise, rng, factors)
        decision = replanner.observe(compute, layers=layers)
        if decision is not None:
            assert decision.new_seconds < decision.current_seconds
            plan = decision.plan
            replanner.reset(plan)
            moves.append((step, plan))
    return moves


@pytest.mark.parametrize("schedule", ["pipefb", "1f1b"])
def test_a_worker_slowed_2x_gets_layers_moved_off_it_within_20_steps(schedule: str) -> None:
    slowed = 3 if schedule == "pipefb" else 2  # a backward rank; the busiest combined one
    moves = run(schedule, 60, {slowed: 0.5}, at=20, noise=0.05, seed=0)
    assert moves, "no move"
    step, plan = moves[0]
    assert 20 < step <= 40
    before, after = plan_of(schedule), plan
    owned = [sum(1 for (_, _), r in holders(p)[1].items() if r == slowed)
             for p in (before, after)]
    assert owned[1] < owned[0]  # the slowed rank holds fewer layers
    assert len(moves) <= 2  # and then it settles


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("schedule", ["pipefb", "1f1b"])
def test_ten_percent_noise_moves_nothing_in_100_steps(schedule: str, seed: int) -> None:
    assert run(schedule, 100, {}, at=0, noise=0.10, seed=seed) == []


def test_a_move_that_costs_more_than_it_saves_is_not_made() -> None:
    slow_link = ReplanSettings(bandwidth=1.0)  # a byte per second: the move never pays
    assert run("pipefb", 60, {3: 0.5}, at=20, noise=0.0, seed=0, settings=slow_link) == []


@pytest.mark.parametrize(("schedule", "workers", "layer"),
                         [("pipefb", 6, 3), ("pipefb", 4, 5), ("1f1b", 4, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_layer_that_got_4x_costlier_is_isolated_without_churn(
        schedule: str, workers: int, layer: int, seed: int) -> None:
    """A layer costs 4x from step 20 wherever it runs (a grown input): the re-planner
    moves within 20 steps to a partition whose true bottleneck is lower, and no layer
    goes back and forth: its cost travels with it in the model, so a move does not make
    it look cheap. A layer alone on its rank reads as a slow rank until a move shows
    otherwise: then one more move (1F1B, layer 3)."""
    factors = {layer: 4.0}
    moves = run(schedule, 120, {}, at=20, noise=0.05, seed=seed, slow_layers=factors,
                workers=workers)
    assert 1 <= len(moves) <= 2 and 20 < moves[0][0] <= 40, [
        (s, p.forward_partition, p.backward_partition) for s, p in moves]
    first = plan_of(schedule, workers)
    replanner = Replanner(first, FORWARD, BACKWARD, SIZES)
    before = true_bottleneck(replanner, first, {}, factors)
    assert true_bottleneck(replanner, moves[-1][1], {}, factors) < 0.9 * before
