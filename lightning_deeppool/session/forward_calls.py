"""Every call of the planned module's forward under the strategy, and the step state it implies.

Inside a training step, a call every rank makes (`CallAgreement`) runs the plan; the first one installs
it. Any other call (a callback, a hook, validation, a call only some ranks make) runs the module's own
forward on the rank that makes it. Rank 0 holds every parameter up to date; another rank holds only the
layers it runs, so it refuses such a call once its other layers are stale (until validation or the end
of fit refreshes them), and refuses to backpropagate through one into layers it does not hold.

A data-parallel plan (every layer on every rank) runs as DDP does once installed: every call is the
module's own forward on this rank's samples (compiled, where the layers would have been), with no call
to agree on, and the gradient buckets launch from the backward's own accumulation hooks. The ranks
still meet where each step ends and before Lightning's collectives, so that one some ranks skip stops
every rank rather than hanging.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_deeppool.comm.fail_together import on_rank_zero
from lightning_deeppool.install import InstalledPlan
from lightning_deeppool.runtime.call import Call, Row, check, shape_groups, without_samples
from lightning_deeppool.runtime.runtime import BurstRuntime, run_shapes
from lightning_deeppool.runtime.verify import first_difference
from lightning_deeppool.session.call_agreement import CallAgreement, call_site
from lightning_deeppool.session.modules import (
    own_forward,
    replace_forward,
    restore_forward,
    sync_buffers,
    sync_module_states,
)
from lightning_deeppool.session.plan_session import PlanSession


class ForwardCalls:
    """Replaces `target.forward` on this rank (see the module docstring) until `close`."""

    def __init__(
        self,
        session: PlanSession,
        target: nn.Module,
        agreement: CallAgreement | None,
        opens_step: Callable[[], bool] | None = None,
    ) -> None:
        """`opens_step`, where given, says whether a call made outside a step opens one (a loop of the
        user's own, whose steps end where the front door calls `end_step`); without it, only
        `training_step` opens steps."""
        self.session = session
        self.target = target
        self.agreement = agreement
        self.opens_step = opens_step
        self.in_training_step = False
        self.stale = False  # this rank's copies of layers it does not run are out of date
        self.stale_anywhere = False  # some rank's are: a refresh is due (the same on every rank)
        self._pending = 0  # planned calls with gradients since the last backward
        self._verified: set[BurstRuntime] = set()  # the runtimes whose first call was checked

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self(args, kwargs)

        self._original = replace_forward(target, forward)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.in_training_step:
            if self.opens_step is None or not self.opens_step():
                return self._unplanned(args, kwargs)
            self.begin_step()
        installation = self.session.installed
        if installation is not None and installation.data_parallel:
            with self.session.step_times.work():
                installation.grad_sync.track_new_parameters()
                outputs = self._data_parallel_forward(*args, **kwargs)
            if torch.is_grad_enabled():
                self._pending += 1
            return self._timed_backward(outputs)
        if self.agreement is None:  # a rank alone (one device): every call of its training step is planned
            with self.session.step_times.work():
                return self._timed_backward(self._planned(args, kwargs))
        # Once installed, a call's rows travel with the agreement: no collective before it runs.
        with self.session.step_times.work():
            call = installation.runtime.prepare(args, kwargs) if installation is not None else None
            rows = self.agreement.agree(call_site(), call.row if call is not None else ())
            if rows is not None:
                return self._timed_backward(self._planned(args, kwargs, call, rows))
        return self._unplanned(args, kwargs)

    @functools.cached_property
    def _data_parallel_forward(self) -> Callable[..., Any]:
        """The module's own forward, through the compiler its layers would run through: a data-parallel
        plan runs no layers, and the user's compilation is not dropped."""
        compiler = self.session.fit.compiler
        return compiler(self._original) if compiler is not None else self._original

    def _timed_backward(self, outputs: Any) -> Any:
        """The backward's work starts where the gradients reach these outputs (`StepTimes.backward`)."""
        if torch.is_grad_enabled():
            reached = self.session.step_times.outputs_reached
            for t in pytree.tree_leaves(outputs):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _: reached())
        return outputs

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """The ranks meet where each training step ends, under every plan: a collective some rank
        issued in the step and another did not stops every rank there, before the gradients' sums."""
        self.begin_step()
        try:
            yield
        except BaseException:
            self.in_training_step = False  # no meeting: the others may be meeting elsewhere, or gone
            raise
        self.end_step()

    def begin_step(self) -> None:
        if self.agreement is not None:
            self.agreement.begin_step()
        self.in_training_step = True

    def end_step(self) -> None:
        """This rank makes no more planned calls in the step: it meets the others where it ends."""
        if not self.in_training_step:
            return
        self.in_training_step = False
        if self.agreement is not None:
            self.agreement.end_step()

    # ---------------------------------------------------------------------------------- calls
    def _planned(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Call | None = None,
        rows: Sequence[Sequence[int]] = (),
    ) -> Any:
        installation = self.session.installed
        if installation is None:
            with own_forward(self.target):
                installation = self.session.install(self.target, args, kwargs)
        if call is None:  # the installing call, or a rank alone: no row has travelled yet
            call = installation.runtime.prepare(args, kwargs)
            rows = installation.runtime.exchange(call.row)
        if len(shape_groups(rows)) > 1:
            return self._at_shapes(installation, call, rows, args, kwargs)
        if not installation.runtime.fits(call, rows):
            call = self._at_shape(installation, call.row.shapes, args, kwargs)
        runtime = installation.runtime
        runtime.keep_last_step = runtime not in self._verified
        outputs = runtime.run(call, rows)
        if torch.is_grad_enabled():
            self._pending += 1
        self._verify_first(runtime, args, kwargs)
        return self._run_hooks(runtime, outputs)

    def _at_shape(
        self, installation: InstalledPlan, key: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Call:
        """The call, prepared for the graph captured for its `key` (its per-sample shapes and the module
        values forward reads; captured now, on every rank, where none was): the plan is kept. Collective
        when it captures."""
        if not installation.use_graph(key):
            with own_forward(self.target):
                self.session.capture_shape(installation, self.target, args, kwargs)
        return installation.runtime.prepare(args, kwargs)

    def _at_shapes(
        self,
        installation: InstalledPlan,
        call: Call,
        rows: Sequence[Sequence[int]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A call whose ranks' batches have different per-sample shapes (each rank padded to its own
        longest sequence, say): the plan runs once per shape (`run_shapes`), each shape's graph captured
        once on every rank, from the arguments of the lowest rank whose batch has it. Collective."""
        counts = check(call, rows, shared=installation.runtime.shared)
        rank = self.session.fit.rank
        parts: list[tuple[BurstRuntime, Call, tuple[int, ...]]] = []
        mine = 0
        for ranks in shape_groups(rows):
            shapes = Row(*rows[ranks[0]]).shapes
            runtime = installation.runtime_at(shapes)
            if runtime is None:
                with own_forward(self.target):
                    self.session.capture_shape(installation, self.target, args, kwargs, src=ranks[0])
                runtime = installation.runtime
            if rank in ranks:
                mine = len(parts)
                part = runtime.prepare(args, kwargs)
            else:
                part = without_samples(runtime.captured, call, runtime.device)
            parts.append((runtime, part, tuple(n if r in ranks else 0 for r, n in enumerate(counts))))
        per_rank = [layer.name for layer in parts[0][0].captured.graph.layers if layer.per_rank]
        if per_rank:
            raise ValueError(
                f"deeppool: the ranks' batches have different per-sample shapes, and the planned forward "
                f"reduces over each rank's samples in {per_rank[:3]} (a loss inside forward), which a run "
                "per shape cannot give. Pad every rank's batch to the same length, or compute the loss "
                "outside the planned module"
            )
        first = parts[0][0]  # rank 0's shapes: it checks their first run
        first.keep_last_step = first not in self._verified
        outputs = run_shapes(parts, mine)
        if torch.is_grad_enabled():
            self._pending += len(parts)  # several passes: no bucket launches before the step's sync
        self._verify_first(first, args, kwargs)
        return self._run_hooks(parts[mine][0], outputs)

    def _run_hooks(self, runtime: BurstRuntime, outputs: Any) -> Any:
        """Forward's own outputs; first, the forward hooks of the submodules whose outputs the runtime's
        graph returns too are called with them (this rank's samples, autograd intact), as the module's
        call would."""
        hooked = runtime.captured.hooked
        if not hooked:
            return outputs
        outputs, kept = outputs
        for path, value in zip(hooked, kept):
            module = self.target.get_submodule(path)
            for key, hook in list(module._forward_hooks.items()):
                with_kwargs = key in module._forward_hooks_with_kwargs
                result = hook(module, (), {}, value) if with_kwargs else hook(module, (), value)
                if result is not None:
                    raise RuntimeError(
                        f"deeppool: a forward hook on {path!r} returned a value to replace the module's "
                        "output, which the plan cannot do (it runs the captured graph, not the module's "
                        "call). Return None from the hook, or apply the change in forward"
                    )
        return outputs

    def _verify_first(self, runtime: BurstRuntime, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Once per captured graph, on its first planned call: rank 0 compares every layer with one
        device's values (`runtime` ran rank 0's samples)."""
        if runtime in self._verified:
            return
        self._verified.add(runtime)
        step, runtime.last_step = runtime.last_step, None
        captured = runtime.captured
        message = on_rank_zero(lambda: first_difference(captured, step, captured.bind(args, kwargs)))
        if message is not None:
            raise RuntimeError(f"deeppool: the installed plan does not reproduce the model: {message}")

    def _unplanned(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        installation = self.session.installed
        rank = self.session.fit.rank
        if installation is None or installation.owns_everything(rank):
            return self._original(*args, **kwargs)
        if self.stale:
            raise RuntimeError(
                f"deeppool: rank {rank} called {type(self.target).__name__}.forward outside the planned "
                "calls of the training step (in a callback or hook, or in a call only some ranks make). "
                f"Rank {rank} updates only the layers it runs, so its copy of the others is out of date "
                "until the next refresh: validation or the end of fit under the Trainer, model.eval() "
                "(on every rank) under Fabric. Make that call on rank 0 (`if trainer.is_global_zero:`), "
                "which holds every parameter, or in validation_step (after model.eval() under Fabric), or "
                "set DeepPoolStrategy(current_weights=True) to keep every rank's copy current"
            )
        outputs = self._original(*args, **kwargs)
        if not torch.is_grad_enabled():
            return outputs
        message = (
            f"deeppool: rank {rank} called {type(self.target).__name__}.forward alone (the other ranks did "
            "not make this call) and backpropagated through it, into layers this rank does not hold: their "
            "gradient would be lost. Make such calls under torch.no_grad(), or on rank 0 only"
        )
        return _guard_backward(outputs, message)

    # ----------------------------------------------------------------------------- the step
    def check_installed(self) -> None:
        """A training step that never ran the planned forward installed no plan: its gradients were
        not synchronized. Every rank ran the same step, so every rank raises here."""
        if self.session.installed is not None or self.agreement is None:
            return
        name = type(self.target).__name__
        alone_among = self.agreement.alone_among
        if alone_among:
            raise RuntimeError(
                f"deeppool: no call of {name}.forward in the training step was made by every rank at the "
                f"same point of the step, so none ran the plan and no plan was installed. When this rank's "
                f"call ran alone: {alone_among}. Make the planned call on every rank, with the same "
                "collectives (self.log(..., sync_dist=True), ...) before it on every rank"
            )
        raise RuntimeError(
            f"deeppool: the training step did not call {name}.forward, so no plan was "
            "installed and gradients would not be synchronized across ranks. Call the model's forward "
            "in training_step (self(x)), or set DeepPoolStrategy(module='<name>') to the submodule "
            "training_step calls."
        )

    @contextmanager
    def backward(self, last: bool) -> Iterator[None]:
        """A backward pass of the step. Buckets may launch during it only if it is the step's last and
        has one pass."""
        installation = self.session.installed
        armed = installation is not None and last and self._pending == 1 and installation.settled
        self._pending = 0
        if installation is None:
            yield
        elif installation.data_parallel:  # one autograd graph: each parameter accumulates once
            installation.grad_sync.arm(armed, once=True)
            with installation.grad_sync.in_stage():
                yield
        else:
            installation.runtime.expect_last_pass(armed)
            yield

    def sync_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.session.sync(optimizer)

    def after_optimizer_step(self) -> None:
        """Layers a rank does not run went stale there: sent to it where `current_weights` asks, else
        released (NaN placeholders holding no memory) until the next refresh."""
        installation = self.session.installed
        if installation is None or not installation.narrow:
            return
        if self.session.options.current_weights:
            with self.session.idle.window("current_weights"):
                installation.send_unheld()
            return
        if self.stale_anywhere:
            return
        self.stale_anywhere = True
        rank = self.session.fit.rank
        self.stale = not installation.owns_everything(rank)
        installation.release_unheld(rank)

    def refresh(self) -> None:
        """Check the ranks that train a parameter together agree on it, then give every rank rank 0's
        buffers, and its parameters where some rank does not hold every layer (evaluation runs every
        layer on every rank, and a run ends with every rank's weights current), as DDP's evaluation sees
        them. Collective."""
        installation = self.session.installed
        if installation is None:
            return
        self.check_replicas()  # before rank 0's values overwrite a difference
        root = self.session.fit.root
        if not installation.narrow:
            # Parameters agree (checked); buffers are each rank's own, where DDP's are rank 0's.
            sync_buffers(root)
            return
        installation.hold_unheld()
        sync_module_states(root)
        self.stale = self.stale_anywhere = False

    def check_replicas(self) -> None:
        """The ranks that train a parameter together compare their copies; raises on a difference.
        Collective, once the plan has settled."""
        installation = self.session.installed
        if installation is not None and installation.settled:
            with self.session.idle.window("check_replicas"):
                installation.check_replicas()

    def close(self) -> None:
        restore_forward(self.target)


class _NoBackward(torch.autograd.Function):
    """Identity whose backward raises: marks outputs whose gradient this rank cannot deliver."""

    @staticmethod
    def forward(ctx: Any, message: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        raise RuntimeError(ctx.message)


def _guard_backward(outputs: Any, message: str) -> Any:
    leaves, spec = pytree.tree_flatten(outputs)
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return outputs
    guarded = _NoBackward.apply(message, *(leaves[i] for i in positions))
    for i, t in zip(positions, guarded):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)
