"""The burst-parallel runtime: a thin interpreter of a `Schedule`, one handler per action kind.

Forward runs each stage on its ranks with its inputs detached, so autograd never crosses a
stage boundary. The model's outputs come back to the ranks that hold their samples through one
autograd node whose backward walks the schedule's backward list: the same order on every rank. That
node also returns the gradients of the forward's tensor arguments when they require grad (trainable
code before the planned module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from lightning_deeppool.capture import CapturedGraph, ValueMeta
from lightning_deeppool.capture.graph import preserved, value_meta
from lightning_deeppool.capture.trace import data_dependent_shape
from lightning_deeppool.capture.values import LeafMeta, rows_view, samples_view
from lightning_deeppool.comm.messages import GroupMessages, Messages
from lightning_deeppool.ir.placement import Layout, Placement
from lightning_deeppool.ir.rows import SPLIT_DIM
from lightning_deeppool.lowering.schedule import Action, Schedule, Stage
from lightning_deeppool.runtime.call import Call, Row, check, new_shape, prepare, shape_groups
from lightning_deeppool.runtime.grad_sync import GradSync
from lightning_deeppool.runtime.idle import ScheduleWindows
from lightning_deeppool.runtime.redistribute import block_of_whole, redistribute
from lightning_deeppool.runtime.shared_batch import gather_batch, keep_share
from lightning_deeppool.spatial.layer import run_layer_split
from lightning_deeppool.spatial.part import SpatialPart

Key = tuple[str, Placement]


@dataclass
class _CallState:
    """State of one forward (and its backward): values and pending gradients per (value, placement)."""

    counts: tuple[int, ...]
    meta: dict[str, ValueMeta]
    training: bool
    scalars: dict[str, Any]
    input_grads: dict[str, bool]
    whole: dict[str, torch.Tensor]  # a shared batch's inputs, as every rank read them
    accumulate: bool = True  # whether backward accumulates into parameters (not torch.autograd.grad)
    values: dict[Key, Any] = field(default_factory=dict)
    leaves: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] | None = None  # the graph's buffers as the call found them, if kept
    _layouts: dict[Placement, Layout] = field(default_factory=dict)  # shared by calls of these counts

    def layout(self, placement: Placement) -> Layout:
        """Who holds what under `placement`; at the full width, the samples each rank brought."""
        if placement not in self._layouts:
            world = len(self.counts)
            self._layouts[placement] = (
                Layout(self.counts, 1, world)
                if placement == Placement(world)
                else Layout.of(placement, sum(self.counts), world)
            )
        return self._layouts[placement]


class BurstRuntime:
    """Executes a captured module under a schedule on this rank."""

    def __init__(
        self,
        captured: CapturedGraph,
        schedule: Schedule,
        *,
        rank: int,
        device: torch.device,
        grad_sync: GradSync,
        windows: ScheduleWindows | None = None,
        redistribution: dist.ProcessGroup | None = None,
        messages: Messages | None = None,
        shared: bool = False,
    ) -> None:
        self.captured = captured
        self.schedule = schedule
        self.rank = rank
        self.world_size = schedule.world_size
        self.device = device
        self.grad_sync = grad_sync
        self.windows = windows or ScheduleWindows()
        self.redistribution = redistribution
        # Point-to-point moves, the spatial layers' exchanges and a shared batch's gathers.
        self.messages = messages or GroupMessages(redistribution)
        self.home = Placement(self.world_size)
        self.shared = shared
        self._breaks = {layer.name for layer in captured.graph.layers if layer.own_samples}
        self.keep_last_step = False
        self.last_step: _CallState | None = None
        self.running: Action | None = None  # the action a failure stopped the schedule at, if any
        self._last_pass = False
        self.overlap = True  # buckets may launch during backward (its schedule's are the synchronisation's)
        self._meta: dict[tuple[Any, ...], dict[str, ValueMeta]] = {}
        self._layouts: dict[tuple[int, ...], dict[Placement, Layout]] = {}  # per counts, as steps repeat
        self._stage_params = [  # each once, as a hook fires once per gradient
            list(dict.fromkeys(p for layer in stage.layers for p in captured.layer_params.get(layer, ())))
            for stage in schedule.stages
        ]
        self._handlers: dict[str, Callable[[_CallState, Action], None]] = {
            "forward": self._forward_stage,
            "send": self._send,
            "backward": self._backward_stage,
            "send_grad": self._send_grad,
            "sync": self._sync,
            "wait": self._wait,
        }

    # ----------------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Drop-in replacement for the module's forward: same arguments, same outputs per rank.
        Collective: every rank must call it (the strategy makes sure of that)."""
        call = self.prepare(args, kwargs)
        return self.run(call, self.exchange(call.row))

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        """This rank's part of a call, and the row it shows the other ranks (not collective)."""
        return prepare(self.captured, args, kwargs, shared=self.shared)

    def exchange(self, row: Row) -> list[Row]:
        """Every rank's row of the same call, by an all-gather (collective)."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.windows.idle.window("agree_on_batch"):
            dist.all_gather(gathered, mine, group=self.redistribution)
        return [Row(*t.tolist()) for t in gathered]

    def fits(self, call: Call, rows: Sequence[Sequence[int]]) -> bool:
        """False where every rank's row agrees on a call that needs another graph than this runtime's
        (other per-sample shapes, or other module values read by forward; the same answer on every
        rank): the call needs the graph captured for it."""
        return not new_shape(call, rows, self.captured)

    def for_shape(self, captured: CapturedGraph, schedule: Schedule) -> BurstRuntime:
        """A runtime for the same plan's graph captured at other per-sample shapes, sharing this one's
        gradient synchronisation, links and idle windows."""
        return BurstRuntime(
            captured,
            schedule,
            rank=self.rank,
            device=self.device,
            grad_sync=self.grad_sync,
            windows=self.windows,
            redistribution=self.redistribution,
            messages=self.messages,
            shared=self.shared,
        )

    def run(self, call: Call, rows: Sequence[Sequence[int]]) -> Any:
        """Run a prepared call, given every rank's row of it (raises on every rank if one cannot run).
        Every rank's batch has this runtime's per-sample shapes (else `run_shapes`)."""
        counts = check(call, rows, shared=self.shared)
        if len(shape_groups(rows)) > 1 or call.row.shapes != self.captured.key:
            raise ValueError(
                f"deeppool: a call at per-sample shapes {call.samples} reached the runtime of the graph "
                f"captured at {self.captured.samples}; please report this to lightning-deeppool"
            )
        return self._outputs(self.start(call, counts))

    def start(self, call: Call, counts: tuple[int, ...]) -> _CallState:
        """Run the forward schedule of a call in which the ranks hold `counts` samples."""
        batch = call.batch
        key = (
            call.signature,
            torch.is_autocast_enabled(self.device.type),
            torch.get_autocast_dtype(self.device.type),
        )
        if key not in self._meta:
            self._meta[key] = self._propagate_meta(batch, call.scalars)
        whole = batch if self.shared else {}
        if self.shared:
            batch = {name: keep_share(t, counts, self.rank) for name, t in batch.items()}
        self.grad_sync.track_new_parameters()
        step = _CallState(
            counts,
            self._meta[key],
            torch.is_grad_enabled(),
            call.scalars,
            call.input_grads,
            whole,
            _layouts=self._layouts.setdefault(counts, {}),
        )
        for name, value in batch.items():
            step.values[(name, self.home)] = value
        if self.keep_last_step:  # the first call's check evaluates each layer from the same buffers
            step.buffers = {name: b.detach().clone() for name, b in self.captured.module.named_buffers()}
        self._run(step, self.schedule.forward)
        self.last_step = step if self.keep_last_step else None
        return step

    def _propagate_meta(
        self, batch: dict[str, torch.Tensor], scalars: dict[str, Any]
    ) -> dict[str, ValueMeta]:
        """Per-sample structure of every value under the current autocast state (which decides
        dtypes), from two all-zero samples so every rank gets the same answer; where graph breaks run
        Python on the data (a length taken from a mask, which zeros would make 0), from two of this
        rank's own samples: a break's outputs keep the per-sample structure the capture saw whatever
        the data (`check_break_output`), so every rank's answer is the same too."""
        if self.captured.breaks and all(len(t) for t in batch.values()):
            two = {name: t[torch.arange(2, device=t.device) % len(t)] for name, t in batch.items()}
        else:
            two = {name: t.new_zeros((2, *t.shape[1:])) for name, t in batch.items()}
        with torch.no_grad(), preserved(self.captured.module, self.device):
            values = self.captured.run_all(two, 2, scalars)
        meta = dict(self.captured.meta)
        for layer in self.captured.graph.layers:
            known = self.captured.meta[layer.name]
            rows = [leaf.rows for leaf in known.leaves]
            meta[layer.name] = value_meta(values[layer.name], known.per_rank, rows)
        return meta

    def _run(self, step: _CallState, actions: Sequence[Action]) -> None:
        # Labels only under a profiler: at microseconds of work per layer, making one costs as much.
        profiling = torch.autograd._profiler_enabled()
        for action in actions:
            self.windows.enter(action)
            self.running = action
            if profiling:
                with torch.profiler.record_function(f"deeppool:{action}"):
                    self._handlers[action.kind](step, action)
            else:
                self._handlers[action.kind](step, action)
        self.running = None

    def _forward_stage(self, step: _CallState, action: Action) -> None:
        stage = self.schedule.stages[action.number]
        samples = step.layout(stage.placement).samples(self.rank)
        if self.rank not in stage.ranks or not samples:  # none: a run at another rank's shapes
            return
        values = {value: self._stage_input(step, value, stage.placement) for value in stage.inputs}
        if stage.placement.spatial == 1:
            values.update(
                self.captured.run_layers(stage.layers, stage.outputs, values, samples, step.scalars)
            )
        else:
            self._run_split(step, stage, values, samples)
        broken = self._breaks.intersection(stage.layers) if self._breaks else set()
        for name in stage.outputs if broken else ():
            check_break_output(sorted(broken), values[name], step.meta[name])
        produced = {name: values[name] for name in stage.outputs}
        step.outputs[stage.index] = produced
        for name, value in produced.items():
            step.values[(name, stage.placement)] = value

    def _run_split(self, step: _CallState, stage: Stage, values: dict[str, Any], samples: int) -> None:
        """A stage's layers on this rank's rows of its sample group's samples."""
        ranks, index = step.layout(stage.placement).part(self.rank)
        part = SpatialPart(ranks, index, self.messages)
        sizes = {}
        for value in stage.inputs:
            nodes = self.captured.code[value].outputs if value in self.captured.code else (value,)
            sizes.update(
                {node: leaf.shape[SPLIT_DIM - 1] for node, leaf in zip(nodes, step.meta[value].leaves)}
            )
        for layer in stage.layers:
            values[layer], split = run_layer_split(
                self.captured, layer, values, samples, step.scalars, part, sizes
            )
            sizes.update(split)

    def _stage_input(self, step: _CallState, value: str, placement: Placement) -> Any:
        """A value as a stage reads it: detached leaves that collect its gradient, cloned so that
        in-place layers cannot touch the leaves another stage reads."""
        current = step.values[(value, placement)]
        if not step.training or (value in step.input_grads and not step.input_grads[value]):
            return current
        key = (value, placement)
        if key not in step.leaves:
            step.leaves[key] = [
                t.detach().requires_grad_(t.is_floating_point()) for t in pytree.tree_leaves(current)
            ]
        flat = [t.clone() if t.requires_grad else t for t in step.leaves[key]]
        return pytree.tree_unflatten(flat, step.meta[value].spec)

    def _send(self, step: _CallState, action: Action) -> None:
        src, dst = step.layout(action.src), step.layout(action.dst)
        meta = step.meta[action.value]
        if action.value in step.whole and action.src == self.home:  # every rank holds it: no message
            leaf = meta.leaves[0]
            part = block_of_whole(samples_view(step.whole[action.value], leaf), dst, self.rank, leaf.shape)
            if part is not None:
                step.values[(action.value, action.dst)] = rows_view(part, leaf)
            return
        if src.samples(self.rank) == 0 and dst.samples(self.rank) == 0:
            return
        held = step.values.get((action.value, action.src))
        flat = pytree.tree_leaves(held) if held is not None else None
        with torch.no_grad():
            moved = self._move(meta, flat, src, dst, [True] * len(meta.leaves))
        if moved is not None:
            step.values[(action.value, action.dst)] = pytree.tree_unflatten(moved, meta.spec)

    def _move(
        self,
        meta: ValueMeta,
        flat: Sequence[torch.Tensor | None] | None,
        src: Layout,
        dst: Layout,
        which: Sequence[bool],
    ) -> list[Any] | None:
        """Redistribute the selected leaves of a value; unselected ones come back as None."""
        moved: list[Any] = []
        for i, leaf in enumerate(meta.leaves):
            if not which[i]:
                moved.append(None)
                continue
            held = flat[i] if flat is not None else None
            if held is not None:
                held = samples_view(held.detach(), leaf)
            result = redistribute(
                held,
                src,
                dst,
                rank=self.rank,
                sample_shape=leaf.shape,
                dtype=leaf.dtype,
                device=self.device,
                waiting=self.windows.window,
                messages=self.messages,
            )
            moved.append(rows_view(result, leaf) if result is not None else None)
        return moved if dst.samples(self.rank) > 0 else None

    def _outputs(self, step: _CallState) -> Any:
        results = self._results(step)
        if step.training:
            [results] = _attach_backward([(self, step, results)])
        if not self.shared:
            return self.captured.forward_outputs(results, step.counts[self.rank], step.scalars)
        whole = {name: self._gather(step, name, value) for name, value in results.items()}
        return self.captured.forward_outputs(whole, sum(step.counts), step.scalars)

    def _gather(self, step: _CallState, name: str, value: Any) -> Any:
        """The whole shared batch of a value, from every rank's share."""
        flat, spec = pytree.tree_flatten(value)
        leaves = iter(step.meta[name].leaves)  # one per tensor, in order

        def whole(t: torch.Tensor) -> torch.Tensor:
            rows = next(leaves).rows
            counts = tuple(c * rows for c in step.counts)
            return gather_batch(t, counts, self.messages)

        return pytree.tree_unflatten([whole(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)

    def _results(self, step: _CallState) -> dict[str, Any]:
        """The forward's outputs as this rank holds them at the full width."""
        return {name: self._held(step, name) for name in self.captured.graph.outputs}

    def _held(self, step: _CallState, name: str) -> Any:
        """A value at the full width; a rank holding no samples gets empty tensors."""
        if (name, self.home) not in step.values:
            meta = step.meta[name]
            empty = [
                torch.empty(leaf.tensor_shape(0), dtype=leaf.dtype, device=self.device)
                for leaf in meta.leaves
            ]
            step.values[(name, self.home)] = pytree.tree_unflatten(empty, meta.spec)
        return step.values[(name, self.home)]

    # ---------------------------------------------------------------------------------- backward
    def expect_last_pass(self, last: bool) -> None:
        """Whether the next backward pass is the step's last before its gradients are synchronized:
        only then may buckets launch during backward (nothing can be added to them after)."""
        self._last_pass = last

    def backward(
        self,
        step: _CallState,
        slots: Sequence[tuple[str, int]],
        grads: Sequence[torch.Tensor | None],
        accumulate: bool = True,
    ) -> None:
        """Walk the backward schedule, starting from the gradients of the model's outputs. Without
        `accumulate` (``torch.autograd.grad``), only the inputs' gradients are computed: parameters'
        ``.grad`` stay as they are."""
        for (name, i), grad in zip(slots, grads):
            if grad is not None:
                _accumulate(step, (name, self.home), i, grad, len(step.meta[name].leaves))
        step.accumulate = accumulate
        self.grad_sync.arm(self._last_pass and accumulate and self.overlap)
        self._last_pass = False
        self._run(step, self.schedule.backward)

    def _backward_stage(self, step: _CallState, action: Action) -> None:
        stage = self.schedule.stages[action.number]
        if self.rank not in stage.ranks:
            return
        if not step.layout(stage.placement).samples(self.rank):  # forward skipped it here
            if step.accumulate:
                self.grad_sync.add_zeros(self._stage_params[stage.index])
            return
        tensors, grads = [], []
        for name, value in step.outputs.get(stage.index, {}).items():
            pending = step.grads.pop((name, stage.placement), None)
            if pending is None:
                continue
            for t, g in zip(pytree.tree_leaves(value), pending):
                if g is not None and t.requires_grad:
                    tensors.append(t)
                    grads.append(g)
        leaves = [
            (value, i, leaf)
            for value in stage.inputs
            for i, leaf in enumerate(step.leaves.get((value, stage.placement), ()))
        ]
        if tensors and step.accumulate:
            with self.grad_sync.in_stage():
                torch.autograd.backward(tensors, grads)
            found = [leaf.grad for _, _, leaf in leaves]
        elif tensors:
            wanted = [leaf for _, _, leaf in leaves if leaf.requires_grad]
            computed = iter(torch.autograd.grad(tensors, wanted, grads, allow_unused=True) if wanted else ())
            found = [next(computed) if leaf.requires_grad else None for _, _, leaf in leaves]
        else:
            found = [None] * len(leaves)
        for (value, i, leaf), grad in zip(leaves, found):
            if grad is not None:
                _accumulate(step, (value, stage.placement), i, grad, len(step.meta[value].leaves))
            leaf.grad = None

    def _send_grad(self, step: _CallState, action: Action) -> None:
        if action.value in step.input_grads and not step.input_grads[action.value]:
            return
        src, dst = step.layout(action.dst), step.layout(action.src)
        if src.samples(self.rank) == 0 and dst.samples(self.rank) == 0:
            return
        meta = step.meta[action.value]
        floating = [leaf.dtype.is_floating_point for leaf in meta.leaves]
        pending = step.grads.pop((action.value, action.dst), None)
        flat = None
        if src.samples(self.rank) > 0:
            flat = [
                self._grad_or_zeros(leaf, grad, src) if is_float else None
                for leaf, grad, is_float in zip(meta.leaves, pending or [None] * len(meta.leaves), floating)
            ]
        moved = self._move(meta, flat, src, dst, floating)
        if moved is not None:
            for i, grad in enumerate(moved):
                if grad is not None:
                    _accumulate(step, (action.value, action.src), i, grad, len(meta.leaves))

    def _grad_or_zeros(self, leaf: LeafMeta, grad: torch.Tensor | None, layout: Layout) -> torch.Tensor:
        """A leaf's gradient as this rank holds it under `layout`; zeros where no layer gave one."""
        if grad is not None:
            return grad
        return torch.zeros(_held_shape(leaf, layout, self.rank), dtype=leaf.dtype, device=self.device)

    def _sync(self, step: _CallState, action: Action) -> None:
        self.grad_sync.launch_through(self.schedule.buckets[action.number])

    def _wait(self, step: _CallState, action: Action) -> None:
        """End of the backward schedule; gradients are synchronized when the step asks for it."""

    def input_grad(self, step: _CallState, name: str) -> torch.Tensor | None:
        pending = step.grads.pop((name, self.home), None)
        return pending[0] if pending else None

    def close(self) -> None:
        """Detach from the module: remove gradient hooks, close the local links."""
        self.grad_sync.close()
        self.messages.close()


def run_shapes(parts: Sequence[tuple[BurstRuntime, Call, tuple[int, ...]]], mine: int) -> Any:
    """A call whose ranks' batches have different per-sample shapes: the plan runs once per shape, on
    that shape's runtime, with the samples of the ranks whose batches have it (`counts`; none on the
    others), in the same order on every rank; one backward node walks every run's backward in that
    order. Returns this rank's outputs: those of run `mine`, at its own shapes."""
    steps = [runtime.start(call, counts) for runtime, call, counts in parts]
    results = [runtime._results(step) for (runtime, _, _), step in zip(parts, steps)]
    if steps[mine].training:
        results = _attach_backward(
            [(runtime, step, r) for (runtime, _, _), step, r in zip(parts, steps, results)]
        )
    runtime, _, counts = parts[mine]
    return runtime.captured.forward_outputs(results[mine], counts[runtime.rank], steps[mine].scalars)


@dataclass
class _Routed:
    """One run's share of the backward node: its runtime and state, the (value, leaf) of each of its
    outputs the node routes, and its inputs whose gradients the node returns."""

    runtime: BurstRuntime
    step: _CallState
    slots: list[tuple[str, int]]
    inputs: list[str]


def _attach_backward(runs: Sequence[tuple[BurstRuntime, _CallState, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Route every run's floating-point outputs through one autograd node whose backward runs their
    schedules' backward, run by run."""
    routed, tensors, flats = [], [], []
    for runtime, step, results in runs:
        slots, outputs, flat_run = [], [], {}
        for name, value in results.items():
            flat, spec = pytree.tree_flatten(value)
            flat_run[name] = (list(flat), spec)
            for i, t in enumerate(flat):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    slots.append((name, i))
                    outputs.append(t.detach())
        inputs = [name for name, wanted in step.input_grads.items() if wanted]
        routed.append(_Routed(runtime, step, slots, inputs))
        tensors += [step.values[(name, runtime.home)] for name in inputs] + outputs
        flats.append(flat_run)
    anchor = torch.empty(0, requires_grad=True, device=runs[0][0].device)
    through = iter(_RunBackward.apply(routed, anchor, *tensors))
    for run, flat_run in zip(routed, flats):
        for name, i in run.slots:
            flat_run[name][0][i] = next(through)
    return [{name: pytree.tree_unflatten(flat, spec) for name, (flat, spec) in f.items()} for f in flats]


def _held_shape(leaf: LeafMeta, layout: Layout, rank: int) -> tuple[int, ...]:
    """Shape of what `rank` holds of a leaf under `layout` (its rows only, when rows are split)."""
    shape = leaf.tensor_shape(layout.samples(rank))
    if layout.spatial == 1:
        return shape
    rows = layout.block(rank, leaf.shape[SPLIT_DIM - 1]).rows
    return (*shape[:SPLIT_DIM], rows, *shape[SPLIT_DIM + 1 :])


def _accumulate(step: _CallState, key: Key, index: int, grad: torch.Tensor, count: int) -> None:
    pending = step.grads.setdefault(key, [None] * count)
    current = pending[index]
    pending[index] = grad if current is None else current + grad


def _accumulates(ctx: Any) -> bool:
    """Whether the running backward accumulates into leaves (``.backward()``) or only computes the
    gradients it was asked for (``torch.autograd.grad``): the engine runs the anchor's accumulator
    only in the first case."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    node = next(
        (
            fn
            for fn, _ in ctx.next_functions
            if fn is not None and getattr(fn, "variable", None) is ctx.anchor
        ),
        None,
    )
    return True if will_execute is None or node is None else bool(will_execute(node))


class _RunBackward(torch.autograd.Function):
    """Identity on the runs' outputs; its backward is the whole burst-parallel backward of each run,
    and returns the gradients of the runs' inputs that require them. `tensors` holds, run by run, its
    inputs then its outputs."""

    @staticmethod
    def forward(
        ctx: Any, routed: list[_Routed], anchor: torch.Tensor, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.routed, ctx.anchor = routed, anchor
        outputs, offset = [], 0
        for run in routed:
            offset += len(run.inputs)
            outputs += [t.clone() for t in tensors[offset : offset + len(run.slots)]]
            offset += len(run.slots)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.routed is None:
            raise RuntimeError(
                "deeppool: a second backward through the same planned forward (retain_graph=True) is not "
                "supported; run the forward again for each backward"
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "deeppool: double backward (create_graph=True) through the planned forward is not supported"
            )
        accumulate = _accumulates(ctx)
        returned: list[torch.Tensor | None] = []
        offset = 0
        for run in ctx.routed:
            run.runtime.backward(run.step, run.slots, grads[offset : offset + len(run.slots)], accumulate)
            returned += [run.runtime.input_grad(run.step, name) for name in run.inputs]
            returned += [None] * len(run.slots)
            offset += len(run.slots)
        ctx.routed = None
        return (None, None, *returned)


def check_break_output(breaks: list[str], value: Any, meta: ValueMeta) -> None:
    """Raise where `value`, an output of a stage that runs graph breaks (the layers `breaks`), lost the
    per-sample structure (`meta`) by which the plan moves it and the layers after it were captured:
    code run as Python may compute it from the data, which a plan cannot follow."""
    rows = [leaf.rows for leaf in meta.leaves]
    found = value_meta(value, meta.per_rank, rows)
    if found != meta:
        shapes = [leaf.shape for leaf in found.leaves]
        expected = [leaf.shape for leaf in meta.leaves]
        raise RuntimeError(data_dependent_shape(", ".join(map(repr, breaks)), shapes, expected))
