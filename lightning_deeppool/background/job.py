"""`BackgroundJob`: a LightningModule trained in a thread of a foreground rank, and its worker.

The job is built on the main thread (its module initialised under its own seed, inside
`torch.random.fork_rng`, so the foreground's global RNG is untouched) and trained on a thread that
passes a `Gate` at safe points: before every submodule's forward, before every parameter's gradient
(CPU only; a stop there takes effect once the backward is done), before the optimizer step and
before each batch. A checkpoint that Lightning's `load_from_checkpoint` reads is written every
`checkpoint_every` steps and when the job stops.

Limitation: randomness inside `training_step` (dropout, `torch.rand`) draws from the process-wide
generator that the foreground shares; such jobs change the foreground's random stream. Use
modules without dropout, or draw from your own `torch.Generator`.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, RandomSampler

from lightning_deeppool.background.gate import Gate, Stopped
from lightning_deeppool.private_files import open_own, write_privately
from lightning_deeppool.runtime.idle import IdleWindows

STATES: tuple[str, ...] = ("queued", "running", "paused", "done", "failed", "stopped")
ModuleSource = pl.LightningModule | Callable[[], pl.LightningModule]
LoaderSource = Iterable[Any] | pl.LightningDataModule | Callable[[], Any]
_PIECE_HISTORY = 3


@dataclass
class JobStats:
    """What the callback reports per job. Written by the job's thread, read by the main thread."""

    state: str = "queued"
    rank: int | None = None
    global_step: int = 0
    session_steps: int = 0
    samples: int = 0
    loss: float | None = None
    started_s: float | None = None
    ended_s: float | None = None
    error: str | None = None
    # Progress in device-seconds: each piece counts as the shortest of its recent durations (its
    # time unslowed by sharing), however long sharing made it take this time.
    work_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        if self.started_s is None or self.samples == 0:
            return 0.0
        end = self.ended_s if self.ended_s is not None else time.perf_counter()
        return self.samples / max(end - self.started_s, 1e-9)


class BackgroundJob:
    """A training job that runs on a foreground rank's device in the time the foreground leaves.

    Args:
        module: a LightningModule, or a zero-argument callable returning one (built on the rank
            that runs the job, seeded with `seed`; must be picklable for spawned ranks). Trained by
            its `training_step` and `configure_optimizers` (one optimizer, automatic optimization;
            step- and epoch-interval schedulers).
        train_dataloader: a DataLoader (or any iterable of batches), a LightningDataModule (its
            `prepare_data`, `setup("fit")` and `train_dataloader` are called), or a zero-argument
            callable returning either.
        max_steps: optimizer steps to train (counting resumed ones); ``None`` trains until the
            foreground ends.
        name: the checkpoint's file name and the logging prefix (default ``job<index>``).
        checkpoint_dir: where ``<name>.ckpt`` goes (default ``<default_root_dir>/background``); an
            existing checkpoint there is resumed (weights, optimizer, schedulers, step, data order).
        checkpoint_every: steps between checkpoints (one is also written when the job stops).
        rank: pin the job to this foreground rank (default: placed round-robin by the callback).
        seed: seeds the module's construction and the data order (a DataLoader without its own
            `generator` gets one).
    """

    def __init__(
        self,
        module: ModuleSource,
        train_dataloader: LoaderSource,
        max_steps: int | None = None,
        name: str | None = None,
        checkpoint_dir: str | Path | None = None,
        *,
        checkpoint_every: int = 50,
        rank: int | None = None,
        seed: int = 0,
    ) -> None:
        if not (isinstance(module, pl.LightningModule) or callable(module)):
            raise TypeError(f"module must be a LightningModule or a callable returning one, got {module!r}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if name is not None and (not name or "/" in name or os.sep in name):
            raise ValueError(f"name must be a non-empty file name without '/', got {name!r}")
        self.module = module
        self.train_dataloader = train_dataloader
        self.max_steps = max_steps
        self.name = name
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.rank = rank
        self.seed = seed
        self.stats = JobStats()

    @property
    def checkpoint_path(self) -> Path:
        if self.checkpoint_dir is None or self.name is None:
            raise RuntimeError(
                f"job {self.name!r} has no checkpoint_dir or name yet (the callback sets them)"
            )
        return self.checkpoint_dir / f"{self.name}.ckpt"

    def build(self, device: torch.device) -> JobRun:
        """Instantiate module, data and optimizer on `device` (main thread: touches no global RNG)."""
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.seed)
            module = self.module() if not isinstance(self.module, pl.LightningModule) else self.module
            if not isinstance(module, pl.LightningModule):
                raise TypeError(
                    f"job {self.name!r}: module() returned {type(module).__name__}, not a LightningModule"
                )
            loader = _resolve_loader(self.train_dataloader)
        if not module.automatic_optimization:
            raise ValueError(
                f"job {self.name!r}: {type(module).__name__} uses manual optimization; background jobs "
                "train with automatic optimization only (training_step returns the loss)"
            )
        generator = _own_generator(loader, self.seed)
        module.to(device)
        module.train()
        optimizer, schedulers = _optimizers(module, self.name)
        return JobRun(self, module, loader, generator, optimizer, schedulers, device)


