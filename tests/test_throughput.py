"""The moving median of step times (pipefb.runtime.throughput): bursts of replies and one
stall do not move the samples/s and time left that progress shows."""

from __future__ import annotations

import pytest

from pipefb.runtime.throughput import SPAN, WINDOW, StepRate


def test_bursts_and_a_stall_leave_the_median_at_the_steady_rate() -> None:
    # replies of a steady 0.1 s/step pipeline arriving in pairs (0.001 s, then 0.199 s),
    # and one stall of 5 s (an evaluation) among them
    times = [0.001, 0.199] * 10 + [5.0] + [0.001, 0.199] * 5
    rate = StepRate(batch_size=16, steps=times)
    assert rate.step_seconds() == pytest.approx(0.1)
    assert rate.samples_per_second() == pytest.approx(160.0)
    assert rate.seconds_left(30) == pytest.approx(3.0)
    # one step's figure would have said 16 / 0.199 or 16 / 0.001 samples/s
    assert StepRate(16, [0.001]).samples_per_second() == pytest.approx(16_000.0)


def test_the_median_forgets_steps_beyond_its_window() -> None:
    rate = StepRate(batch_size=8, steps=[1.0] * 50)
    for _ in range(WINDOW + SPAN - 1):
        rate.add(0.5)
    assert rate.step_seconds() == pytest.approx(0.5)
    assert StepRate(8).samples_per_second() == 0.0 and StepRate(8).seconds_left(3) == 0.0


def test_progress_says_when_a_step_was_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    from pipefb.app.train import StepProgress

    StepProgress(None, None).update(
        {"step": 2, "loss": 1.25, "samples_per_second": 5.0, "samples_per_second_median": 80.0,
         "seconds_left": 59.6, "lr": 0.01, "grad_norm": float("inf"), "skipped": True}, 4)
    assert capsys.readouterr().err == (
        "step 3/4 loss 1.2500 80.0 samples/s, 0:01:00 left, lr 0.01, grad norm inf\n"
        "step 3: gradient norm inf is not finite: no weights were updated\n")
