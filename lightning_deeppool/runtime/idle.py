"""Idle windows: the runtime announces when this rank waits on other ranks.

The background trainers subscribe to them and run their work inside, so the foreground never waits
for a background job that did not need the device. Each window has a key (its place in the step:
a schedule action, the wait between steps); the same key recurs every step, so the windows learn
how long each one lasts and tell a job whether its next piece still fits.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager

# Recent lengths kept per key; their median is the expected length. A piece starts only if it is
# expected to end inside the window, so a window that ends early is overrun by at most that piece
# (the duty throttle answers if overruns add up). Measured: expecting the shortest recent length
# instead left a seventh of rank 1's idle time unused in `benchmarks/background.py`.
HISTORY = 5


class IdleWindows:
    """Thread-safe: the foreground thread opens windows, background threads ask whether one is open
    with enough time left. Nested windows count as the outermost one. `opened` counts windows and
    `total_s` sums their lengths."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._depth = 0
        self._key: Hashable = None
        self._opened_at = 0.0
        self._lengths: dict[Hashable, deque[float]] = {}
        self.opened = 0
        self.total_s = 0.0

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # Spawned workers get a fresh, closed instance: locks and events do not cross processes.
        return (IdleWindows, ())

    @contextmanager
    def window(self, key: Hashable = None) -> Iterator[None]:
        """Mark the enclosed wait as idle time for this rank; `key` names its place in the step."""
        with self._changed:
            self._depth += 1
            if self._depth == 1:
                self.opened += 1
                self._key = key
                self._opened_at = time.perf_counter()
                self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._depth -= 1
                if self._depth == 0:
                    length = time.perf_counter() - self._opened_at
                    self.total_s += length
                    # No notify: a closing window lets no waiting job start.
                    self._lengths.setdefault(self._key, deque(maxlen=HISTORY)).append(length)

    @property
    def is_open(self) -> bool:
        return self._depth > 0

    def expected_s(self, key: Hashable) -> float:
        """The median recent length of windows with this key; infinite for a key not seen yet."""
        lengths = self._lengths.get(key)
        return statistics.median(lengths) if lengths else math.inf

    def remaining_s(self) -> float:
        """Expected time left in the open window (0 when closed, negative when overdue)."""
        with self._changed:
            return self._remaining() if self._depth > 0 else 0.0

    def fits(self, need_s: float) -> bool:
        """Whether a window is open with at least `need_s` expected left."""
        with self._changed:
            return self._fits(need_s)

    def wait_for(self, need_s: float, timeout: float) -> bool:
        """Block until a window is open with at least `need_s` expected left (True) or `timeout`."""
        with self._changed:
            return self._changed.wait_for(lambda: self._fits(need_s), timeout)

    def _fits(self, need_s: float) -> bool:
        return self._depth > 0 and self._remaining() >= need_s

    def _remaining(self) -> float:
        return self.expected_s(self._key) - (time.perf_counter() - self._opened_at)


class ScheduleWindows:
    """Idle windows keyed by their place in a schedule: the action running and which of its waits
    this is, a key that recurs every step."""

    def __init__(self, idle: IdleWindows | None = None) -> None:
        self.idle = idle or IdleWindows()
        self.action: Hashable = None
        self._waits = 0

    def enter(self, action: Hashable) -> None:
        """The schedule runs `action` now."""
        self.action, self._waits = action, 0

    def window(self) -> AbstractContextManager[None]:
        """The next wait of the current action, as an idle window."""
        self._waits += 1
        return self.idle.window((self.action, self._waits))
