"""The online re-planner's decisions ([Note: online re-planning] in pipefb/replan.py) on
simulated step measurements: a slowed worker gets a move, noise and costly moves do not."""

from __future__ import annotations

import random

import pytest

from pipefb.migration import holders
from pipefb.plan import Plan, balanced_plan
from pipefb.replan import Replanner, ReplanSettings

FORWARD = [3.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0]  # per layer, loss last
BACKWARD = [2 * c for c in FORWARD]
SIZES = {i: (4000 * int(c), 8000 * int(c)) for i, c in enumerate(FORWARD)}


def plan_of(schedule: str) -> Plan:
    return balanced_plan(schedule, 4, FORWARD, 8, 4, ("offload" if schedule == "pipefb"
                                                      else "keep",) * len(FORWARD))


def step_seconds(replanner: Replanner, plan: Plan, speeds: dict[int, float],
                 noise: float, rng: random.Random) -> dict[int, float]:
    """One step's compute seconds by rank: the plan's cost over the rank's true speed,
    times uniform noise of +-`noise`."""
    return {rank: cost / speeds.get(rank, 1.0) * (1 + rng.uniform(-noise, noise))
            for rank, cost in replanner.predicted(plan).items()}


def run(schedule: str, steps: int, slow: dict[int, float], at: int, noise: float,
        seed: int, settings: ReplanSettings | None = None) -> list[tuple[int, Plan]]:
    """Steps a replanner through simulated measurements; moves happen when it decides."""
    plan, rng = plan_of(schedule), random.Random(seed)
    replanner = Replanner(plan, FORWARD, BACKWARD, SIZES, settings)
    moves = []
    for step in range(steps):
        speeds = slow if step >= at else {}
        decision = replanner.observe(step_seconds(replanner, plan, speeds, noise, rng))
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
