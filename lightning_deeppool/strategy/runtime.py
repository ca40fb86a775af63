"""The burst-parallel runtime: a thin interpreter of a `Schedule`, one handler per action kind.

Forward runs each stage on ranks 0..width-1 with its inputs detached, so autograd never crosses a
stage boundary. The model's outputs come back to the ranks that hold their samples through one
autograd node whose backward walks the schedule's backward list: the same order on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from lightning_deeppool.planner.capture import CapturedGraph, ValueMeta, evaluate, propagate_meta
from lightning_deeppool.planner.layout import balanced
from lightning_deeppool.strategy.grad_sync import GradSync
from lightning_deeppool.strategy.idle import IdleWindows
from lightning_deeppool.strategy.redistribute import redistribute
from lightning_deeppool.strategy.schedule import Action, Schedule

Key = tuple[str, int]


@dataclass
class _Step:
    """State of one forward (and its backward): values and pending gradients per (value, width)."""

    counts: tuple[int, ...]
    meta: dict[str, ValueMeta]
    training: bool
    local_env: dict[str, Any]
    values: dict[Key, Any] = field(default_factory=dict)
    leaves: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    _layouts: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def layout(self, width: int) -> tuple[int, ...]:
        if width not in self._layouts:
            world = len(self.counts)
            self._layouts[width] = self.counts if width == world else balanced(sum(self.counts), width, world)
        return self._layouts[width]


class BurstRuntime:
    """Executes a captured module under a schedule on this rank."""

    def __init__(
        self,
        captured: CapturedGraph,
        schedule: Schedule,
        *,
        rank: int,
        device: torch.device,
        groups: Mapping[int, dist.ProcessGroup],
        params: Mapping[str, nn.Parameter],
        unplanned: Sequence[str] = (),
        idle: IdleWindows | None = None,
        redistribution: dist.ProcessGroup | None = None,
    ) -> None:
        self.captured = captured
        self.schedule = schedule
        self.rank = rank
        self.world_size = schedule.world_size
        self.device = device
        self.sync_gradients = True
        self.idle = idle or IdleWindows()
        self.redistribution = redistribution
        self.last_action: Action | None = None
        self._windows_in_action = 0
        uses: dict[str, int] = {}
        for names in captured.layer_params.values():
            for name in names:
                uses[name] = uses.get(name, 0) + 1
        self.grad_sync = GradSync(
            params,
            groups,
            self.world_size,
            [bucket for bucket in schedule.buckets if rank < bucket.width],
            local=[name for name, width in schedule.param_widths.items() if width == 1 and rank == 0],
            unplanned=unplanned,
            uses=uses,
            waiting=self._idle_window,
        )
        self._meta: dict[tuple[Any, ...], dict[str, ValueMeta]] = {}
        self._output = next(n for n in captured.module.graph.nodes if n.op == "output")
        self._handlers: dict[str, Callable[[_Step, Action], None]] = {
            "forward": self._forward_stage,
            "send": self._send,
            "backward": self._backward_stage,
            "send_grad": self._send_grad,
            "sync": self._sync,
            "wait": self._wait,
        }

    # ----------------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Drop-in replacement for the module's forward: same arguments, same outputs per rank."""
        env = self.captured.bind(args, kwargs)
        batch = {name: env[name] for name in self.captured.batch_inputs}
        local_env = {name: env[name] for name in self.captured.local_inputs}
        counts, meta = self._agree_on_batch(env, batch)
        step = _Step(counts, meta, torch.is_grad_enabled(), local_env)
        for name, value in batch.items():
            step.values[(name, self.world_size)] = value
        self._run(step, self.schedule.forward)
        return self._outputs(step)

    def _agree_on_batch(
        self, env: dict[str, Any], batch: dict[str, Any]
    ) -> tuple[tuple[int, ...], dict[str, ValueMeta]]:
        """All-gather local sample counts and input signatures; every rank checks the same data."""
        leaves = [
            t for value in batch.values() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
        ]
        sizes = {t.shape[0] for t in leaves}
        if len(sizes) > 1:
            raise ValueError(f"batch inputs disagree on the number of samples: {sorted(sizes)}")
        count = sizes.pop() if sizes else 0
        signature = repr([(tuple(t.shape[1:]), t.dtype) for t in leaves])
        digest = int.from_bytes(hashlib.sha1(signature.encode()).digest()[:7], "big")
        mine = torch.tensor([count, digest], dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.idle.window("agree_on_batch"):
            dist.all_gather(gathered, mine, group=self.redistribution)
        rows = [tuple(int(x) for x in t.tolist()) for t in gathered]
        if len({row[1] for row in rows}) > 1:
            raise ValueError(
                "ranks received inputs with different per-sample shapes or dtypes in the same step; "
                "deeppool moves samples between ranks, so every rank's inputs must have the same "
                f"per-sample shape (this rank: {signature})"
            )
        counts = tuple(row[0] for row in rows)
        device_type = self.device.type
        autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        key = (signature, autocast)
        if key not in self._meta:
            self._meta[key] = propagate_meta(self.captured, env)
        return counts, self._meta[key]

    def _run(self, step: _Step, actions: Sequence[Action]) -> None:
        for action in actions:
            self.last_action = action
            self._windows_in_action = 0
            with torch.profiler.record_function(f"deeppool:{action}"):
                self._handlers[action.kind](step, action)

    def _idle_window(self) -> AbstractContextManager[None]:
        """An idle window keyed by its place in the schedule, which recurs every step."""
        self._windows_in_action += 1
        return self.idle.window((self.last_action, self._windows_in_action))

    def _forward_stage(self, step: _Step, action: Action) -> None:
        stage = self.schedule.stages[action.number]
        if self.rank >= stage.width:
            return
        env = dict(step.local_env)
        for value in stage.inputs:
            env[value] = self._stage_input(step, value, stage.width)
        gm = self.captured.module
        for layer in stage.layers:
            for node in self.captured.layer_nodes[layer]:
                env[node.name] = evaluate(gm, node, env)
        produced = {name: env[name] for name in stage.outputs}
        step.outputs[stage.index] = produced
        for name, value in produced.items():
            step.values[(name, stage.width)] = value

    def _stage_input(self, step: _Step, value: str, width: int) -> Any:
        """A value as a stage reads it: detached leaves that collect its gradient, cloned so that
        in-place layers cannot touch the leaves another stage reads."""
        current = step.values[(value, width)]
        if not step.training or value in self.captured.batch_inputs:
            return current
        key = (value, width)
        if key not in step.leaves:
            step.leaves[key] = [
                t.detach().requires_grad_(t.is_floating_point()) for t in pytree.tree_leaves(current)
            ]
        flat = [t.clone() if t.requires_grad else t for t in step.leaves[key]]
        return pytree.tree_unflatten(flat, step.meta[value].spec)

    def _send(self, step: _Step, action: Action) -> None:
        src, dst = step.layout(action.src), step.layout(action.dst)
        if src[self.rank] == 0 and dst[self.rank] == 0:
            return
        local = step.values.get((action.value, action.src))
        flat = pytree.tree_leaves(local) if local is not None else None
        with torch.no_grad():
            moved = self._move(
                step.meta[action.value], flat, src, dst, [True] * len(step.meta[action.value].leaves)
            )
        if moved is not None:
            step.values[(action.value, action.dst)] = pytree.tree_unflatten(
                moved, step.meta[action.value].spec
            )

    def _move(
        self,
        meta: ValueMeta,
        flat: Sequence[torch.Tensor | None] | None,
        src: tuple[int, ...],
        dst: tuple[int, ...],
        which: Sequence[bool],
    ) -> list[Any] | None:
        """Redistribute the selected leaves of a value; unselected ones come back as None."""
        moved: list[Any] = []
        for i, leaf in enumerate(meta.leaves):
            if not which[i]:
                moved.append(None)
                continue
            local = flat[i] if flat is not None else None
            if local is not None:
                local = local.detach()
            moved.append(
                redistribute(
                    local,
                    src,
                    dst,
                    rank=self.rank,
                    sample_shape=leaf.shape,
                    dtype=leaf.dtype,
                    device=self.device,
                    waiting=self._idle_window,
                    group=self.redistribution,
                )
            )
        return moved if dst[self.rank] > 0 else None

    def _outputs(self, step: _Step) -> Any:
        names = list(dict.fromkeys(n.name for n in self._output.all_input_nodes))
        results = {name: step.values[(name, self.world_size)] for name in names}
        if step.training:
            results = self._attach_backward(step, names, results)
        return fx.node.map_arg(self._output.args[0], lambda n: results[n.name])

    def _attach_backward(self, step: _Step, names: list[str], results: dict[str, Any]) -> dict[str, Any]:
        """Route every output through one autograd node whose backward runs the schedule."""
        slots: list[tuple[str, int]] = []
        tensors: list[torch.Tensor] = []
        flats = {}
        for name in names:
            flat, spec = pytree.tree_flatten(results[name])
            flats[name] = (list(flat), spec)
            for i, t in enumerate(flat):
                if t.is_floating_point():
                    slots.append((name, i))
                    tensors.append(t.detach())
        anchor = torch.empty(0, requires_grad=True, device=self.device)
        routed = _RunBackward.apply(self, step, slots, anchor, *tensors)
        for (name, i), t in zip(slots, routed):
            flats[name][0][i] = t
        return {name: pytree.tree_unflatten(flat, spec) for name, (flat, spec) in flats.items()}

    # ---------------------------------------------------------------------------------- backward
    def backward(
        self, step: _Step, slots: Sequence[tuple[str, int]], grads: Sequence[torch.Tensor | None]
    ) -> None:
        """Walk the backward schedule, starting from the gradients of the model's outputs."""
        for (name, i), grad in zip(slots, grads):
            if grad is not None:
                _accumulate(step, (name, self.world_size), i, grad, len(step.meta[name].leaves))
        self.grad_sync.enabled = self.sync_gradients
        self.grad_sync.begin()
        self._run(step, self.schedule.backward)

    def _backward_stage(self, step: _Step, action: Action) -> None:
        stage = self.schedule.stages[action.number]
        if self.rank >= stage.width:
            return
        tensors, grads = [], []
        for name, value in step.outputs[stage.index].items():
            pending = step.grads.pop((name, stage.width), None)
            if pending is None:
                continue
            for t, g in zip(pytree.tree_leaves(value), pending):
                if g is not None and t.requires_grad:
                    tensors.append(t)
                    grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for value in stage.inputs:
            for i, leaf in enumerate(step.leaves.get((value, stage.width), ())):
                if leaf.grad is not None:
                    count = len(step.meta[value].leaves)
                    _accumulate(step, (value, stage.width), i, leaf.grad, count)
                    leaf.grad = None

    def _send_grad(self, step: _Step, action: Action) -> None:
        src, dst = step.layout(action.dst), step.layout(action.src)
        if src[self.rank] == 0 and dst[self.rank] == 0:
            return
        meta = step.meta[action.value]
        floating = [leaf.dtype.is_floating_point for leaf in meta.leaves]
        pending = step.grads.pop((action.value, action.dst), None)
        flat: list[torch.Tensor | None] | None = None
        if src[self.rank] > 0:
            flat = [
                (
                    g
                    if g is not None
                    else torch.zeros((src[self.rank], *leaf.shape), dtype=leaf.dtype, device=self.device)
                )
                if floating[i]
                else None
                for i, (leaf, g) in enumerate(zip(meta.leaves, pending or [None] * len(meta.leaves)))
            ]
        moved = self._move(meta, flat, src, dst, floating)
        if moved is not None:
            for i, grad in enumerate(moved):
                if grad is not None:
                    _accumulate(step, (action.value, action.src), i, grad, len(meta.leaves))

    def _sync(self, step: _Step, action: Action) -> None:
        self.grad_sync.launch_through(self.schedule.buckets[action.number])

    def _wait(self, step: _Step, action: Action) -> None:
        self.grad_sync.finish()

    def close(self) -> None:
        """Detach from the module: remove gradient hooks."""
        self.grad_sync.close()


def _accumulate(step: _Step, key: Key, index: int, grad: torch.Tensor, count: int) -> None:
    pending = step.grads.setdefault(key, [None] * count)
    current = pending[index]
    pending[index] = grad if current is None else current + grad


class _RunBackward(torch.autograd.Function):
    """Identity on the outputs; its backward is the whole burst-parallel backward."""

    @staticmethod
    def forward(
        ctx: Any,
        runtime: BurstRuntime,
        step: _Step,
        slots: list[tuple[str, int]],
        anchor: torch.Tensor,
        *outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.runtime, ctx.step, ctx.slots = runtime, step, slots
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.runtime.backward(ctx.step, ctx.slots, grads)
        ctx.step = None
        return (None,) * (4 + len(grads))
