"""`Pacing`: the throttle's loop over foreground steps. It times each step (from one batch start to
the next: all a step costs, the wait before the next one included), sorts the times into steps with
the jobs held (the baseline) and with them running, and decides per step whether the jobs run and
at what duty. Pure apart from the times and the jobs' progress it is handed, so it is tested with
made-up ones."""

from __future__ import annotations

import statistics

from lightning_deeppool.background.throttle import DutyControl, TradeCheck, foreground_loss

BASELINE_WINDOW = 8
MIN_BASELINE = 5
EARLY_PROBE_EVERY = 3


class Pacing:
    """Every `probe_every` steps one step runs with the jobs held, to keep measuring the baseline
    (every `EARLY_PROBE_EVERY` until it has `MIN_BASELINE` steps). After every `adjust_every` steps
    with the jobs running, the duty adapts to `max_slowdown` and, with `require_gain`, the trade
    check may hold the jobs. The first `settle_steps` steps are not timed (the first one plans)."""

    def __init__(
        self,
        *,
        max_slowdown: float,
        require_gain: bool,
        settle_steps: int,
        probe_every: int,
        adjust_every: int,
    ) -> None:
        self.settle_steps = settle_steps
        self.probe_every = probe_every
        self.adjust_every = adjust_every
        self.held_s: list[float] = []
        self.active_s: list[float] = []
        self.duty_control = DutyControl(max_slowdown)
        self.trade = TradeCheck() if require_gain else None
        self.steps = 0
        self.held = False
        self.held_by_trade = 0
        self._period_start: float | None = None
        self._timed = False
        self._active = False
        self._since_adjust = 0
        self._window_s = 0.0
        self._work_mark = 0.0

    @property
    def duty(self) -> float:
        return self.duty_control.duty

    def baseline_s(self) -> float:
        """Median step time over the recent steps with the jobs held."""
        return statistics.median(self.held_s[-BASELINE_WINDOW:])

    def batch_start(self, now: float, *, running: bool, work_s: float) -> float | None:
        """A step starts at `now`, ending the one before (its length is returned). `running`: job
        threads are alive; `work_s`: the jobs' progress so far in device-seconds."""
        period = now - self._period_start if self._period_start is not None else None
        if period is not None and self._timed:
            if self._active:
                self.active_s.append(period)
                self._window_s += period
                self._adjust(work_s)
            else:
                self.held_s.append(period)
        self._period_start = now
        self._timed = self.steps >= self.settle_steps
        self._active = running and not self.held
        return period

    def batch_end(self) -> None:
        """A step ended: decide whether the jobs are held during the next one."""
        self.steps += 1
        every = self.probe_every if len(self.held_s) >= MIN_BASELINE else EARLY_PROBE_EVERY
        by_trade = self.trade is not None and self.trade.tick()
        self.held_by_trade += by_trade
        self.held = by_trade or self.steps % every == 0

    def untime(self) -> None:
        """The current step is not a foreground step like the others (validation ran, an epoch
        ended, the jobs started part-way through it): leave it out."""
        self._timed = False

    def _adjust(self, work_s: float) -> None:
        self._since_adjust += 1
        if self._since_adjust < self.adjust_every or not self.held_s:
            return
        baseline, observed = self.baseline_s(), statistics.median(self.active_s[-self.adjust_every :])
        self.duty_control.update(baseline_s=baseline, observed_s=observed)
        if self.trade is not None:
            gain = (work_s - self._work_mark) / self._window_s
            self.trade.record(gain=gain, loss=foreground_loss(baseline_s=baseline, observed_s=observed))
        self._since_adjust = 0
        self._window_s = 0.0
        self._work_mark = work_s
