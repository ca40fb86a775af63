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
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

_POLL_S = (5e-5, 2e-3)  # first and longest pause between two looks at the store
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
        self._keys: dict[int, list[str]] = {}
        self._post("busy")

    def begin_step(self) -> None:
        """A training step starts on this rank."""
        for key in self._keys.pop(self.step - 1, []):
            self.store.delete_key(key)
        self.step += 1
        self._seen.clear()
        self._post("busy")

    def end_step(self) -> None:
        """This rank makes no more calls in this step."""
        self._post("done")

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """This rank waits in a collective: it cannot make a call before the others join it."""
        self._post("blocked")
        try:
            yield
        finally:
            self._post("busy")

    def agree(self, site: str) -> bool:
        """Whether the call at `site` is made by every rank (collective) or not (local)."""
        occurrence = self._seen.get(site, 0)
        self._seen[site] = occurrence + 1
        key = f"{self.prefix}/{self.step}/{site}/{occurrence}"
        decision = f"{key}/decision"
        self._keys.setdefault(self.step, []).extend([f"{key}/n", decision])
        if self.store.add(f"{key}/n", 1) == self.world_size:
            return self._decide(decision, "collective")
        self._post("wait", key)
        start, pause = time.monotonic(), _POLL_S[0]
        unchanged: tuple[float, list[bytes]] | None = None
        try:
            while not self.store.check([decision]):
                states = self.store.multi_get([self._state_key(r) for r in range(self.world_size)])
                stuck = self._stuck(key, states)
                if stuck == "stuck":
                    return self._decide(decision, "local")
                if stuck == "blocked":
                    if unchanged is None or unchanged[1] != states:
                        unchanged = (time.monotonic(), states)
                    elif time.monotonic() - unchanged[0] > BLOCKED_GRACE_S:
                        return self._decide(decision, "local")
                if time.monotonic() - start > _GIVE_UP_S:
                    raise RuntimeError(
                        f"deeppool: rank {self.rank} waited {_GIVE_UP_S:.0f} s for the other ranks "
                        f"to call the model at {site} or to finish the step; a rank may be blocked "
                        "in a collective deeppool does not see (a torch.distributed call in training_step)"
                    )
                time.sleep(pause)
                pause = min(pause * 2, _POLL_S[1])
            return self.store.get(decision) == b"collective"
        finally:
            self._post("busy")

    def _decide(self, decision: str, value: str) -> bool:
        return self.store.compare_set(decision, "", value) == b"collective"

    def _stuck(self, key: str, states: list[bytes]) -> str:
        """ "stuck" when no other rank can still arrive at `key` and this rank is the one to decide,
        "blocked" when that depends on ranks blocked in a collective, else "" (keep waiting)."""
        waiting, blocked = [], False
        for rank, raw in enumerate(states):
            step, kind, at = raw.decode().split("|", 2)
            if int(step) < self.step:
                return ""  # that rank has not reached this step yet
            if int(step) > self.step or kind == "done":
                continue
            if kind == "blocked":
                blocked = True
                continue
            if kind == "busy":
                return ""
            if at != key and self.store.check([f"{at}/decision"]):
                return ""  # decided since: that rank is busy again
            waiting.append(rank)
        if min(waiting) != self.rank:
            return ""
        return "blocked" if blocked else "stuck"

    def _post(self, kind: str, at: str = "") -> None:
        self.store.set(self._state_key(self.rank), f"{self.step}|{kind}|{at}")

    def _state_key(self, rank: int) -> str:
        return f"{self.prefix}/state/{rank}"


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
