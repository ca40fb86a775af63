"""Run a function on several CPU ranks from inside pytest (a fork server's fresh processes + gloo).

    def _sum(rank: int, scale: float) -> float:
        t = torch.tensor([scale * rank])
        dist.all_reduce(t)
        return t.item()

    assert run_distributed(_sum, 2, 1.0) == [1.0, 1.0]

`fn` must be a module-level (picklable) function; it is called as `fn(rank, *args)` with the
default process group already initialized, and its return value must be picklable.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks fork from one server process started once per test session, fresh as a spawned process but
# with torch and lightning already imported: importing them took most of a spawned rank's start (5 s
# of CPU each, on 2 cores shared by up to 4 ranks).
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["lightning_deeppool", "models"])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    num_threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` fresh ranks; return each rank's result, by rank.

    A rank's exception is re-raised here as a RuntimeError carrying its traceback text. The default
    process group is destroyed when `fn` returns (gloo ranks can SIGABRT at exit otherwise).
    `num_threads` caps torch's intra-op threads per rank so ranks do not oversubscribe the cores.
    """
    results = _CONTEXT.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(
        _worker,
        # Plain pickle: torch's pickler would pass each tensor to the fork server as a file descriptor,
        # and one message carries at most 253 of them.
        args=(
            pickle.dumps((fn, args)),
            world_size,
            results,
            init_method,
            backend,
            timeout_s,
            num_threads,
            dict(os.environ),
        ),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, tuple[bool, Any]] = {}
    exited = False
    # Read results while the ranks run: a rank blocks at exit until its (possibly large) result is read.
    while len(outcomes) < world_size:
        _kill_if_late(context, deadline, timeout_s)
        try:
            rank, ok, payload = pickle.loads(results.get(timeout=0.05))
        except queue.Empty:
            if exited:  # every rank is gone and the queue was read once more after that
                break
            exited = context.join(timeout=0)  # raises if a rank died without reporting
            continue
        outcomes[rank] = (ok, payload)
    while not context.join(timeout=0.5):
        _kill_if_late(context, deadline, timeout_s)
    failures = [f"rank {rank} raised:\n{text}" for rank, (ok, text) in sorted(outcomes.items()) if not ok]
    if failures:
        raise RuntimeError("\n".join(failures))
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result")
    return [outcomes[rank][1] for rank in range(world_size)]


def _kill_if_late(context: mp.ProcessContext, deadline: float, timeout_s: float) -> None:
    if time.monotonic() > deadline:
        for process in context.processes:
            process.kill()
        raise TimeoutError(f"the ranks did not finish within {timeout_s} s")


def _worker(
    rank: int,
    call: bytes,
    world_size: int,
    results: Any,
    init_method: str,
    backend: str,
    timeout_s: float,
    num_threads: int,
    environ: dict[str, str],
) -> None:
    # The fork server's environment is the one it started with; a spawned rank would get this one's.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(num_threads)
    fn, args = pickle.loads(call)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        outcome = (rank, True, fn(rank, *args))
    except BaseException:
        outcome = (rank, False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle: torch's queue pickler shares tensors by file descriptor, gone once the rank exits.
    results.put(pickle.dumps(outcome))
