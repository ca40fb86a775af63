"""CUDA stream priorities: the foreground runs on a new highest-priority stream while jobs run
(each job creates its own lowest-priority stream in its thread)."""

from __future__ import annotations

import torch

from lightning_deeppool.background.job import priority_range


class ForegroundPriority:
    """`raise_()` moves the calling thread's work to a new highest-priority stream on `device`;
    `restore()` returns it to the stream it had, after the work issued meanwhile."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def raise_(self) -> None:
        _, greatest = priority_range()
        previous = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device, priority=greatest)
        stream.wait_stream(previous)
        torch.cuda.set_stream(stream)
        self._streams = (previous, stream)

    def restore(self) -> None:
        if self._streams is None:
            return
        previous, stream = self._streams
        previous.wait_stream(stream)
        torch.cuda.set_stream(previous)
        self._streams = None
