"""`JobPool`: one rank's jobs, each trained in a thread of the rank's own process, at most `slots`
at a time; a job that ends frees its slot for the next queued one."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from lightning_deeppool.background.gate import Gate
from lightning_deeppool.background.job import BackgroundJob, JobRun, lower_cpu_priority

log = logging.getLogger(__name__)
THREAD_PREFIX = "deeppool-bg-"


class JobPool:
    """Starts, reaps and stops the threads of `jobs` on `device`; a job that fails to build or
    train is marked failed with its traceback and never raises here."""

    def __init__(self, jobs: list[BackgroundJob], *, slots: int, device: torch.device) -> None:
        self.jobs = jobs
        self.slots = slots
        self.device = device
        self._queue = list(jobs)
        self._running: list[tuple[threading.Thread, BackgroundJob]] = []
        self._started: list[threading.Thread] = []

    @property
    def running(self) -> bool:
        return bool(self._running)

    @property
    def work_s(self) -> float:
        """The jobs' progress so far in device-seconds (`JobStats.work_s`, summed)."""
        return sum(job.stats.work_s for job in self.jobs)

    def fill(self, gate: Gate) -> None:
        """Start queued jobs in the free slots; reap the threads that ended first."""
        self._reap()
        while self._queue and len(self._running) < self.slots:
            job = self._queue.pop(0)
            try:
                run = job.build(self.device)
            except Exception:
                _failed(job, traceback.format_exc())
                continue
            thread = threading.Thread(
                target=_train_in_background,
                args=(run, gate),
                name=f"{THREAD_PREFIX}{job.name}",
                daemon=True,
            )
            job.stats.state = "running"
            thread.start()
            self._running.append((thread, job))
            self._started.append(thread)

    def stop(self, gate: Gate, timeout_s: float) -> None:
        """Stop every job thread (each checkpoints on its way out) within `timeout_s`."""
        gate.stop.set()
        deadline = time.monotonic() + timeout_s
        for thread, job in self._running:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning(
                    "background job %r did not stop within %.0f s; it is left as a daemon thread and "
                    "its last checkpoint is at %s",
                    job.name,
                    timeout_s,
                    job.checkpoint_path,
                )
        # Every thread started here must be gone from the OS before the process may exit, those
        # `fill` reaped included (a job that failed mid-backward).
        for thread in self._started:
            if not thread.is_alive():
                _wait_for_os_thread(thread, min(deadline, time.monotonic() + 1.0))
        self._reap()
        self._running = []

    def summary(self) -> list[dict[str, Any]]:
        """One row per job: name, rank, state, steps, samples (and per second over its running
        time, from `started_s` to `ended_s` on `time.perf_counter`), work in device-seconds, last
        loss, error."""
        return [
            {
                "name": job.name,
                "rank": job.stats.rank,
                "state": job.stats.state,
                "global_step": job.stats.global_step,
                "samples": job.stats.samples,
                "samples_per_s": job.stats.samples_per_s,
                "work_s": job.stats.work_s,
                "started_s": job.stats.started_s,
                "ended_s": job.stats.ended_s,
                "loss": job.stats.loss,
                "error": job.stats.error,
            }
            for job in self.jobs
        ]

    def _reap(self) -> None:
        still = []
        for thread, job in self._running:
            if thread.is_alive():
                still.append((thread, job))
            elif job.stats.state == "failed":
                _failed(job, job.stats.error or "")
        self._running = still


def _failed(job: BackgroundJob, text: str) -> None:
    job.stats.state = "failed"
    job.stats.error = text
    log.error(
        "background job %r failed on rank %s; the foreground goes on:\n%s", job.name, job.stats.rank, text
    )


def _wait_for_os_thread(thread: threading.Thread, deadline: float) -> None:
    """Wait until the OS thread behind a joined Python thread is gone (Linux; elsewhere a no-op).

    `join` returns once the thread's Python state is released, before its C++ thread-local objects
    (torch's among them) are destroyed; a process that exits during that cleanup can abort
    ("terminate called without an active exception"), as spawned workers do right after fit.
    """
    task = Path(f"/proc/self/task/{thread.native_id}")
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.001)


def _train_in_background(run: JobRun, gate: Gate) -> None:
    """A job thread's body. On CPU the thread first lowers its OS priority, so a foreground thread
    that wakes up (its wait ended) gets a core at once instead of sharing it with the job."""
    if run.device.type == "cpu":
        lower_cpu_priority()
    run.train(gate)
