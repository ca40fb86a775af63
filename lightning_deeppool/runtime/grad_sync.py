"""Gradient synchronisation: every gradient contribution is reduced once, among its parameter's owners.

Gradients are divided by the world size before the sum, as DDP does: with each rank's loss a mean over
its own samples, the result equals DDP's averaged gradient on every owner.

One hook on each parameter, before its gradient accumulates, tracks which gradients hold
contributions not reduced yet (*fresh*). A sync reduces only those, so any number of forwards and
backwards between optimizer steps gives one device's gradient: when a backward adds to a gradient
that was already reduced (gradients not zeroed between steps), the reduced part is set aside and only
the new part is reduced. A parameter that received nothing keeps ``grad is None``, as on one device.
Which parameters are fresh is the same on every rank that runs them: they run the same layers on
the same graph. Rank 0 holds every parameter: where it runs none of a parameter's layers (a branch on
other ranks), the first rank that does sends it the summed gradient at each sync.

During the final backward pass of a step the schedule's buckets are launched once their gradients
are final, so the all-reduce overlaps the rest of the backward, always in bucket order: at the next
parameter's hook (autograd has accumulated every gradient before it by then) or where the stage's
backward ends. How a bucket is summed is the messages' choice (`comm.messages`): an asynchronous
all-reduce over the bucket's group, or, over local links, an exchange at launch (on busy CPU cores,
launching gloo's asynchronous all-reduce alone blocked for 2 ms). With a DDP communication hook
(`comm_hook`), every bucket summed over more than one rank goes through the hook instead, over its
group, on any device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_deeppool.comm.messages import Messages, Posted
from lightning_deeppool.lowering.schedule import Bucket, Schedule
from lightning_deeppool.runtime.comm_hook import HookedSums, PlanGradBucket


class GradSync:
    """Reduces this rank's fresh gradients: schedule buckets among the ranks that run them, `alone`
    parameters (only this rank runs them) by division, `world` parameters (used outside the planned
    forward) over every rank; then moves the summed gradients of `to_rank_zero` (`Schedule.to_rank_zero`)
    between rank 0 and their first rank. `uses` counts the layers using each parameter: a shared one is
    final only at its bucket's schedule `sync`, not at its first hook. `comm_hook` sums buckets where
    given; `bucket_view` (DDP's `gradient_as_bucket_view`) makes gradients views into their bucket's
    storage, else each keeps its own and the bucket is a copy."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        messages: Messages,
        world_size: int,
        buckets: Sequence[Bucket],
        *,
        alone: Sequence[str] = (),
        world: Sequence[str] = (),
        to_rank_zero: Mapping[int, Sequence[str]] | None = None,
        uses: Mapping[str, int] | None = None,
        waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
        comm_hook: HookedSums | None = None,
        bucket_view: bool = True,
    ) -> None:
        self.params = params
        self.messages = messages
        self.world_size = world_size
        self.comm_hook = comm_hook
        self.bucket_view = bucket_view
        self._assign([Bucket(b.index, b.ranks, tuple(b.params)) for b in buckets], list(alone), list(world))
        self._to_rank_zero = {peer: list(names) for peer, names in (to_rank_zero or {}).items()}
        self.waiting = waiting
        self.outside: set[str] = set()
        self._uses = dict(uses or {})
        self._fresh: set[str] = set()
        self._reduced: set[str] = set()
        self._set_aside: dict[str, torch.Tensor] = {}
        self._in_flight: set[str] = set()
        self._in_stage = False
        self._armed = False
        self._once = False
        self._missing: list[int] = []
        self._next = 0
        self._pending: list[tuple[Posted | None, torch.Tensor, list[tuple[str, torch.Tensor | None]]]] = []
        self._synced: set[str] = set()  # reduced since the last sync: what moves to rank 0
        self._hooks: dict[str, Any] = {}
        self._unhooked = list(params)  # the parameters without hooks yet: frozen so far
        self.track_new_parameters()

    @classmethod
    def for_schedule(
        cls,
        schedule: Schedule,
        params: Mapping[str, nn.Parameter],
        messages: Messages,
        rank: int,
        **options: Any,
    ) -> GradSync:
        """This rank's part of `schedule`'s synchronisation (`options`: the other keywords)."""
        return cls(
            params,
            messages,
            schedule.world_size,
            [bucket for bucket in schedule.buckets if rank in bucket.ranks],
            alone=[name for name, ranks in schedule.param_ranks.items() if ranks == (rank,)],
            to_rank_zero=schedule.to_rank_zero(rank),
            **options,
        )

    def _assign(self, buckets: list[Bucket], alone: list[str], world: list[str]) -> None:
        """Which parameters are reduced where, and the lookups derived from it."""
        self.buckets, self.alone, self.world = buckets, alone, world
        self._bucket_of = {name: i for i, b in enumerate(buckets) for name in b.params}
        self._owned = {*self._bucket_of, *world, *alone}
        self._storage: dict[int, torch.Tensor] = {}  # per bucket position: its gradients' flat storage
        self._expected: dict[bool, list[int]] = {}  # `arm`'s counts per bucket, by its `once`

    # ------------------------------------------------------------------------------ contributions
    def track_new_parameters(self) -> None:
        """Hook parameters that require grad and have no hook yet (unfrozen since, say): a loop over
        the frozen ones only, at every call."""
        hooked = [name for name in self._unhooked if self.params[name].requires_grad]
        for name in hooked:
            self._hooks[name] = self.params[name].register_hook(self._before_accumulate(name))
        if hooked:
            self._unhooked = [name for name in self._unhooked if name not in self._hooks]
            self._expected.clear()

    def _before_accumulate(self, name: str) -> Callable[[torch.Tensor], None]:
        return lambda _: self._contribution(name)

    def add_zeros(self, names: Sequence[str]) -> None:
        """A contribution of zeros to each of these gradients (those that get gradients here): from a
        stage this rank runs that held none of the step's samples here, so that every rank of a bucket
        reduces the same gradients."""
        with self.in_stage():
            for name in names:
                p = self.params[name]
                if name in self._hooks and p.requires_grad:
                    self._contribution(name)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)

    def _contribution(self, name: str) -> None:
        """What a hook does before a gradient accumulates: launch the buckets completed before it,
        set aside its reduced part, count it fresh."""
        if self._armed:
            self._launch_ready()  # buckets the gradients accumulated before this one completed
        if name in self._in_flight:
            raise RuntimeError(
                f"deeppool: a gradient for {name!r} arrived after its all-reduce started; the step made "
                "a backward through the planned forward after the one that synchronized gradients"
            )
        if not self._in_stage:
            self.outside.add(name)
        p = self.params[name]
        if name in self._reduced and p.grad is not None:
            self._set_aside[name] = p.grad.detach().clone()
        self._reduced.discard(name)
        self._fresh.add(name)
        if self._armed and self._in_stage and self._single_use(name):
            position = self._bucket_of.get(name)
            if position is not None:
                self._missing[position] -= 1

    @contextmanager
    def in_stage(self) -> Iterator[None]:
        """Gradients arriving inside come from the planned layers (others are used outside forward)."""
        self._in_stage = True
        try:
            yield
        finally:
            self._in_stage = False
        if self._armed:
            self._launch_ready()

    def fresh(self) -> set[str]:
        return set(self._fresh)

    # ------------------------------------------------------------------------ overlapped launches
    def arm(self, armed: bool, *, once: bool = False) -> None:
        """Start a backward pass; if `armed`, it is the step's last: launch buckets as they complete.
        With `once`, the pass is one autograd graph, where a parameter shared by layers accumulates
        once (not once per stage): its hook makes it final too."""
        self._armed = armed
        self._once = once
        self._next = 0
        if once not in self._expected:
            # Per bucket: its hooked parameters a hook makes final, and one for the schedule's `sync`
            # where some are shared. Computed when the hooks change; a parameter frozen since only
            # keeps its bucket from launching before the step's sync.
            self._expected[once] = [
                sum(1 for n in b.params if self._single_use(n) and n in self._hooks)
                + any(not self._single_use(n) for n in b.params)
                for b in self.buckets
            ]
        self._missing = list(self._expected[once])

    def _single_use(self, name: str) -> bool:
        return self._once or self._uses.get(name, 1) == 1

    def launch_through(self, bucket: Bucket) -> None:
        """The schedule's `sync`: in an armed pass, launch every bucket up to this one."""
        if not self._armed:
            return
        positions = [i for i, b in enumerate(self.buckets) if b.index == bucket.index]
        if positions:
            self._missing[positions[0]] = 0
            while self._next <= positions[0]:
                self._launch_next()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._missing[self._next] <= 0:
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next]
        self._reduce(list(bucket.params), bucket.ranks, self._next)
        self._next += 1

    # ---------------------------------------------------------------------------------- syncing
    def sync(self, only: Collection[str] | None = None) -> None:
        """Reduce every fresh gradient (of `only`, if given) and wait: the optimizer may step."""
        self._armed = False
        chosen = self._fresh if only is None else self._fresh & set(only)
        unknown = chosen - self._owned
        if unknown:
            raise RuntimeError(
                f"deeppool: parameters {sorted(unknown)[:5]} received gradients on rank {dist.get_rank()}, "
                "which does not hold them: they were used outside the planned forward only after the first "
                "step. Use every parameter the same way from the first training step on"
            )
        for position, bucket in enumerate(self.buckets):
            self._reduce([n for n in bucket.params if n in chosen], bucket.ranks, position)
        self._reduce([n for n in self.world if n in chosen], range(self.world_size))
        for name in self.alone:
            if name in chosen:
                self._divide(name)
        self._finish()
        self._move_to_rank_zero()

    def _reduce(self, names: list[str], ranks: Sequence[int], position: int | None = None) -> None:
        names = [n for n in names if n in self._fresh]
        if not names:
            return
        flat = self._in_storage(position, names) if position is not None else None
        if flat is None:
            flat, parts = self._gathered(names)
        else:
            parts = [(name, None) for name in names]
        work: Posted | None
        if self.comm_hook is not None and len(ranks) > 1:
            work = self.comm_hook.sum(flat, ranks, self._grad_bucket(flat, names, position))
        else:
            flat.div_(self.world_size)
            work = self.messages.sum(flat, ranks, self.waiting) if len(ranks) > 1 else None
        self._fresh.difference_update(names)
        self._in_flight.update(names)
        self._pending.append((work, flat, parts))

    def _grad_bucket(self, flat: torch.Tensor, names: list[str], position: int | None) -> PlanGradBucket:
        """`flat` as a hook sees it: bucket `position` of this rank's, or after them the parameters
        reduced over the world. The last is this rank's last bucket, which every step reduces (the
        world's parameters get gradients only where some rank uses them outside forward)."""
        index = len(self.buckets) if position is None else position
        last = max(len(self.buckets) - 1, 0)
        return PlanGradBucket(index, flat, [self.params[n] for n in names], index == last)

    def _gathered(self, names: list[str]) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor | None]]]:
        """The gradients' new contributions in one flat tensor, and each one's part set aside."""
        parts: list[tuple[str, torch.Tensor | None]] = []
        grads = []
        for name in names:
            grad = self.params[name].grad
            assert grad is not None
            aside = self._set_aside.pop(name, None)
            parts.append((name, aside))
            grads.append(grad if aside is None else grad - aside)
        alone = len(grads) == 1 and parts[0][1] is None and grads[0].is_contiguous()
        # A lone large gradient is reduced in place: copying tens of megabytes in and out of a bucket
        # costs as much as the all-reduce itself.
        return (grads[0].view(-1) if alone else torch.cat([g.reshape(-1) for g in grads])), parts

    def _in_storage(self, position: int, names: list[str]) -> torch.Tensor | None:
        """The flat storage of bucket `position`, its gradients made views into it (copied in where
        autograd made them anew, as after `zero_grad(set_to_none=True)`), so that no gradient is copied
        back after the sum; DDP's buckets do the same. None where the bucket is not reduced whole:
        some gradient missing or with a part set aside, a single one (reduced in place), parameters
        of different dtypes, devices or non-contiguous layouts, or gradients not bucket views."""
        params = [self.params[n] for n in names]
        if (
            not self.bucket_view
            or len(names) < 2
            or names != list(self.buckets[position].params)
            or any(n in self._set_aside for n in names)
            or len({(p.dtype, p.device) for p in params}) > 1
            or not all(p.is_contiguous() for p in params)
        ):
            return None
        total = sum(p.numel() for p in params)
        storage = self._storage.get(position)
        if storage is None or storage.numel() != total or storage.dtype != params[0].dtype:
            storage = self._storage[position] = params[0].new_empty(total)
        offset = 0
        for p in params:
            view = storage[offset : offset + p.numel()].view_as(p)
            grad = p.grad
            assert grad is not None
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                p.grad = view
            offset += p.numel()
        return storage

    def _divide(self, name: str) -> None:
        p = self.params[name]
        assert p.grad is not None
        aside = self._set_aside.pop(name, None)
        if aside is None:
            p.grad.div_(self.world_size)
        else:
            p.grad.sub_(aside).div_(self.world_size).add_(aside)
        self._fresh.discard(name)
        self._reduced.add(name)
        self._synced.add(name)

    def _finish(self) -> None:
        for work, flat, parts in self._pending:
            if work is not None:
                with self.waiting():
                    work.wait()
            names = [name for name, _ in parts]
            self._in_flight.difference_update(names)
            self._reduced.update(names)
            self._synced.update(names)
            first = self.params[names[0]].grad
            if first is not None and first.data_ptr() == flat.data_ptr():
                continue  # the bucket's storage or a lone gradient: reduced where the gradients lie
            offset = 0
            for name, aside in parts:
                p = self.params[name]
                assert p.grad is not None
                n = p.numel()
                reduced = flat[offset : offset + n].view_as(p)
                if aside is not None:
                    p.grad.copy_(reduced + aside)
                else:
                    p.grad.copy_(reduced)
                offset += n
        self._pending.clear()

    def _move_to_rank_zero(self) -> None:
        """Each sender's gradients reduced in this sync go to rank 0, in one message per sender: every
        gradient of its list in one dtype that holds them all, zeros where it was not reduced, then
        one flag per gradient (1: reduced); rank 0 takes the flagged ones as its gradients."""
        synced, self._synced = self._synced, set()
        if not self._to_rank_zero:
            return
        outgoing, incoming = {}, {}
        for peer, names in self._to_rank_zero.items():
            params = [self.params[name] for name in names]
            dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
            size = sum(p.numel() for p in params) + len(params)
            if peer == 0:
                grads = [p.grad if n in synced else None for n, p in zip(names, params)]
                parts = [
                    p.new_zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(params, grads)
                ]
                flags = [float(g is not None) for g in grads]
                outgoing[peer] = torch.cat(
                    [*(t.to(dtype) for t in parts), params[0].new_tensor(flags, dtype=dtype)]
                )
            else:
                incoming[peer] = params[0].new_empty(size, dtype=dtype)
        posted = self.messages.post(outgoing, incoming)
        with self.waiting():
            posted.wait()
        for peer, flat in incoming.items():
            names = self._to_rank_zero[peer]
            flags = flat[-len(names) :].tolist()
            offset = 0
            for name, flag in zip(names, flags):
                p = self.params[name]
                received = flat[offset : offset + p.numel()].view_as(p)
                if flag and p.grad is not None:
                    p.grad.copy_(received)
                elif flag:
                    p.grad = received.to(p.dtype, copy=True)
                offset += p.numel()

    def reduce_over_world(self, names: Collection[str]) -> None:
        """From now on reduce these parameters over every rank: they are used outside the planned
        forward too, so every rank contributes to their gradients."""
        chosen = set(names)
        self._assign(
            [Bucket(b.index, b.ranks, tuple(n for n in b.params if n not in chosen)) for b in self.buckets],
            [n for n in self.alone if n not in chosen],
            self.world + [n for n in names if n not in self.world],
        )
        moving = {peer: [n for n in names if n not in chosen] for peer, names in self._to_rank_zero.items()}
        self._to_rank_zero = {peer: names for peer, names in moving.items() if names}

    def drop(self, names: Collection[str]) -> None:
        """Forget gradients of parameters this rank does not hold (never reduced here)."""
        for name in names:
            self.params[name].grad = None
            self._fresh.discard(name)
            self._set_aside.pop(name, None)

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
