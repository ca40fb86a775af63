"""Gradient buckets: how gradients are grouped into all-reduce calls, shared by the runtime's schedule,
the profiler's calibration and the cost model's overlap of all-reduces with backward."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)

_Item = TypeVar("_Item")


def cut_into_buckets(
    sized: Iterable[tuple[_Item, int]], bucket_bytes: int, *, first: bool
) -> list[list[_Item]]:
    """Items with their bytes, in the order backward makes them final, cut into buckets in that order.

    A bucket closes once it holds `bucket_bytes`; the first of a step (`first`: none closed before
    these items) already at `FIRST_BUCKET_BYTES`, as in DDP, so an all-reduce starts early in backward
    instead of after the whole of a large stage. An item as large as a whole bucket goes alone: it is
    reduced without a copy.
    """
    buckets: list[list[_Item]] = []
    chunk: list[_Item] = []
    held = 0
    for item, size in sized:
        if size >= bucket_bytes and chunk:
            buckets.append(chunk)
            chunk, held = [], 0
        chunk.append(item)
        held += size
        limit = min(bucket_bytes, FIRST_BUCKET_BYTES) if first and not buckets else bucket_bytes
        if held >= limit:
            buckets.append(chunk)
            chunk, held = [], 0
    if chunk:
        buckets.append(chunk)
    return buckets
