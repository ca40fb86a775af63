"""Step times at the end of fit: the whole step and the plan's work inside it."""

from __future__ import annotations

import pytest

from lightning_deeppool.session import step_times
from lightning_deeppool.session.step_times import StepTimes, summary

pytestmark = pytest.mark.floors


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """A clock the test advances: `clock[0]` seconds."""
    now = [0.0]
    monkeypatch.setattr(step_times.time, "perf_counter", lambda: now[0])
    return now


def test_work_regions_add_up_within_a_step_and_nested_ones_count_once(clock):
    times = StepTimes()
    times.mark()
    with times.work():  # a planned forward
        clock[0] += 2.0
    clock[0] += 1.0  # the loss
    with times.work(), times.work():  # backward, with a region inside it
        clock[0] += 3.0
    clock[0] += 0.5  # hooks, the next batch
    times.mark()
    assert times.seconds == [6.5]
    assert times.work_seconds == [5.0]


def test_the_closure_inside_an_optimizer_step_is_not_work_but_its_planned_calls_are(clock):
    times = StepTimes()
    times.mark()
    with times.work():  # optimizer_step
        with times.outside_work():  # the closure: training_step and backward
            clock[0] += 1.0  # the user's code
            with times.work():  # a planned forward
                clock[0] += 2.0
        clock[0] += 0.25  # the update
    times.mark()
    assert times.seconds == [3.25]
    assert times.work_seconds == [2.25]


def test_a_backward_is_work_from_the_planned_outputs_gradients_on_not_the_losss_before(clock):
    times = StepTimes()
    times.mark()
    with times.backward():
        clock[0] += 4.0  # the loss's backward (a 32k-token cross-entropy, say)
        times.outputs_reached()
        clock[0] += 3.0  # the planned layers' backward
        times.outputs_reached()  # a second output's gradient: the backward is already the plan's
        clock[0] += 1.0
    times.mark()
    assert times.seconds == [8.0]
    assert times.work_seconds == [4.0]


def test_a_backward_whose_gradients_never_reach_the_planned_outputs_is_work_throughout(clock):
    times = StepTimes()
    times.mark()
    with times.backward():
        clock[0] += 2.0
    times.outputs_reached()  # after the backward: nothing to skip
    times.mark()
    assert times.work_seconds == [2.0]


def test_the_summary_shows_the_plans_work_against_the_prediction_and_the_rest():
    line = summary(measured_s=0.030, work_s=0.022, predicted_s=0.020, steps=20)
    assert "measured median step time 30.000 ms over 17 steps" in line
    assert "took 22.000 ms, predicted 20.000 ms (measured / predicted 1.10)" in line
    assert "the other 8.000 ms" in line
