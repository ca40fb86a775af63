"""Which forward calls every rank makes: agreed through the process group's store, without collectives.

A planned forward is collective, so it may run only where every rank calls it. Inside a training step a
user may call the model on one rank alone (``if self.global_rank == 0: self(x)`` to log predictions).
Each call is identified by its place in the code (file and line) and its occurrence there within the
step. A rank announces the call it is at; when every rank has announced the same one it is collective.
When no rank can still arrive (each has left the step, is waiting at another call, or is blocked in a
collective), the call is decided *alone*: it runs as plain PyTorch on the ranks that made it. In that
state the lowest waiting rank's call is decided first: rank 0 holds every parameter, so its lone calls
are the ones that can run alone. A rank blocked in a collective may still be finishing one the
waiting ranks already took part in, so it counts as stuck only once nothing has changed for
`BLOCKED_GRACE_S`. A wrong decision cannot pass silently: a rank that does not hold every layer
refuses to run a call alone once its copy is stale, or to backpropagate through one.

Nobody polls: a waiting rank blocks on its call's decision. The last rank to arrive decides
*collective*; a rank that leaves the step or starts waiting elsewhere decides *alone* for the lowest
waiting rank when that one can no longer be joined. Only the grace for blocked ranks needs a timer.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple, NoReturn

import torch.distributed as dist

BLOCKED_GRACE_S = 2.0


class CallAgreement:
    """Per rank: the step's calls, announced in `store` under `prefix` (the same on every rank)."""

    def __init__(
        self, store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float = 1800.0
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s  # the process group's: a wait at a call gives up after it too
        self.step = 0
        self.collectives = 0  # the collectives this rank has issued from Lightning (`blocked(issued=...)`)
        self._kind = "busy"
        self._seen: dict[str, int] = {}
        self._decided: dict[int, list[str]] = {}  # per step, the calls this rank decided
        self._post("busy")

    def begin_step(self) -> None:
        """A training step starts on this rank. (No state is posted: a state naming an earlier step
        already says this rank may still arrive.)"""
        # Calls two steps back: no rank can still be reading their keys (a step ends in a collective).
        for key in self._decided.pop(self.step - 1, []):
            self.store.delete_key(f"{key}/n")
            self.store.delete_key(f"{key}/decision")
        self.step += 1
        self._kind = "busy"  # posted with the next state: the one naming the last step says as much
        self._seen.clear()

    def end_step(self) -> None:
        """This rank makes no more calls in this step."""
        self._post("done")
        self._release_stuck()

    @contextmanager
    def blocked(self, issued: str = "") -> Iterator[None]:
        """This rank waits in a collective: it cannot make a call before the others join it. A
        collective `issued` from a Lightning hook (named) is counted: every rank issues the same ones,
        in the same order."""
        if issued:
            self.collectives += 1
        before = self._kind
        # A rank that has finished its step stays done: it joins none of the step's calls.
        self._post("done" if before == "done" else "blocked", issued)
        try:
            if issued:
                self._check_same_collective(issued)
            yield
        finally:
            self._post(before)

    def agree(self, site: str, row: Sequence[int] = ()) -> list[tuple[int, ...]] | None:
        """Every rank's `row` if the call at `site` is made by every rank (collective), else None
        (alone). Rows travel with the decision: a collective call needs no further exchange."""
        occurrence = self._seen.get(site, 0)
        self._seen[site] = occurrence + 1
        key = f"{self.prefix}/{self.step}/{site}/{occurrence}"
        self.store.set(self._row_key(self.rank), str(_Arrival(key, tuple(row))))
        if self.store.add(f"{key}/n", 1) == self.world_size:
            # Every rank set its row before it arrived; one that has set another since has moved on: it
            # found this call decided alone (after the grace for blocked ranks) before this rank came.
            found = [_Arrival.parse(raw) for raw in self.store.multi_get(self._row_keys())]
            if any(arrival.at != key for arrival in found):
                return self._decide(key, ALONE)
            return self._decide(key, _Decision(tuple(arrival.row for arrival in found)))
        self._post("wait", key)
        try:
            return self._await(key, site)
        finally:
            self._post("busy")

    def _await(self, key: str, site: str) -> list[tuple[int, ...]] | None:
        decision = f"{key}/decision"
        start = time.monotonic()
        unchanged: list[bytes] | None = None
        while True:
            states = self._states()
            lowest, verdict = self._release_stuck(states)
            mine = verdict == "blocked" and lowest == key
            if mine and unchanged == states:
                # Nothing moved during a whole grace period: the blocked ranks wait for this one.
                self._decide(key, ALONE)
            unchanged = states if mine else None
            self._check_collectives(states, site)
            try:
                self.store.wait([decision], timedelta(seconds=BLOCKED_GRACE_S))
                return _Decision.parse(self.store.get(decision)).rows()
            except dist.DistStoreError:
                pass  # a grace period passed without a decision: look again
            if time.monotonic() - start > self.timeout_s:
                raise RuntimeError(
                    f"deeppool: rank {self.rank} waited {self.timeout_s:.0f} s for the other ranks "
                    f"to call the model at {site} or to finish the step; a rank may be blocked "
                    "in a collective deeppool does not see (a torch.distributed call in training_step)"
                )

    def _release_stuck(self, states: list[bytes] | None = None) -> tuple[str, str]:
        """Decide *alone* the lowest waiting rank's call if no other rank can still join it. Returns
        that call and "stuck" (decided), "blocked" (only ranks blocked in a collective could still
        join it) or "" (some rank may still join it)."""
        parsed = [_State.parse(raw) for raw in (states or self._states())]
        waiting = [
            (state.step, rank, state.at)
            for rank, state in enumerate(parsed)
            if state.kind == "wait" and not self.store.check([f"{state.at}/decision"])
        ]
        if not waiting:
            return "", ""
        step, lowest, key = min(waiting)
        undecided = {at for _, _, at in waiting}
        blocked = False
        for rank, state in enumerate(parsed):
            if rank == lowest or state.step > step or (state.step == step and state.kind == "done"):
                continue
            if (
                state.step < step
                or state.kind == "busy"
                or (state.kind == "wait" and state.at not in undecided)
            ):
                return key, ""  # that rank may still arrive (its own call was decided: it is busy)
            blocked |= state.kind == "blocked"
        if blocked:
            return key, "blocked"
        self._decide(key, ALONE)
        return key, "stuck"

    def _decide(self, key: str, decision: _Decision) -> list[tuple[int, ...]] | None:
        """Decide the call at `key` unless a rank already did; the decision that holds."""
        value = str(decision)
        decided = self.store.compare_set(f"{key}/decision", "", value)
        if decided == value.encode():
            self._decided.setdefault(self.step, []).append(key)
        return _Decision.parse(decided).rows()

    def _states(self) -> list[bytes]:
        return self.store.multi_get([self._state_key(r) for r in range(self.world_size)])

    def _check_collectives(self, states: list[bytes], site: str) -> None:
        """Raise if a rank that must still join this call waits in a collective issued from a hook that
        this rank, waiting at the call, has not issued yet: neither can go on (every rank issues the
        same collectives in the same order around the planned calls)."""
        for rank, state in enumerate(_State.parse(raw) for raw in states):
            joins = state.step < self.step or (state.step == self.step and state.kind == "blocked")
            if joins and state.kind in ("blocked", "done") and state.at and state.issued > self.collectives:
                self._fail(
                    f"deeppool: rank {rank} waits in a collective issued from {state.at} (collective "
                    f"{state.issued} it issued from a hook), which rank {self.rank} has not issued (it "
                    f"issued {self.collectives}): rank {self.rank} waits at the model call at {site}, "
                    f"which rank {rank} must join first. The ranks issued "
                    "different collectives, or in a different order around the call "
                    "(self.log(..., sync_dist=True) on some ranks only, say). Issue collectives on every "
                    "rank in the same order, or log with rank_zero_only=True"
                )

    def _check_same_collective(self, issued: str) -> None:
        """Raise if a rank waits in its collective of the same number as this one, issued elsewhere:
        they would never pair up. (Each rank posts its own before reading the others', so of two ranks
        in such collectives at once at least one sees the other's.)"""
        for rank, state in enumerate(_State.parse(raw) for raw in self._states()):
            if rank == self.rank or state.issued != self.collectives or not state.at:
                continue
            if state.kind in ("blocked", "done") and state.at != issued:
                self._fail(
                    f"deeppool: the collective {self.collectives} rank {self.rank} issued from a hook is "
                    f"{issued}, and rank {rank}'s is {state.at}: the ranks issued different collectives "
                    "(self.log(..., sync_dist=True) on some ranks only, say), which would never pair up. "
                    "Issue collectives on every rank in the same order, or log with rank_zero_only=True"
                )

    def _fail(self, message: str) -> NoReturn:
        """Raise `message` here, and leave it for the other ranks to find (`reported`)."""
        self.store.set(f"{self.prefix}/failed", message)
        raise RuntimeError(message)

    def reported(self) -> str | None:
        """What a rank that stopped on a mismatch of collectives reported, if the store still answers
        (it lives in rank 0's process)."""
        key = f"{self.prefix}/failed"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # the store's rank is gone
            return None

    def _post(self, kind: str, at: str = "") -> None:
        self._kind = kind
        state = _State(self.step, kind, at, self.collectives)
        self.store.set(self._state_key(self.rank), str(state))

    def _state_key(self, rank: int) -> str:
        return f"{self.prefix}/state/{rank}"

    def _row_key(self, rank: int) -> str:
        return f"{self.prefix}/row/{rank}"

    def _row_keys(self) -> list[str]:
        return [self._row_key(r) for r in range(self.world_size)]


class _State(NamedTuple):
    """What a rank posts of itself: its step, what it is doing ("busy", "wait", "blocked" or "done"),
    where (waiting: the call it waits at; blocked: the hook that issued the collective, if counted),
    and how many collectives it has issued from hooks."""

    step: int
    kind: str
    at: str = ""
    issued: int = 0

    def __str__(self) -> str:
        return f"{self.step}|{self.kind}|{self.issued}|{self.at}"

    @classmethod
    def parse(cls, raw: bytes) -> _State:
        step, kind, issued, at = raw.decode().split("|", 3)
        return cls(int(step), kind, at, int(issued))


class _Arrival(NamedTuple):
    """A rank's arrival at a call: the call's key and the row the rank brings to it."""

    at: str
    row: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.at}|{_row_text(self.row)}"

    @classmethod
    def parse(cls, raw: bytes) -> _Arrival:
        at, _, text = raw.decode().rpartition("|")
        return cls(at, _row(text))


class _Decision(NamedTuple):
    """A call's decision: collective, carrying every rank's row, or alone (`every_row` None)."""

    every_row: tuple[tuple[int, ...], ...] | None

    def __str__(self) -> str:
        if self.every_row is None:
            return "alone"
        return "collective|" + ";".join(_row_text(row) for row in self.every_row)

    def rows(self) -> list[tuple[int, ...]] | None:
        return None if self.every_row is None else list(self.every_row)

    @classmethod
    def parse(cls, raw: bytes) -> _Decision:
        kind, _, rows = raw.decode().partition("|")
        return cls(tuple(_row(text) for text in rows.split(";")) if kind == "collective" else None)


ALONE = _Decision(None)


def _row_text(row: tuple[int, ...]) -> str:
    return ",".join(map(str, row))


def _row(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


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
