"""The background throttle as pure policy: when a background piece may run and how much time it gets.

Modes:
    ``"idle"``: only inside the idle windows the deeppool runtime announces (it waits on other ranks).
    ``"priority"``: CUDA only; any time, on a low-priority stream, paced by the adaptive duty.
    ``"between_steps"``: the fallback without idle windows (one device, plain DDP, ...): the callback
        opens a window of ``(max_slowdown - 1) * duty * baseline`` seconds after each foreground step.
Every mode is paced by a duty (the share of time background pieces may take), adapted so that the
foreground's step time stays within ``max_slowdown`` of its time without background (`DutyControl`),
and the jobs are held while what they gain is worth less than what the foreground loses
(`TradeCheck`): background work must never lower total throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["idle", "priority", "between_steps"]
MODES: tuple[str, ...] = ("idle", "priority", "between_steps")
MIN_DUTY = 1 / 64
DUTY_STEP = 1 / 8
STRIKES = 2
FIRST_HOLD_STEPS = 40
MAX_HOLD_STEPS = 640


def choose_mode(requested: str, *, cuda: bool, has_windows: bool) -> Mode:
    """Resolve ``"auto"`` (CUDA: priority; else idle windows when the runtime has them, else
    between_steps) and check that an explicit mode is possible here."""
    match requested:
        case "auto":
            if cuda:
                return "priority"
            return "idle" if has_windows else "between_steps"
        case "idle":
            if not has_windows:
                raise ValueError(
                    "background mode 'idle' needs the idle windows of a deeppool runtime with at least 2 "
                    "ranks, and none opened during the warm-up steps; use mode='between_steps' or 'auto'"
                )
            return "idle"
        case "priority":
            if not cuda:
                raise ValueError(
                    "background mode 'priority' needs CUDA streams; on CPU use 'idle', 'between_steps' "
                    "or 'auto'"
                )
            return "priority"
        case "between_steps":
            return "between_steps"
        case _:
            raise ValueError(f"unknown background mode {requested!r}; expected 'auto' or one of {MODES}")


def may_run(mode: str, *, window_fits: bool, held: bool) -> bool:
    """Whether a background job may issue its next piece now. `window_fits`: an idle window is open
    with time left for the piece; `held`: the foreground is measuring its step time without
    background."""
    match mode:
        case "idle" | "between_steps":
            return window_fits and not held
        case "priority":
            return not held
        case _:
            raise ValueError(f"unknown background mode {mode!r}; expected one of {MODES}")


@dataclass
class DutyControl:
    """Additive increase, multiplicative decrease of the duty against a noisy signal (step times on
    a shared machine): grow by 1/8 after a window of steps within ``max_slowdown`` of the baseline;
    halve after `STRIKES` windows in a row over it, so one noisy window only holds the duty still.
    Bounded to [1/64, 1]."""

    max_slowdown: float
    duty: float = 1.0
    strikes: int = 0

    def update(self, *, baseline_s: float, observed_s: float) -> float:
        if baseline_s <= 0 or observed_s <= 0:
            raise ValueError(
                f"step times must be positive, got baseline {baseline_s} s, observed {observed_s} s"
            )
        if observed_s <= self.max_slowdown * baseline_s:
            self.strikes = 0
            self.duty = min(1.0, self.duty + DUTY_STEP)
            return self.duty
        self.strikes += 1
        if self.strikes >= STRIKES:
            self.strikes = 0
            self.duty = max(MIN_DUTY, self.duty / 2)
        return self.duty


def pause_after(piece_s: float, duty: float) -> float:
    """Seconds to rest after a piece of `piece_s` seconds so pieces take `duty` of the time."""
    if not 0 < duty <= 1:
        raise ValueError(f"duty must be in (0, 1], got {duty}")
    return piece_s * (1 - duty) / duty


def window_budget(baseline_s: float, *, max_slowdown: float, duty: float) -> float:
    """Length of the between-steps window: the slowdown allowance of one foreground step, scaled
    by the duty."""
    return max(0.0, (max_slowdown - 1.0) * baseline_s * duty)


def foreground_loss(*, baseline_s: float, observed_s: float) -> float:
    """The share of its rate the foreground loses when its step takes `observed_s` instead of
    `baseline_s` (negative when it measured faster)."""
    return 1.0 - baseline_s / observed_s


@dataclass
class TradeCheck:
    """Whether background work pays: the jobs' gain (their progress in device-equivalents: seconds
    of their own unshared step time per second) against the foreground's loss (`foreground_loss`).

    After `STRIKES` windows in a row that do not pay, the jobs are held for `hold_steps` foreground
    steps; each hold that ends in another failing trade doubles the next one (up to
    `MAX_HOLD_STEPS`), and a window that pays resets it. One rank's jobs must make up for the whole
    foreground's loss: conservative for several ranks with jobs, and it needs no communication."""

    hold_steps: int = FIRST_HOLD_STEPS
    held_left: int = 0
    losing: int = 0
    holds: int = 0

    def record(self, *, gain: float, loss: float) -> None:
        if gain >= loss:
            self.losing = 0
            self.hold_steps = FIRST_HOLD_STEPS
            return
        self.losing += 1
        if self.losing >= STRIKES:
            self.losing = 0
            self.held_left = self.hold_steps
            self.holds += 1
            self.hold_steps = min(MAX_HOLD_STEPS, 2 * self.hold_steps)

    def tick(self) -> bool:
        """One foreground step passes: whether the jobs are held during it."""
        if self.held_left <= 0:
            return False
        self.held_left -= 1
        return True
