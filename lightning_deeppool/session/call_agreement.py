"""Which forward calls every rank makes, and which collectives it issues: agreed where the ranks meet.

A planned forward is collective, so it may run only where every rank calls it. Inside a training step a
user may call the model on one rank alone (``if self.global_rank == 0: self(x)`` to log predictions).
Each call is identified by its place in the code (file and line) and its occurrence there within the
step.

The ranks *meet* (every rank's point, gathered on every rank) at every planned call, before every
collective issued through Lightning, and where a training step ends. Every rank sees the same points
and decides the same way:

- all at the same point: a call is collective (each rank's row travels with its point), a collective
  goes ahead, the step ends;
- else, where some ranks are at a call: the lowest such rank's call is decided *alone*, run as plain
  PyTorch by the ranks at it, and the others meet again at the same point (rank 0 holds every
  parameter, so its lone calls are the ones that can run alone);
- else no rank can go on (the ranks issue different collectives, or some leave the step without one
  the others issue), and every rank raises, naming every rank's point.

A wrong decision cannot pass silently: a rank that does not hold every layer refuses to run a call
alone once its copy is stale, or to backpropagate through one. A meeting is one small message between
every two ranks; a rank that stopped closes its links, which its peers notice at once.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple, NoReturn

import torch

from lightning_deeppool.comm.messages import SmallGather

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's tensor (the same shape on each), stacked in rank order on every rank. Collective."""

CALL, COLLECTIVE, DONE = 1, 2, 3
_ROW = 8  # the most numbers a row carries
_TEXT = 256  # the most bytes of a place's name a point carries (its end: file name and line)
_HEAD = struct.Struct(f"<bqqqbH{_ROW}q")


class CallAgreement:
    """Per rank: the step's planned calls and Lightning's collectives, met through `gather`."""

    def __init__(self, gather: Gather, rank: int) -> None:
        self.gather = gather
        self.rank = rank
        self.step = 0
        self.meetings = 0  # how many times this rank met the others (counted for the benchmarks)
        self.alone_among = ""  # where every rank was when this step's last call here was decided alone
        self._seen: dict[str, int] = {}

    def begin_step(self) -> None:
        """A training step starts on this rank."""
        self.step += 1
        self.alone_among = ""
        self._seen.clear()

    def agree(self, site: str, row: Sequence[int] = ()) -> list[tuple[int, ...]] | None:
        """Every rank's `row` if the call at `site` is made by every rank (collective), else None
        (alone)."""
        occurrence = self._seen.get(site, 0)
        self._seen[site] = occurrence + 1
        return self._settle(Point(CALL, self.step, site, occurrence, tuple(row)))

    def end_step(self) -> None:
        """This rank makes no more calls in this step: it waits until no rank does."""
        self._settle(Point(DONE, self.step))

    def before_collective(self, hook: str, row: Sequence[int] = ()) -> list[tuple[int, ...]]:
        """This rank is about to issue a collective from Lightning `hook`: every rank must issue the
        same one next. Returns every rank's `row` once they all are about to (raises on every rank
        where they are not): a collective of a few numbers needs nothing more."""
        rows = self._settle(Point(COLLECTIVE, self.step, hook, row=tuple(row)))
        assert rows is not None  # only a call is decided alone
        return rows

    def _settle(self, mine: Point) -> list[tuple[int, ...]] | None:
        """Meet at `mine` until every rank is there (every rank's row), or until `mine` is a call the
        ranks at the lowest rank's call share while others are elsewhere: decided alone (None)."""
        while True:
            points = self._meet(mine)
            if _together(points):
                return [point.row for point in points]
            alone = _lowest_call(points)
            if alone is None:
                self._fail(points)
            if alone.at == points[self.rank].at:
                self.alone_among = _where(points)
                return None

    def _meet(self, mine: Point) -> list[Point]:
        self.meetings += 1
        return [Point.unpack(raw) for raw in self.gather(mine.pack())]

    def _fail(self, points: list[Point]) -> NoReturn:
        """Every rank sees the same points, so every rank raises this."""
        raise RuntimeError(
            f"deeppool: the ranks issue different collectives, which would never pair up: {_where(points)}. "
            "Issue collectives on every rank in the same order (self.log(..., sync_dist=True) on some "
            "ranks only does not), or log with rank_zero_only=True"
        )


class Point(NamedTuple):
    """Where a rank is when it meets the others: its step, what it is at (`CALL`, `COLLECTIVE`,
    `DONE`), the place (a call's site, a collective's hook), which occurrence there, and its row."""

    kind: int
    step: int
    place: str = ""
    occurrence: int = 0
    row: tuple[int, ...] = ()

    @property
    def at(self) -> tuple[int, int, str, int]:
        """What two ranks must share to be at the same point (their rows may differ)."""
        return self.kind, self.step, self.place, self.occurrence

    def describe(self) -> str:
        if self.kind == CALL:
            return f"calls the model at {self.place} (step {self.step})"
        if self.kind == COLLECTIVE:
            return f"issues a collective from {self.place} (step {self.step})"
        return f"ended training step {self.step}"

    def pack(self) -> torch.Tensor:
        if len(self.row) > _ROW:
            raise ValueError(f"a row carries at most {_ROW} numbers, got {len(self.row)}")
        text = self.place.encode()
        head = _HEAD.pack(
            self.kind, self.step, _digest(text), self.occurrence, len(self.row), len(text[-_TEXT:]),
            *self.row, *[0] * (_ROW - len(self.row)),
        )  # fmt: skip
        raw = head + text[-_TEXT:].ljust(_TEXT, b"\0")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def unpack(cls, raw: torch.Tensor) -> Point:
        data = raw.numpy().tobytes()
        kind, step, digest, occurrence, count, length, *row = _HEAD.unpack_from(data)
        text = data[_HEAD.size : _HEAD.size + length].decode(errors="replace")
        # Two places whose names share their last bytes still differ by the digest of the whole name.
        place = text if not digest or _digest(text.encode()) == digest else f"{text}#{digest:x}"
        return cls(kind, step, place, occurrence, tuple(row[:count]))


def _digest(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big") if text else 0


def _where(points: list[Point]) -> str:
    return "; ".join(f"rank {rank} {point.describe()}" for rank, point in enumerate(points))


def _together(points: list[Point]) -> bool:
    return all(point.at == points[0].at for point in points)


def _lowest_call(points: list[Point]) -> Point | None:
    """The lowest rank's point among those at a call, if any rank is at one."""
    return next((point for point in points if point.kind == CALL), None)


def call_site() -> str:
    """`file:line` of the user code that called the model (the first frame outside torch, Lightning
    and this package)."""
    skip = _library_dirs()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "unknown"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Folders of torch, Lightning and this package: computed once, since every planned call asks."""
    return tuple(
        os.path.dirname(module.__file__ or "")
        for module in (sys.modules["torch"], sys.modules["lightning"], sys.modules["lightning_deeppool"])
    )


def meeting(
    world_size: int, rank: int, timeout: timedelta | None
) -> tuple[CallAgreement | None, SmallGather | None]:
    """Where this rank meets the others: a `CallAgreement` over a `SmallGather` that waits as long as
    the process group does (30 minutes without a timeout), and that gather, for its owner to close;
    neither for one rank."""
    if world_size < 2:
        return None, None
    gather = SmallGather(timeout.total_seconds() if timeout is not None else 1800.0)
    return CallAgreement(gather, rank), gather
