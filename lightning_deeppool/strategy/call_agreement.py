"""Which forward calls every rank makes: agreed through the process group's store, without collectives.

A planned forward is collective, so it may run only where every rank calls it. Inside a training step a
user may call the model on one rank alone (``if self.global_rank == 0: self(x)`` to log predictions).
Each call is identified by its place in the code (file and line) and its occurrence there within the
step. A rank announces the call it is at; when every rank has announced the same one it is collective.
When no rank can still arrive (each has left the step, is waiting at another call, or is blocked in a
collective), the call is decided *local*: it runs as plain PyTorch on the ranks that made it. In that
state the lowest waiting rank's call is decided first: rank 0 holds every parameter, so its lone calls
are the ones that can run locally. A rank blocked in a collective may still be finishing one the
waiting ranks already took part in, so it counts as stuck only once nothing has changed for
`BLOCKED_GRACE_S`. A wrong decision cannot pass silently: a rank that does not hold every layer
refuses to run a call locally once its copy is stale, or to backpropagate through one.

Nobody polls: a waiting rank blocks on its call's decision. The last rank to arrive decides
*collective*; a rank that leaves the step or starts waiting elsewhere decides *local* for the lowest
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

import torch.distributed as dist

_GIVE_UP_S = 600.0
BLOCKED_GRACE_S = 2.0


class CallAgreement:
    """Per rank: the step's calls, announced in `store` under `prefix` (the same on every rank)."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.step = 0
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
        self._seen.clear()

    def end_step(self) -> None:
        """This rank makes no more calls in this step."""
        self._post("done")
        self._release_stuck()

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """This rank waits in a collective: it cannot make a call before the others join it."""
        self._post("blocked")
        try:
            yield
        finally:
            self._post("busy")

    def agree(self, site: str, row: Sequence[int] = ()) -> list[tuple[int, ...]] | None:
        """Every rank's `row` if the call at `site` is made by every rank (collective), else None
        (local). Rows travel with the decision: a collective call needs no further exchange."""
        occurrence = self._seen.get(site, 0)
        self._seen[site] = occurrence + 1
        key = f"{self.prefix}/{self.step}/{site}/{occurrence}"
        self.store.set(self._row_key(self.rank), f"{key}|{','.join(map(str, row))}")
        if self.store.add(f"{key}/n", 1) == self.world_size:
            # Every rank set its row before it arrived; one that has set another since has moved on: it
            # found this call decided local (after the grace for blocked ranks) before this rank came.
            found = [raw.decode().rpartition("|") for raw in self.store.multi_get(self._row_keys())]
            if any(at != key for at, _, _ in found):
                return self._decide(key, "local")
            return self._decide(key, "collective|" + ";".join(text for _, _, text in found))
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
                self._decide(key, "local")
            unchanged = states if mine else None
            try:
                self.store.wait([decision], timedelta(seconds=BLOCKED_GRACE_S))
                return _rows(self.store.get(decision))
            except dist.DistStoreError:
                pass  # a grace period passed without a decision: look again
            if time.monotonic() - start > _GIVE_UP_S:
                raise RuntimeError(
                    f"deeppool: rank {self.rank} waited {_GIVE_UP_S:.0f} s for the other ranks "
                    f"to call the model at {site} or to finish the step; a rank may be blocked "
                    "in a collective deeppool does not see (a torch.distributed call in training_step)"
                )

    def _release_stuck(self, states: list[bytes] | None = None) -> tuple[str, str]:
        """Decide *local* the lowest waiting rank's call if no other rank can still join it. Returns
        that call and "stuck" (decided), "blocked" (only ranks blocked in a collective could still
        join it) or "" (some rank may still join it)."""
        parsed = [
            (int(step), kind, at)
            for step, kind, at in (raw.decode().split("|", 2) for raw in (states or self._states()))
        ]
        waiting = [
            (step, rank, at)
            for rank, (step, kind, at) in enumerate(parsed)
            if kind == "wait" and not self.store.check([f"{at}/decision"])
        ]
        if not waiting:
            return "", ""
        step, lowest, key = min(waiting)
        undecided = {at for _, _, at in waiting}
        blocked = False
        for rank, (their_step, kind, at) in enumerate(parsed):
            if rank == lowest or their_step > step or (their_step == step and kind == "done"):
                continue
            if their_step < step or kind == "busy" or (kind == "wait" and at not in undecided):
                return key, ""  # that rank may still arrive (its own call was decided: it is busy)
            blocked |= kind == "blocked"
        if blocked:
            return key, "blocked"
        self._decide(key, "local")
        return key, "stuck"

    def _decide(self, key: str, value: str) -> list[tuple[int, ...]] | None:
        decided = self.store.compare_set(f"{key}/decision", "", value)
        if decided == value.encode():
            self._decided.setdefault(self.step, []).append(key)
        return _rows(decided)

    def _states(self) -> list[bytes]:
        return self.store.multi_get([self._state_key(r) for r in range(self.world_size)])

    def _post(self, kind: str, at: str = "") -> None:
        self.store.set(self._state_key(self.rank), f"{self.step}|{kind}|{at}")

    def _state_key(self, rank: int) -> str:
        return f"{self.prefix}/state/{rank}"

    def _row_key(self, rank: int) -> str:
        return f"{self.prefix}/row/{rank}"

    def _row_keys(self) -> list[str]:
        return [self._row_key(r) for r in range(self.world_size)]


def _rows(decision: bytes) -> list[tuple[int, ...]] | None:
    """The rows a *collective* decision carries; None for a *local* one."""
    kind, _, rows = decision.decode().partition("|")
    if kind != "collective":
        return None
    return [tuple(int(x) for x in text.split(",") if x) for text in rows.split(";")]


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