class JobRun:
    """One session of a job: the built objects, the training loop and checkpoint I/O."""

    def __init__(
        self,
        job: BackgroundJob,
        module: pl.LightningModule,
        loader: Iterable[Any],
        generator: torch.Generator | None,
        optimizer: torch.optim.Optimizer,
        schedulers: list[Any],
        device: torch.device,
    ) -> None:
        self.job = job
        self.module = module
        self.loader = loader
        self.generator = generator
        self.optimizer = optimizer
        self.schedulers = schedulers
        self.device = device
        self.epoch = 0
        self.batch_in_epoch = 0
        self.epoch_generator_state: torch.Tensor | None = None
        self._piece_start = 0.0
        # On CPU a piece is timed by its thread's CPU time: one that a window's end left waiting for
        # a core or the GIL did no more work. On CUDA the wall time holds the kernels it waited for.
        self._clock = time.thread_time if device.type == "cpu" else time.perf_counter
        # Durations of the last pieces at each place in the step; the place of the running piece.
        self._durations: dict[int, deque[float]] = {}
        self._place = -1
        # The job was built on the foreground's stream: its thread's stream waits for that work.
        self.ready: Any = None
        if device.type == "cuda":
            self.ready = torch.cuda.Event()
            self.ready.record()

    # --------------------------------------------------------------------------------- thread
    def train(self, gate: Gate) -> None:
        """The thread's body: resume, train until done or stopped, checkpoint; never raises.

        On CUDA the thread creates its own lowest-priority stream and issues all its work there."""
        stats = self.job.stats
        stats.started_s = time.perf_counter()
        stats.state = "running"
        context: AbstractContextManager[Any] = nullcontext()
        stream = None
        if self.ready is not None:
            least, _ = priority_range()
            stream = torch.cuda.Stream(self.device, priority=least)
            stream.wait_event(self.ready)
            context = torch.cuda.stream(stream)
        hooks: list[Any] = []
        try:
            with context:
                self._resume()
                hooks = self._install_hooks(gate, sync=stream.synchronize if stream is not None else None)
                self._loop(gate)
            stats.state = "done"
            self.save()
        except Stopped:
            stats.state = "stopped"
            self.save()
        except Exception:
            stats.state = "failed"
            stats.error = traceback.format_exc()
        finally:
            for handle in hooks:
                handle.remove()
            stats.ended_s = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)

    def _loop(self, gate: Gate) -> None:
        stats, job = self.job.stats, self.job
        self._piece_start = self._clock()
        skip = self.batch_in_epoch
        while job.max_steps is None or stats.global_step < job.max_steps:
            if self.generator is not None and skip == 0:
                self.epoch_generator_state = self.generator.get_state()
            seen = 0
            for batch_idx, batch in enumerate(self.loader):
                seen += 1
                if batch_idx < skip:
                    continue
                self._enter(gate, step_start=True)
                self._step(gate, batch, batch_idx)
                self.batch_in_epoch = batch_idx + 1
                if stats.global_step % job.checkpoint_every == 0:
                    self.save()
                if job.max_steps is not None and stats.global_step >= job.max_steps:
                    return
            if seen == 0:
                raise ValueError(f"job {job.name!r}: the training data yielded no batches")
            skip = 0
            self.epoch += 1
            self.batch_in_epoch = 0
            for config in self.schedulers:
                if config.interval == "epoch" and self.epoch % config.frequency == 0:
                    config.scheduler.step()

    def _step(self, gate: Gate, batch: Any, batch_idx: int) -> None:
        stats = self.job.stats
        batch = move_data_to_device(batch, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        output = self.module.training_step(batch, batch_idx)
        loss = output["loss"] if isinstance(output, Mapping) else output
        if loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"training_step must return a loss tensor, a mapping with 'loss' or None; got {loss!r}"
            )
        loss.backward()
        self._enter(gate)
        self.optimizer.step()
        stats.global_step += 1
        stats.session_steps += 1
        stats.samples += _batch_size(batch)
        stats.loss = float(loss.detach())
        for config in self.schedulers:
            if config.interval == "step" and stats.global_step % config.frequency == 0:
                config.scheduler.step()

    def _enter(self, gate: Gate, *, step_start: bool = False, inside_backward: bool = False) -> None:
        """A safe point. Pieces recur in the same order every step, so the next one is expected to
        take the median of its own last few durations (unknown the first time: it may start)."""
        stats = self.job.stats

        def paused(on: bool) -> None:
            stats.state = "paused" if on else "running"

        piece_s = self._clock() - self._piece_start
        if self._place >= 0:
            recent = self._durations.setdefault(self._place, deque(maxlen=_PIECE_HISTORY))
            recent.append(piece_s)
            stats.work_s += min(recent)
        self._place = 0 if step_start else self._place + 1
        history = self._durations.get(self._place)
        expected_s = statistics.median(history) if history else 0.0
        gate.enter(piece_s, expected_s, paused, inside_backward=inside_backward)
        self._piece_start = self._clock()

    def _install_hooks(self, gate: Gate, sync: Callable[[], None] | None) -> list[Any]:
        """Safe points inside a step. On CUDA, backward runs on the autograd engine's one device
        thread that the foreground shares, so only forward pieces are gated there (each first waits
        for the previous piece: at most one submodule's kernels are queued at a time)."""

        def before_forward(module: Any, args: Any) -> None:
            if sync is not None:
                sync()
            self._enter(gate)

        def before_grad(grad: torch.Tensor) -> None:
            self._enter(gate, inside_backward=True)

        handles = [m.register_forward_pre_hook(before_forward) for m in self.module.modules()]
        if self.device.type == "cpu":
            handles += [p.register_hook(before_grad) for p in self.module.parameters() if p.requires_grad]
        return handles

    # ----------------------------------------------------------------------------- checkpoint
    def save(self) -> None:
        """Write ``<checkpoint_dir>/<name>.ckpt`` atomically, for this user only (`write_privately`)."""
        stats = self.job.stats
        checkpoint: dict[str, Any] = {
            "state_dict": self.module.state_dict(),
            "global_step": stats.global_step,
            "epoch": self.epoch,
            "pytorch-lightning_version": pl.__version__,
            "optimizer_states": [self.optimizer.state_dict()],
            "lr_schedulers": [config.scheduler.state_dict() for config in self.schedulers],
            "background": {
                "batch_in_epoch": self.batch_in_epoch,
                "epoch_generator_state": self.epoch_generator_state,
            },
        }
        if self.module.hparams:
            checkpoint["hyper_parameters"] = dict(self.module.hparams)
        self.module.on_save_checkpoint(checkpoint)
        write_privately(self.job.checkpoint_path, lambda file: torch.save(checkpoint, file))

    def _resume(self) -> None:
        """Continue from the job's checkpoint, if any: one of this user's (`open_own`), since loading
        it runs code it names."""
        try:
            file = open_own(self.job.checkpoint_path)
        except FileNotFoundError:
            return
        with file:
            checkpoint = torch.load(file, map_location=self.device, weights_only=False)
        self.module.on_load_checkpoint(checkpoint)
        self.module.load_state_dict(checkpoint["state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        for config, state in zip(self.schedulers, checkpoint["lr_schedulers"]):
            config.scheduler.load_state_dict(state)
        self.job.stats.global_step = int(checkpoint["global_step"])
        self.epoch = int(checkpoint["epoch"])
        extra = checkpoint.get("background", {})
        self.batch_in_epoch = int(extra.get("batch_in_epoch", 0))
        state = extra.get("epoch_generator_state")
        if state is not None and self.generator is not None:
            self.generator.set_state(state.cpu())
            self.epoch_generator_state = state.cpu()


def run_standalone(job: BackgroundJob, device: torch.device, gate: Gate | None = None) -> JobStats:
    """Train `job` on this thread with no foreground (a gate that is always open): its own rate."""
    gate = gate or Gate(IdleWindows(), "priority")
    job.build(device).train(gate)
    return job.stats


def _resolve_loader(source: LoaderSource) -> Iterable[Any]:
    if not isinstance(source, DataLoader | pl.LightningDataModule) and callable(source):
        source = source()
    if isinstance(source, pl.LightningDataModule):
        source.prepare_data()
        source.setup("fit")
        source = source.train_dataloader()
    if not isinstance(source, Iterable):
        raise TypeError(f"train_dataloader must give an iterable of batches, got {type(source).__name__}")
    return source


def _own_generator(loader: Iterable[Any], seed: int) -> torch.Generator | None:
    """Give the loader (and its random sampler) a generator of their own, so iterating them does not
    draw from the global RNG the foreground uses."""
    if not isinstance(loader, DataLoader):
        return None
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(seed)
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        sampler.generator = loader.generator
    return loader.generator


def _optimizers(module: pl.LightningModule, name: str | None) -> tuple[torch.optim.Optimizer, list[Any]]:
    """Parse `configure_optimizers` as Lightning does. Uses Lightning's private parsers (the one place
    we do): they accept every documented return format."""
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt

    optimizers, schedulers, monitor = _configure_optimizers(module.configure_optimizers())  # type: ignore[arg-type]
    if len(optimizers) != 1:
        raise ValueError(
            f"job {name!r}: configure_optimizers returned {len(optimizers)} optimizers; background jobs "
            "train with exactly one"
        )
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    if any(config.reduce_on_plateau for config in configs):
        raise ValueError(
            f"job {name!r}: ReduceLROnPlateau needs logged metrics, which background jobs do not have; "
            "use a scheduler that steps on its own"
        )
    return optimizers[0], configs


def _batch_size(batch: Any) -> int:
    first = next(_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    return (t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def lower_cpu_priority() -> bool:
    """Move the calling thread to Linux's SCHED_IDLE class, the CPU's counterpart of a low-priority
    stream: it runs only on cores no other thread wants. False where the OS does not allow it."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


def priority_range() -> tuple[int, int]:
    """(lowest, highest) CUDA stream priority; a static method that torch's stubs type as a method."""
    return torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
