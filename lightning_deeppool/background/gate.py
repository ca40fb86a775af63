"""The safe point every background piece passes through: it paces, pauses and stops jobs."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lightning_deeppool.background.throttle import may_run, pause_after
from lightning_deeppool.runtime.idle import IdleWindows

_POLL_S = 0.02


class Stopped(Exception):
    """Raised at a safe point of a background job once the foreground has ended."""


class Gate:
    """Shared by the jobs of one rank; the callback (main thread) sets `mode`, `duty` and `held`.

    `enter` rests after a piece so pieces take `duty` of the time, then blocks while the policy
    (`throttle.may_run`) says no, and raises `Stopped` as soon as `stop` is set.
    """

    def __init__(self, windows: IdleWindows, mode: str) -> None:
        self.windows = windows
        self.mode = mode
        self.duty = 1.0
        self.held = False
        self.stop = threading.Event()

    def enter(
        self,
        piece_s: float,
        next_piece_s: float,
        paused: Callable[[bool], None],
        *,
        inside_backward: bool = False,
    ) -> None:
        """Called between pieces: `piece_s` is how long the last one took, `next_piece_s` how long
        the next one is expected to take (it must fit in the idle window left).

        Inside a backward a stop returns instead of raising, and the job stops at its next safe
        point: a backward aborted from a hook leaves its nodes in the thread's autograd queue, freed
        only as the OS thread exits, and a process that exits meanwhile aborts (torch's C++ needs
        the GIL of a finalizing interpreter)."""
        try:
            self._pass(piece_s, next_piece_s, paused)
        except Stopped:
            if not inside_backward:
                raise

    def _pass(self, piece_s: float, next_piece_s: float, paused: Callable[[bool], None]) -> None:
        if self.stop.is_set():
            raise Stopped
        rest = pause_after(piece_s, self.duty)
        if rest > 0 and self.stop.wait(rest):
            raise Stopped
        if self._allowed(next_piece_s):
            return
        paused(True)
        while not self._allowed(next_piece_s):
            # A held gate with a window open would spin on wait_for: sleep instead.
            if self.held or self.mode == "priority":
                self.stop.wait(_POLL_S)
            else:
                self.windows.wait_for(next_piece_s, _POLL_S)
            if self.stop.is_set():
                raise Stopped
        paused(False)

    def _allowed(self, next_piece_s: float) -> bool:
        return may_run(self.mode, window_fits=self.windows.fits(next_piece_s), held=self.held)
