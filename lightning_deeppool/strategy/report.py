"""Whether the plan delivered: measured step times against the plan's prediction, at the end of fit."""

from __future__ import annotations

import statistics
import time

# Steps right after the plan is installed still pay for capture, profiling and first-call checks.
SETTLING_STEPS = 3


class StepTimes:
    """Wall time between consecutive training batch starts (everything a step costs)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._last: float | None = None

    def mark(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = now

    def restart(self) -> None:
        """Forget what came before (the plan was just installed)."""
        self.seconds.clear()
        self._last = None

    def median_s(self) -> float | None:
        settled = self.seconds[SETTLING_STEPS:]
        return statistics.median(settled) if settled else None


def summary(measured_s: float | None, predicted_s: float, steps: int) -> str:
    """One line for the end of fit."""
    if measured_s is None:
        return (
            f"deeppool: too few steps after planning ({steps}) to measure the step time; the plan "
            f"predicted {predicted_s * 1e3:.3f} ms"
        )
    return (
        f"deeppool: measured median step time {measured_s * 1e3:.3f} ms over {steps - SETTLING_STEPS} steps, "
        f"predicted {predicted_s * 1e3:.3f} ms (measured / predicted {measured_s / predicted_s:.2f}; the "
        "prediction leaves out training_step's own work outside the model, such as the loss)"
    )
