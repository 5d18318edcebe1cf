"""Tests for pipefb.schedule: literal tables, golden files, round trips, validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipefb.errors import ScheduleError
from pipefb.schedule import (
    Action,
    Kind,
    Schedule,
    Topology,
    generate,
    lower,
    pipefb,
    validate,
)
from pipefb.schedule.golden import CASES, REGENERATE, render
from pipefb.schedule.ir import STAGE_KINDS

GOLDEN = Path(__file__).parent / "golden"
TWO = Topology.combined((0, 1, 2))
FOUR = Topology.combined((0, 1, 2, 3, 4))
SPLIT = Topology((0, 2, 4), (0, 1, 4), (0, 1), (2, 3))


def table(schedule: Schedule) -> dict[int, list[str]]:
    return {w: [str(a) for a in actions] for w, actions in schedule.items()}


def literal(rows: dict[int, str]) -> dict[int, list[str]]:
    return {w: row.split() for w, row in rows.items()}


def parse(rows: dict[int, str]) -> Schedule:
    return {w: [Action.parse(s) for s in row.split()] for w, row in rows.items()}


# --- literal tables -------------------------------------------------------------------

GPIPE_2 = {
    0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT",
    1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3 1OPT",
}
GPIPE_2_LOWERED = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 "
    "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3 0OPT",
    1: "1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2 1RECV_F3 1F3 "
    "1B0 1SEND_B0 1B1 1SEND_B1 1B2 1SEND_B2 1B3 1SEND_B3 1OPT",
}
GPIPE_4 = {
    s: " ".join([f"{s}F{m}" for m in range(4)] + [f"{s}B{m}" for m in range(4)]) + f" {s}OPT"
    for s in range(4)
}
GPIPE_4_LOWERED = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 "
    "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3 0OPT",
    1: "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_F2 1F2 1SEND_F2 1RECV_F3 1F3 1SEND_F3 "
    "1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1 1RECV_B2 1B2 1SEND_B2 1RECV_B3 1B3 1SEND_B3 "
    "1OPT",
    2: "2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_F2 2F2 2SEND_F2 2RECV_F3 2F3 2SEND_F3 "
    "2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 2RECV_B2 2B2 2SEND_B2 2RECV_B3 2B3 2SEND_B3 "
    "2OPT",
    3: "3RECV_F0 3F0 3RECV_F1 3F1 3RECV_F2 3F2 3RECV_F3 3F3 "
    "3B0 3SEND_B0 3B1 3SEND_B1 3B2 3SEND_B2 3B3 3SEND_B3 3OPT",
}
ONE_F_ONE_B_2 = {
    0: "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0OPT",
    1: "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT",
}
ONE_F_ONE_B_2_LOWERED = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 "
    "0RECV_B2 0B2 0RECV_B3 0B3 0OPT",
    1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 "
    "1RECV_F3 1F3 1B3 1SEND_B3 1OPT",
}
ONE_F_ONE_B_4 = {
    0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT",
    1: "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3 1OPT",
    2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3 2OPT",
    3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3OPT",
}
ONE_F_ONE_B_4_LOWERED = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 "
    "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3 0OPT",
    1: "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_F2 1F2 1SEND_F2 1RECV_B0 1B0 1SEND_B0 "
    "1RECV_F3 1F3 1SEND_F3 1RECV_B1 1B1 1SEND_B1 1RECV_B2 1B2 1SEND_B2 1RECV_B3 1B3 1SEND_B3 "
    "1OPT",
    2: "2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_B0 2B0 2SEND_B0 2RECV_F2 2F2 2SEND_F2 "
    "2RECV_B1 2B1 2SEND_B1 2RECV_F3 2F3 2SEND_F3 2RECV_B2 2B2 2SEND_B2 2RECV_B3 2B3 2SEND_B3 "
    "2OPT",
    3: "3RECV_F0 3F0 3B0 3SEND_B0 3RECV_F1 3F1 3B1 3SEND_B1 3RECV_F2 3F2 3B2 3SEND_B2 "
    "3RECV_F3 3F3 3B3 3SEND_B3 3OPT",
}
ONE_F_ONE_B_4X8 = {
    0: "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7 0OPT",
    1: "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7 1OPT",
    2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7 2OPT",
    3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 3OPT",
}
# Forward layers [0,2) [2,4) on workers 0, 1; backward layers [0,1) [1,4) on workers 2, 3.
PIPEFB_LOWERED = {
    0: "0RECV_W 0F0 0STASH0 0SEND_F0 0F1 0STASH1 0SEND_F1 "
    "0F2 0STASH2 0SEND_F2 0F3 0STASH3 0SEND_F3",
    1: "1RECV_W 1RECV_F0 1F0 1STASH0 1SEND_L0 1RECV_F1 1F1 1STASH1 1SEND_L1 "
    "1RECV_F2 1F2 1STASH2 1SEND_L2 1RECV_F3 1F3 1STASH3 1SEND_L3",
    2: "0RECV_B0 0FETCH0 0B0 0RECV_B1 0FETCH1 0B1 0RECV_B2 0FETCH2 0B2 "
    "0RECV_B3 0FETCH3 0B3 0OPT 0PUSH_W",
    3: "1RECV_L0 1FETCH0 1B0 1SEND_B0 1RECV_L1 1FETCH1 1B1 1SEND_B1 "
    "1RECV_L2 1FETCH2 1B2 1SEND_B2 1RECV_L3 1FETCH3 1B3 1SEND_B3 1OPT 1PUSH_W",
}

TABLES = [
    ("gpipe", TWO, 4, GPIPE_2, GPIPE_2_LOWERED),
    ("gpipe", FOUR, 4, GPIPE_4, GPIPE_4_LOWERED),
    ("1f1b", TWO, 4, ONE_F_ONE_B_2, ONE_F_ONE_B_2_LOWERED),
    ("1f1b", FOUR, 4, ONE_F_ONE_B_4, ONE_F_ONE_B_4_LOWERED),
]


@pytest.mark.parametrize(("kind", "topology", "mbs", "compute", "lowered"), TABLES)
def test_literal_tables(kind, topology, mbs, compute, lowered):
    schedule = generate(kind, topology, mbs)
    assert table(schedule) == literal(compute)
    assert table(lower(schedule, topology)) == literal(lowered)
    validate(lower(schedule, topology), topology, mbs)


def test_one_f_one_b_four_stages_eight_microbatches():
    assert table(generate("1f1b", FOUR, 8)) == literal(ONE_F_ONE_B_4X8)


def test_pipefb_lowered_table_with_different_partitions():
    compute = pipefb(SPLIT, 4)
    assert table(compute) == {
        0: ["0F0", "0F1", "0F2", "0F3"],
        1: ["1F0", "1F1", "1F2", "1F3"],
        2: ["0B0", "0B1", "0B2", "0B3", "0OPT"],
        3: ["1B0", "1B1", "1B2", "1B3", "1OPT"],
    }
    lowered = lower(compute, SPLIT)
    assert table(lowered) == literal(PIPEFB_LOWERED)
    validate(lowered, SPLIT, 4)


def test_lower_is_pure():
    compute = generate("1f1b", TWO, 4)
    before = table(compute)
    lower(compute, TWO)
    assert table(compute) == before


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_files(name):
    expected = (GOLDEN / f"{name}.txt").read_text()
    assert render(name) == expected, f"golden {name} differs; regenerate: {REGENERATE}"


# --- IR -------------------------------------------------------------------------------


@st.composite
def actions(draw) -> Action:
    kind = draw(st.sampled_from(list(Kind)))
    mb = None if kind in STAGE_KINDS else draw(st.integers(0, 10_000))
    return Action(draw(st.integers(0, 10_000)), kind, mb)


@given(actions())
def test_str_parse_round_trip(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action(1, Kind.F, 0), "1F0"),
        (Action(0, Kind.SEND_F, 1), "0SEND_F1"),
        (Action(2, Kind.OPT), "2OPT"),
        (Action(1, Kind.PUSH_W), "1PUSH_W"),
        (Action(0, Kind.RECV_W), "0RECV_W"),
        (Action(12, Kind.FETCH, 34), "12FETCH34"),
    ],
)
def test_str_examples(action, text):
    assert str(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "1OPT0", "01F0", "1F01", "1F-1", "1f0"])
def test_parse_rejects_and_names_string(bad):
    with pytest.raises(ScheduleError, match=re.escape(repr(bad))) as err:
        Action.parse(bad)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (((1, 2), (0, 2), (0,), (1,)), "forward_partition"),
        (((0, 2, 2), (0, 2), (0, 1), (2,)), "strictly increasing"),
        (((0, 2), (0, 3), (0,), (1,)), "different layers"),
        (((0, 1, 2), (0, 2), (0,), (1,)), "forward_workers"),
        (((0, 1, 2), (0, 1, 2), (0, 0), (1, 2)), "distinct"),
        (((0, 1, 2), (0, 2), (0, 1), (1,)), "neither combined nor split"),
    ],
)
def test_topology_rejects(args, needle):
    with pytest.raises(ScheduleError, match=needle):
        Topology(*args)


def test_topology_helpers():
    assert SPLIT.is_split and not SPLIT.is_combined
    assert TWO.is_combined and not TWO.is_split
    assert SPLIT.layers_of_forward(1) == range(2, 4)
    assert SPLIT.layers_of_backward(1) == range(1, 4)
    assert SPLIT.forward_stages_overlapping(0) == (0,)
    assert SPLIT.forward_stages_overlapping(1) == (0, 1)
    assert SPLIT.backward_stages_overlapping(0) == (0, 1)
    assert SPLIT.backward_stages_overlapping(1) == (1,)
    assert SPLIT.workers() == (0, 1, 2, 3)


# --- generators -----------------------------------------------------------------------


def test_generate_rejects():
    with pytest.raises(ScheduleError, match="'zigzag'"):
        generate("zigzag", TWO, 4)
    with pytest.raises(ScheduleError, match="combined"):
        generate("1f1b", SPLIT, 4)
    with pytest.raises(ScheduleError, match="split"):
        generate("pipefb", TWO, 4)
    with pytest.raises(ScheduleError, match="micro-batch"):
        generate("gpipe", TWO, 0)
