"""Whether the plan delivered: measured step times against the plan's prediction, at the end of fit.

A step's wall time holds the plan's own work (the planned forward calls, backward passes from the
planned outputs' gradients on with their gradient synchronization, optimizer updates: what the
prediction covers) and the training loop's (loading data, the loss and its backward, hooks), which no
plan changes. Both are measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Steps right after the plan is installed still pay for capture, profiling and first-call checks.
SETTLING_STEPS = 3


class StepTimes:
    """Per step: the wall time between consecutive training batch starts, and the part of it spent
    in the plan's work (the `work` regions)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.work_seconds: list[float] = []
        self._last: float | None = None
        self._work = 0.0
        self._depth = 0
        self._start = 0.0  # of the outermost open work region
        self._before_outputs = False  # a backward that has not reached the planned outputs yet

    def mark(self) -> None:
        """A training batch starts: the previous step is complete."""
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
            self.work_seconds.append(self._work)
        self._last = now
        self._work = 0.0

    @contextmanager
    def work(self) -> Iterator[None]:
        """Time inside counts as the plan's work (nested regions count once)."""
        self._depth += 1
        if self._depth == 1:
            self._start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._work += time.perf_counter() - self._start

    @contextmanager
    def backward(self) -> Iterator[None]:
        """A backward pass: the plan's work once the planned outputs' gradients arrive
        (`outputs_reached`); autograd runs the loss's backward before that."""
        self._before_outputs = True
        try:
            with self.work():
                yield
        finally:
            self._before_outputs = False

    def outputs_reached(self) -> None:
        """The planned outputs' gradients arrived: the backward so far was the loss's, not work."""
        if self._before_outputs and self._depth == 1:
            self._before_outputs = False
            self._start = time.perf_counter()

    @contextmanager
    def outside_work(self) -> Iterator[None]:
        """Time inside a `work` region that is not the plan's (the user's training_step in a closure)."""
        depth, self._depth, outer = self._depth, 0, self._start
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth, self._start = depth, outer
            if depth:
                self._work -= time.perf_counter() - start

    def restart(self) -> None:
        """Forget what came before (the plan was just installed)."""
        self.seconds.clear()
        self.work_seconds.clear()
        self._last = None
        self._work = 0.0

    def median_s(self) -> float | None:
        settled = self.seconds[SETTLING_STEPS:]
        return statistics.median(settled) if settled else None

    def median_work_s(self) -> float | None:
        settled = self.work_seconds[SETTLING_STEPS:]
        return statistics.median(settled) if settled else None


def summary(measured_s: float | None, work_s: float | None, predicted_s: float, steps: int) -> str:
    """One line for the end of fit."""
    if measured_s is None or work_s is None:
        return (
            f"deeppool: too few steps after planning ({steps}) to measure the step time; the plan "
            f"predicted {predicted_s * 1e3:.3f} ms"
        )
    return (
        f"deeppool: measured median step time {measured_s * 1e3:.3f} ms over {steps - SETTLING_STEPS} steps; "
        f"the plan's work (planned forward calls, their backward and gradient synchronization, optimizer "
        f"update) took {work_s * 1e3:.3f} ms, predicted {predicted_s * 1e3:.3f} ms (measured / predicted "
        f"{work_s / predicted_s:.2f}); the training loop's own work (data, the loss and its backward, "
        f"hooks) took the other "
        f"{(measured_s - work_s) * 1e3:.3f} ms"
    )
