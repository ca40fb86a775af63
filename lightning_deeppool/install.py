"""Installing a plan: capture, profile, plan on rank 0, and build what every rank runs.

`Installer.install` is collective: every rank calls it at its first planned call. The resulting
`Installation` owns the process groups, the runtime and the gradient synchronisation. Which parameters a
rank keeps in its optimizers is settled at the first gradient synchronisation, once it is known which
planned parameters are also used outside the planned forward (they are then reduced over every rank).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lightning_deeppool.capture import CapturedGraph, capture_graph
from lightning_deeppool.comm.fail_together import on_every_rank, on_rank_zero
from lightning_deeppool.comm.groups import PlanGroups
from lightning_deeppool.comm.messages import LocalLinks, spatial_messages
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.lowering.schedule import Schedule, build_schedule
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.search import search
from lightning_deeppool.profiling.cache import default_cache_dir
from lightning_deeppool.profiling.on_ranks import profile_on_ranks
from lightning_deeppool.runtime.grad_sync import GradSync
from lightning_deeppool.runtime.idle import IdleWindows
from lightning_deeppool.runtime.runtime import BurstRuntime

UNPLANNED = "<unplanned>."


@dataclass
class Installer:
    """The strategy's planning options, and what planning produced (`profile`, a loaded plan)."""

    amplification_limit: float
    plan_source: str | Path | dict[str, int] | None
    save_plan: str | Path | None
    leaf_modules: tuple[str, ...]
    granularity: str
    profile_warmup: int
    profile_repeats: int
    cache_dir: str | Path | Literal[False] | None
    exempt_below_s: float
    memory_budget_bytes: float | None
    bucket_bytes: int
    shared_batch: bool = False
    profile: Profile | None = None

    def install(
        self,
        root: nn.Module,
        target: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        device: torch.device,
        optimizers: Sequence[torch.optim.Optimizer],
        idle: IdleWindows,
        log_dir: str | None,
        plan: Plan | None = None,
    ) -> Installation:
        """Capture `target`'s forward on this call's batch, plan (unless `plan` is given: an earlier
        fit's), and build every rank's runtime."""
        world_size = dist.get_world_size()
        # Before capture: a rank without samples cannot capture, and must fail with the others.
        global_batch = _global_batch_size(args, kwargs, world_size, idle, self.shared_batch)
        captured = on_every_rank(
            lambda: capture_graph(
                target, args, kwargs, leaf_modules=self.leaf_modules, granularity=self.granularity
            )
        )
        _check_same_capture(captured)
        if self.shared_batch:
            _check_shareable(captured)
        if plan is None:
            plan = self._plan(
                captured, captured.bind(args, kwargs), global_batch, device, optimizers, log_dir
            )
        plan.check_matches(captured.graph, world_size)
        return Installation.build(
            root,
            captured,
            plan,
            device=device,
            idle=idle,
            bucket_bytes=self.bucket_bytes,
            shared_batch=self.shared_batch,
        )

    def _plan(
        self,
        captured: CapturedGraph,
        env: dict[str, Any],
        global_batch: int,
        device: torch.device,
        optimizers: Sequence[torch.optim.Optimizer],
        log_dir: str | None,
    ) -> Plan:
        world_size = dist.get_world_size()
        if isinstance(self.plan_source, str | Path):
            source = Path(self.plan_source)
            return on_every_rank(lambda: Plan.load(source))
        pins = self.plan_source if isinstance(self.plan_source, Mapping) else None
        cache_dir = None if self.cache_dir is False else Path(self.cache_dir or default_cache_dir())
        self.profile = profile_on_ranks(
            captured,
            env,
            global_batch,
            device=device,
            optimizers=optimizers,
            cache_dir=cache_dir,
            warmup=self.profile_warmup,
            repeats=self.profile_repeats,
        )
        # The planner costs gradient reductions in the buckets the runtime will use.
        profile = dataclasses.replace(
            self.profile, comm=dataclasses.replace(self.profile.comm, bucket_bytes=self.bucket_bytes)
        )
        plan = on_rank_zero(
            lambda: search(
                captured.graph,
                profile,
                world_size=world_size,
                global_batch_size=global_batch,
                amplification_limit=self.amplification_limit,
                exempt_below_s=self.exempt_below_s,
                pins=pins,
                memory_budget_bytes=self.memory_budget_bytes,
            )
        )
        path = self._plan_path(log_dir)
        if dist.get_rank() == 0:
            print(plan.table(), flush=True)
            if path is not None:
                plan.save(path)
                print(f"deeppool: plan written to {path}", flush=True)
        return plan

    def _plan_path(self, log_dir: str | None) -> Path | None:
        """`save_plan`, else the run's log directory, else nowhere."""
        if self.save_plan:
            return Path(self.save_plan)
        return Path(log_dir) / "deeppool_plan.json" if log_dir else None


