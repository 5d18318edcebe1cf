"""Tests for pipefb.schedule validation and dry run: each refusal marks the cell at fault."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipefb.errors import ScheduleError
from pipefb.schedule import (
    Action,
    Kind,
    Schedule,
    Topology,
    dry_run,
    format_grid,
    format_table,
    generate,
    lower,
    validate,
)

TWO = Topology.combined((0, 1, 2))
SPLIT = Topology((0, 2, 4), (0, 1, 4), (0, 1), (2, 3))


def lowered(kind: str, topology: Topology, mbs: int = 4) -> Schedule:
    return lower(generate(kind, topology, mbs), topology)


def swap(schedule: Schedule, worker: int, a: str, b: str) -> Schedule:
    out = {w: list(xs) for w, xs in schedule.items()}
    row = out[worker]
    i, j = row.index(Action.parse(a)), row.index(Action.parse(b))
    row[i], row[j] = row[j], row[i]
    return out


def refusal(schedule: Schedule, topology: Topology, mbs: int = 4) -> ScheduleError:
    with pytest.raises(ScheduleError) as err:
        validate(schedule, topology, mbs)
    assert isinstance(err.value, ValueError)
    return err.value


def test_swapped_receives_deadlock_with_grid():
    bad = swap(lowered("1f1b", TWO), 1, "1RECV_F0", "1RECV_F2")
    err = refusal(bad, TWO)
    assert "deadlock" in str(err)
    # worker 1 waits for micro-batch 2, which worker 0 sends only after its first backward.
    assert ">1RECV_F2<" in err.grid and ">0RECV_B0<" in err.grid
    assert "0SEND_F2 (worker 0)" in str(err) and "1SEND_B0 (worker 1)" in str(err)
    assert err.grid in str(err)


def test_backward_before_forward_on_combined_worker():
    bad = swap(lowered("gpipe", TWO), 1, "1F0", "1B0")
    err = refusal(bad, TWO)
    assert "1B0 before its forward" in str(err)
    assert ">1B0<" in err.grid


def test_missing_receive():
    good = lowered("1f1b", TWO)
    bad = {w: [a for a in xs if str(a) != "1RECV_F2"] for w, xs in good.items()}
    err = refusal(bad, TWO)
    assert "1RECV_F2" in str(err)
    assert ">1F2<" in err.grid


def test_unmatched_send():
    good = lowered("gpipe", TWO)
    bad = {**good, 0: [*good[0], Action(0, Kind.SEND_B, 3)]}
    err = refusal(bad, TWO)
    assert "stage 0 has no peer" in str(err) and ">0SEND_B3<" in err.grid


def test_duplicated_forward():
    good = lowered("gpipe", TWO)
    bad = {**good, 0: [Action(0, Kind.F, 1), *good[0]]}
    err = refusal(bad, TWO)
    assert "0F1 appears twice" in str(err)
    assert err.grid.count(">0F1<") == 2


def test_missing_forward():
    good = lowered("gpipe", TWO)
    bad = {**good, 0: [a for a in good[0] if str(a) not in ("0F3", "0SEND_F3")]}
    assert "0F3 is missing" in str(refusal(bad, TWO))


def test_opt_before_last_backward():
    bad = swap(lowered("gpipe", TWO), 0, "0OPT", "0B3")
    err = refusal(bad, TWO)
    assert "0OPT before 0B3" in str(err) and ">0OPT<" in err.grid


def test_action_on_wrong_worker():
    good = lowered("gpipe", TWO)
    bad = {0: good[0], 1: [*good[1], Action(0, Kind.F, 9)]}
    err = refusal(bad, TWO)
    assert "must run on worker 0" in str(err) and ">0F9<" in err.grid


def test_compute_only_schedule_is_not_runnable():
    err = refusal(generate("gpipe", TWO, 4), TWO)
    assert "0B0 needs 0RECV_B0, which is not in the schedule" in str(err)


def test_pipefb_missing_weight_push_is_refused():
    good = lowered("pipefb", SPLIT)
    bad = {**good, 2: [a for a in good[2] if a.kind is not Kind.PUSH_W]}
    err = refusal(bad, SPLIT)
    assert "0RECV_W needs 0PUSH_W" in str(err) and ">0RECV_W<" in err.grid


def test_pipefb_fetch_before_hand_off_is_valid_but_blocks_on_stash():
    """FETCH waits for the STASH of every overlapping forward stage, not for RECV_L.

    Moving FETCH before RECV_L is valid: the fetch blocks until the stash exists, and the
    dry run reports no false deadlock.
    """
    bad = lowered("pipefb", SPLIT)
    for m in range(4):
        bad = swap(bad, 3, f"1RECV_L{m}", f"1FETCH{m}")
    validate(bad, SPLIT, 4)
    trace = dry_run(bad, SPLIT, steps=1)
    tick = {str(a): t for _, t, a in trace}
    for m in range(4):
        # backward stage 1 = layers [1, 4) overlaps forward stages 0 and 1.
        assert tick[f"1FETCH{m}"] > max(tick[f"0STASH{m}"], tick[f"1STASH{m}"])
        assert tick[f"1FETCH{m}"] < tick[f"1RECV_L{m}"] < tick[f"1B{m}"]


def test_pipefb_next_step_waits_for_pushed_weights():
    trace = dry_run(lowered("pipefb", SPLIT), SPLIT, steps=2)
    ticks: dict[str, list[int]] = {}
    for _, t, a in trace:
        ticks.setdefault(str(a), []).append(t)
    # forward stage 0 (layers [0, 2)) needs the weights of backward stages 0 and 1.
    assert ticks["0RECV_W"][1] > max(ticks["0PUSH_W"][0], ticks["1PUSH_W"][0])
    assert ticks["1RECV_W"][1] > ticks["1PUSH_W"][0]
    assert ticks["0RECV_W"][0] == 0


def test_dry_run_rejects_zero_steps():
    with pytest.raises(ScheduleError, match="got 0"):
        dry_run(lowered("gpipe", TWO), TWO, steps=0)


def test_format_grid_marks_cells_and_format_table():
    schedule = {0: [Action.parse(s) for s in ["0F0", "0B0", "0OPT"]]}
    grid = format_grid(schedule, {(0, 1)})
    assert grid.splitlines()[-1].split() == ["w0", "|", "0F0", ">0B0<", "0OPT"]
    assert format_table(schedule).splitlines()[-1] == "| 0 | 0F0 0B0 0OPT |"
    trace_grid = format_grid(dry_run(lowered("gpipe", TWO, 1), TWO, steps=1))
    assert trace_grid.splitlines()[2].split()[:4] == ["w0", "|", "0F0", "0SEND_F0"]


# --- random topologies ----------------------------------------------------------------


def partition(draw, n_layers: int, n_stages: int) -> tuple[int, ...]:
    inner = draw(
        st.lists(
            st.integers(1, n_layers - 1), min_size=n_stages - 1, max_size=n_stages - 1, unique=True
        )
    )
    return (0, *sorted(inner), n_layers)


@st.composite
def scenarios(draw) -> tuple[str, Topology, int]:
    kind = draw(st.sampled_from(["gpipe", "1f1b", "pipefb"]))
    mbs = draw(st.integers(1, 8))
    n_layers = draw(st.integers(6, 12))
    n_f = draw(st.integers(1, 6))
    if kind != "pipefb":
        ids = tuple(draw(st.permutations(range(n_f))))
        return kind, Topology.combined(partition(draw, n_layers, n_f), ids), mbs
    n_b = draw(st.integers(1, 6))
    ids = tuple(draw(st.permutations(range(n_f + n_b))))
    fwd, bwd = partition(draw, n_layers, n_f), partition(draw, n_layers, n_b)
    return kind, Topology(fwd, bwd, ids[:n_f], ids[n_f:]), mbs


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_random_topologies_lower_and_validate(scenario):
    kind, topology, mbs = scenario
    schedule = lower(generate(kind, topology, mbs), topology)
    validate(schedule, topology, mbs)
    assert len(dry_run(schedule, topology, steps=3)) == 3 * sum(map(len, schedule.values()))
