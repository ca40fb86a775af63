"""Idle windows: the runtime announces when this rank waits on other ranks.

The background trainers subscribe to them and run their work inside, so the foreground never waits
for a background job that did not need the device.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class IdleWindows:
    """A thread-safe flag that is open while the runtime waits on communication.

    `wait_open(timeout)` blocks a background thread until a window opens; `is_open` tells a thread
    that is mid-step whether it may go on. Nested windows count as one.
    """

    def __init__(self) -> None:
        self._open = threading.Event()
        self._depth = 0
        self._lock = threading.Lock()
        self.opened = 0

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # Spawned workers get a fresh, closed instance: locks and events do not cross processes.
        return (IdleWindows, ())

    @contextmanager
    def window(self) -> Iterator[None]:
        """Mark the enclosed wait as idle time for this rank."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self.opened += 1
                self._open.set()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._open.clear()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def wait_open(self, timeout: float | None = None) -> bool:
        """Block until a window is open (True) or the timeout passes (False)."""
        return self._open.wait(timeout)
