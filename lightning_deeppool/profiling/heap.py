"""Give memory that one-off work (capture, profiling) freed back to the system, so that it does not
stay in the process for the whole run: glibc's heap keeps freed blocks below its mmap threshold
(`malloc_trim` returns them), CUDA's caching allocator its freed blocks (`empty_cache`)."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch


def give_back(device: torch.device) -> None:
    """Return the freed memory of this process's heap, and of `device`'s cache on CUDA."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library is not glibc's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None
