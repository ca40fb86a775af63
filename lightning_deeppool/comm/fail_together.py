"""Fail together: run a step on every rank (or on rank 0) so an error stops every rank, not one.

A rank that raised while the others went on to the next collective would hang the job; these
helpers exchange the outcome first and raise the same error everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class PeerError(RuntimeError):
    """Another rank failed; the message carries its error."""


def on_every_rank(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if any rank raised, every rank raises (the failing one its own error)."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:
        error = err
    if not _distributed():
        if error is not None:
            raise error
        return result
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
    if failed:
        rank, text = failed[0]
        raise PeerError(f"rank {rank} failed: {text}")
    return result


def on_rank_zero(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 and give its result to every rank; its error is raised on every rank."""
    if not _distributed():
        return fn()
    payload: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", fn())
        except Exception as err:
            error = err
            payload[0] = ("error", type(err).__name__, str(err))
    dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    if payload[0][0] == "error":
        _, kind, text = payload[0]
        raise _rebuild(kind, text)
    return payload[0][1]


def _rebuild(kind: str, text: str) -> Exception:
    """The same exception type for the built-in errors users catch (ValueError, ...)."""
    builtin = {"ValueError": ValueError, "KeyError": KeyError, "TypeError": TypeError}
    cls = builtin.get(kind)
    return cls(text) if cls else PeerError(f"rank 0 failed: {kind}: {text}")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