@dataclass
class Installation:
    """A plan installed on this rank: its groups, runtime and gradient synchronisation."""

    plan: Plan
    captured: CapturedGraph
    schedule: Schedule
    groups: PlanGroups
    runtime: BurstRuntime
    grad_sync: GradSync
    names: dict[int, str]  # parameter id -> name in the gradient synchronisation
    widths: dict[str, int]  # name -> how many ranks (0..w-1) hold it
    settled: bool = False
    _original: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # optimizer id -> its parameters

    @classmethod
    def build(
        cls,
        root: nn.Module,
        captured: CapturedGraph,
        plan: Plan,
        *,
        device: torch.device,
        idle: IdleWindows,
        bucket_bytes: int,
        shared_batch: bool = False,
    ) -> Installation:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        used = {name for names in captured.layer_params.values() for name in names}
        params = {name: p for name, p in captured.module.named_parameters() if name in used}
        schedule = build_schedule(
            captured.graph,
            plan.placements(),
            captured.layer_params,
            {name: p.numel() * p.element_size() for name, p in params.items()},
            world_size,
            bucket_bytes,
        )
        planned = {id(p) for p in params.values()}
        unplanned = {f"{UNPLANNED}{name}": p for name, p in root.named_parameters() if id(p) not in planned}
        widths = {name: schedule.param_widths.get(name, world_size) for name in params}
        widths.update(dict.fromkeys(unplanned, world_size))
        groups = PlanGroups([*schedule.param_widths.values(), world_size], world_size)
        uses: dict[str, int] = {}
        for used_by_layer in captured.layer_params.values():
            for name in used_by_layer:
                uses[name] = uses.get(name, 0) + 1
        split = any(stage.placement.spatial > 1 for stage in schedule.stages)
        messages = spatial_messages(groups.redistribution, device) if split else None
        grad_sync = GradSync(
            {**params, **unplanned},
            groups,
            world_size,
            [bucket for bucket in schedule.buckets if rank < bucket.width],
            rank0_only=[name for name, width in schedule.param_widths.items() if width == 1 and rank == 0],
            world=list(unplanned),
            uses=uses,
            links=messages if isinstance(messages, LocalLinks) else None,
        )
        runtime = BurstRuntime(
            captured,
            schedule,
            rank=rank,
            device=device,
            grad_sync=grad_sync,
            idle=idle,
            redistribution=groups.redistribution,
            messages=messages,
            shared=shared_batch,
        )
        grad_sync.waiting = runtime.idle_window
        names = {id(p): name for name, p in {**params, **unplanned}.items()}
        return cls(plan, captured, schedule, groups, runtime, grad_sync, names, widths)

    @functools.cached_property
    def data_parallel(self) -> bool:
        """Every layer runs on every rank's own samples: the plan is data parallelism (asked a few
        times a step; the schedule does not change once built)."""
        home = Placement(self.schedule.world_size)
        return not self.runtime.shared and all(stage.placement == home for stage in self.schedule.stages)

    def owns_everything(self, rank: int) -> bool:
        return all(rank < width for width in self.widths.values())

    def sync(
        self, optimizers: Sequence[torch.optim.Optimizer], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Reduce fresh gradients (of `optimizer`'s parameters, if given). Collective."""
        if not self.settled:
            self._settle(optimizers)
        only = None
        if optimizer is not None:
            only = [self.names[id(p)] for p in self._original.get(id(optimizer), []) if id(p) in self.names]
        self.grad_sync.sync(only)

    def _settle(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """First synchronisation: parameters some rank used outside the planned forward are reduced over
        every rank from now on; then each rank drops from its optimizers what it does not hold."""
        names = sorted(name for name, width in self.widths.items() if not name.startswith(UNPLANNED))
        flags = torch.tensor([name in self.grad_sync.outside for name in names], dtype=torch.float32)
        flags = flags.to(self.runtime.device)
        if len(names):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        outside = [
            name
            for name, flag in zip(names, flags.tolist())
            if flag and self.widths[name] < dist.get_world_size()
        ]
        self.grad_sync.reduce_over_world(outside)
        for name in outside:
            self.widths[name] = dist.get_world_size()
        rank = dist.get_rank()
        self._original = {id(o): [p for g in o.param_groups for p in g["params"]] for o in optimizers}
        by_id = {p_id: self.widths[name] for p_id, name in self.names.items()}
        dropped = [name for name, width in self.widths.items() if rank >= width]
        self.grad_sync.drop(dropped)
        _prune_optimizers(optimizers, lambda p: rank < by_id.get(id(p), dist.get_world_size()))
        self.settled = True

    def close(self) -> None:
        self.runtime.close()
        self.groups.destroy()


def _global_batch_size(
    args: tuple[Any, ...], kwargs: dict[str, Any], world_size: int, idle: IdleWindows, shared: bool
) -> int:
    """Sum of the ranks' sample counts (tensor arguments are batches), or with a shared batch the
    count every rank read. Collective."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    counts: list[Any] = [None] * world_size
    with idle.window("global_batch_size"):
        dist.all_gather_object(counts, leaves[0].shape[0] if leaves else 0)
    if shared:
        if len(set(counts)) > 1 or not counts[0]:
            raise ValueError(
                f"shared_batch=True needs every rank to read the same global batch, but the ranks read "
                f"{counts} samples; give every rank the same data"
            )
        return int(counts[0])
    total = sum(counts)
    if total < world_size:
        raise ValueError(
            f"the global batch has {total} samples ({counts} per rank), fewer than the {world_size} "
            "devices: every device needs at least one sample. Increase the DataLoader batch_size, or, "
            "for a convolutional model whose layers can split each sample by height, pass "
            "DeepPoolStrategy(shared_batch=True) and give every rank the whole batch"
        )
    return int(total)


def _check_shareable(captured: CapturedGraph) -> None:
    """A shared batch returns the whole batch's outputs: none may be reduced over a rank's samples."""
    per_rank = [layer.name for layer in captured.graph.layers if layer.per_rank]
    if per_rank:
        raise ValueError(
            f"shared_batch=True: the planned forward reduces over each rank's samples in {per_rank[:3]} "
            "(a loss inside forward); compute the loss outside the planned module, or use "
            "shared_batch=False"
        )


def _check_same_capture(captured: CapturedGraph) -> None:
    """Every rank must have captured the same graph (capture runs on each rank's own batch)."""
    prints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, captured.graph.fingerprint)
    if len(set(prints)) > 1:
        raise RuntimeError(
            f"ranks captured different graphs (fingerprints {prints}): the forward's structure depends on "
            "each rank's data. Make forward's control flow independent of the batch"
        )


def _prune_optimizers(optimizers: Sequence[Any], keep: Any) -> None:
    """Drop the parameters this rank does not own from every param group, in place (so LR
    schedulers, which hold the groups, keep working), with their state and gradients."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            dropped = [p for p in group["params"] if not keep(p)]
            group["params"][:] = [p for p in group["params"] if keep(p)]
            for p in dropped:
                optimizer.state.pop(p, None)
                p.grad = None
