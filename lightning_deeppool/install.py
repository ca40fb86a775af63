"""The composition root: capture -> profile -> search -> lower -> build, on every rank (collective).

`install` runs at the first planned call of a fit. It captures the planned module on this call's
batch, profiles it and plans on rank 0 (unless a plan is given), lowers the plan to this rank's
schedule and builds what runs it: process groups, messages, gradient synchronisation and the runtime
(`InstalledPlan`). Which parameters a rank keeps in its optimizers is settled at the first gradient
synchronisation, once it is known which planned parameters are also used outside the planned forward
(they are then reduced over every rank).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lightning_deeppool.capture import Break, CapturedGraph, capture_graph, widest
from lightning_deeppool.capture.codegen import Compiler
from lightning_deeppool.capture.state import call_key
from lightning_deeppool.comm.fail_together import on_every_rank, on_rank_zero
from lightning_deeppool.comm.groups import PlanGroups
from lightning_deeppool.comm.messages import GroupMessages, connect_local_links
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.lowering.schedule import Schedule, build_schedule
from lightning_deeppool.planner.plan import Plan, placements_for
from lightning_deeppool.planner.search import search
from lightning_deeppool.profiling.cache import default_cache_dir
from lightning_deeppool.profiling.heap import give_back
from lightning_deeppool.profiling.on_ranks import profile_on_ranks
from lightning_deeppool.runtime.comm_hook import CommHook
from lightning_deeppool.runtime.grad_sync import GradSync
from lightning_deeppool.runtime.idle import IdleWindows, ScheduleWindows
from lightning_deeppool.runtime.runtime import BurstRuntime
from lightning_deeppool.runtime.shared_batch import checksum
from lightning_deeppool.runtime.unheld import UnheldGradients
from lightning_deeppool.runtime.unheld_weights import hold, release

UNPLANNED = "<unplanned>."
# Distinct sets of the values forward reads (module values, non-tensor arguments), each captured once,
# before a fit stops (a value that changes at every step would capture at every step).
MAX_STATES = 16


@dataclass(frozen=True)
class PlanOptions:
    """How the strategy plans (its constructor's planning arguments)."""

    amplification_limit: float
    plan_source: str | Path | dict[str, int | Mapping[str, Any]] | None
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
    branches: bool = True
    comm_hook: CommHook | None = None  # sums the gradient buckets (DDP's communication hook)
    bucket_view: bool = True  # gradients are views into their bucket (DDP's gradient_as_bucket_view)
    current_weights: bool = False  # every rank's copy of the layers it does not run is sent after each step

    def plan_path(self, log_dir: str | None) -> Path | None:
        """Where rank 0 writes the plan: `save_plan`, else the run's log directory, else nowhere."""
        if self.save_plan:
            return Path(self.save_plan)
        return Path(log_dir) / "deeppool_plan.json" if log_dir else None


def install(
    options: PlanOptions,
    root: nn.Module,
    target: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    device: torch.device,
    optimizers: Sequence[torch.optim.Optimizer],
    idle: IdleWindows,
    log_dir: Callable[[], str | None],
    plan: Plan | None = None,
    reads_gradients: bool = False,
    compiler: Compiler | None = None,
) -> InstalledPlan:
    """Capture `target`'s forward on this call's batch, plan (unless `plan` is given: an earlier
    fit's), and build this rank's part of it. `root` holds every trainable parameter; `log_dir`
    (collective) is asked only where a new plan is saved; with `reads_gradients`, every rank gets the
    norms of the gradients it does not hold at each synchronisation (`runtime.unheld`); the layers run
    through `compiler` (the user compiled the LightningModule). Collective."""
    world_size = dist.get_world_size()
    # Before capture: a rank without samples cannot capture, and must fail with the others.
    global_batch, same_shapes = _global_batch_size(args, kwargs, world_size, idle, options.shared_batch)
    if not same_shapes:  # every rank captures and profiles at rank 0's shapes; the others come after
        args, kwargs = _broadcast_call(args, kwargs, 0, device)
    captured = _capture(options, target, args, kwargs, compiler)
    give_back(device)  # what tracing allocated, once
    if options.shared_batch:
        _check_shareable(captured)
    profile = None
    if plan is None and isinstance(options.plan_source, str | Path):
        source = Path(options.plan_source)
        plan = on_every_rank(lambda: Plan.load(source))
    elif plan is None:
        env = captured.bind(args, kwargs)
        profile = _profile(options, captured, env, global_batch, device, optimizers)
        plan = _search(options, captured, profile, global_batch)
    plan.check_matches(captured.graph, world_size)
    installed = InstalledPlan.build(
        root,
        captured,
        plan,
        device=device,
        idle=idle,
        bucket_bytes=options.bucket_bytes,
        shared_batch=options.shared_batch,
        reads_gradients=reads_gradients,
        comm_hook=options.comm_hook,
        bucket_view=options.bucket_view,
    )
    installed.profile = profile
    if profile is not None:  # a plan searched here: printed, with what `current_weights` sends
        sent = installed.current_weights_bytes() if options.current_weights else None
        _save(plan, options.plan_path(log_dir()), sent)
    return installed


def capture_shape(
    options: PlanOptions,
    installed: InstalledPlan,
    target: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compiler: Compiler | None = None,
    src: int | None = None,
) -> None:
    """Capture `target`'s forward again on this call's batch (rank `src`'s, if given), whose per-sample
    shapes or module values no earlier capture had, and run the installed plan on that graph from now
    on: not profiled or planned again. Collective."""
    if src is not None:
        args, kwargs = _broadcast_call(args, kwargs, src, installed.runtime.device)
    captured = _capture(options, target, args, kwargs, compiler, known=installed.captured.breaks)
    on_every_rank(lambda: installed.add_graph(captured))


def _capture(
    options: PlanOptions,
    target: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    compiler: Compiler | None,
    known: Sequence[Break] = (),
) -> CapturedGraph:
    """`target`'s forward captured on every rank's own batch, starting from the `known` graph breaks: the
    same graph on every rank, or an error on every rank; rank 0 says where code broke the graph, once
    (not for the `known` breaks). Collective."""

    def capture(breaks: Sequence[Break]) -> CapturedGraph:
        return on_every_rank(
            lambda: capture_graph(
                target,
                args,
                kwargs,
                leaf_modules=options.leaf_modules,
                granularity=options.granularity,
                compiler=compiler,
                breaks=breaks,
            )
        )

    captured = capture(known)
    # Each rank's data may break the graph in other places (one pair of samples of a length taken from
    # the data differs, another does not): every rank captures again from all of them.
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, captured.breaks)
    agreed = widest(b for found in every for b in found)
    if any({b.path for b in found} != {b.path for b in agreed} for found in every):
        captured = capture(agreed)
    _check_same_capture(captured)
    if dist.get_rank() == 0:
        for found in captured.breaks:
            if found.path not in {b.path for b in known}:
                print(found.describe(), flush=True)
    return captured


def _profile(
    options: PlanOptions,
    captured: CapturedGraph,
    env: dict[str, Any],
    global_batch: int,
    device: torch.device,
    optimizers: Sequence[torch.optim.Optimizer],
) -> Profile:
    """The profile of this graph, batch and world (cached, else measured on every rank)."""
    cache_dir = None if options.cache_dir is False else Path(options.cache_dir or default_cache_dir())
    return profile_on_ranks(
        captured,
        env,
        global_batch,
        device=device,
        optimizers=optimizers,
        cache_dir=cache_dir,
        warmup=options.profile_warmup,
        repeats=options.profile_repeats,
    )


def _search(options: PlanOptions, captured: CapturedGraph, profile: Profile, global_batch: int) -> Plan:
    """Rank 0's plan, on every rank; it costs gradient reductions in the runtime's buckets."""
    bucketed = dataclasses.replace(
        profile, comm=dataclasses.replace(profile.comm, bucket_bytes=options.bucket_bytes)
    )
    pins = options.plan_source if isinstance(options.plan_source, Mapping) else None
    return on_rank_zero(
        lambda: search(
            captured.graph,
            bucketed,
            world_size=dist.get_world_size(),
            global_batch_size=global_batch,
            amplification_limit=options.amplification_limit,
            exempt_below_s=options.exempt_below_s,
            pins=pins,
            memory_budget_bytes=options.memory_budget_bytes,
            branches=options.branches,
        )
    )


def _save(plan: Plan, path: Path | None, current_weights_bytes: int | None = None) -> None:
    """Rank 0 prints the plan (with what `current_weights` sends per step, where it is on) and writes it
    to `path`."""
    if dist.get_rank() != 0:
        return
    print(plan.table(current_weights_bytes), flush=True)
    if path is not None:
        plan.save(path)
        print(f"deeppool: plan written to {path}", flush=True)


@dataclass
class InstalledPlan:
    """A plan installed on this rank: its groups, runtime and gradient synchronisation."""

    plan: Plan
    captured: CapturedGraph
    schedule: Schedule
    groups: PlanGroups
    runtime: BurstRuntime
    grad_sync: GradSync
    names: dict[int, str]  # parameter id -> name in the gradient synchronisation
    owners: dict[str, tuple[int, ...]]  # name -> the ranks that hold it (rank 0 among them)
    unheld_gradients: UnheldGradients | None  # where the user reads gradients
    bucket_bytes: int
    profile: Profile | None = None  # what planned it, where it was planned in this fit
    settled: bool = False
    released: list[str] = field(default_factory=list)  # the parameters this rank holds no storage for
    # `CapturedGraph.key` (per-sample shapes and dtypes, module values) -> the graph captured for it,
    # its schedule and runtime
    _graphs: dict[int, tuple[CapturedGraph, Schedule, BurstRuntime]] = field(default_factory=dict)
    _original: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # optimizer id -> its parameters
    _groups: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)  # ... by param group
    _dropped: set[str] = field(default_factory=set)  # what this rank's optimizers no longer hold
    _narrow: bool | None = None  # `narrow`, asked after every optimizer step: known until owners change
    _planned_structure: str = ""  # of the graph the plan was made for

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
        reads_gradients: bool = False,
        comm_hook: CommHook | None = None,
        bucket_view: bool = True,
    ) -> InstalledPlan:
        """Lower `plan` to this rank's schedule and build its groups, messages, gradient
        synchronisation (through `comm_hook` over the plan's groups, where given) and runtime.
        Collective."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        params, unplanned = _parameters(root, captured)
        param_bytes = {name: p.numel() * p.element_size() for name, p in params.items()}
        schedule = build_schedule(
            captured.graph, plan.placements(), captured.layer_params, param_bytes, world_size, bucket_bytes
        )
        everyone = tuple(range(world_size))
        owners = {name: schedule.owners(name) for name in params}
        owners.update(dict.fromkeys(unplanned, everyone))
        groups = PlanGroups([*schedule.param_ranks.values(), everyone], world_size)
        uses = Counter(name for names in captured.layer_params.values() for name in names)
        # Where CPU ranks share a host, every message and gradient sum goes on local links: gloo's
        # point-to-point and collectives cost 1.5-3 ms each on busy CPU cores.
        links = connect_local_links(device)
        messages = links or GroupMessages(groups.redistribution, groups)
        windows = ScheduleWindows(idle)
        grad_sync = GradSync.for_schedule(
            schedule,
            {**params, **unplanned},
            messages,
            rank,
            world=list(unplanned),
            uses=uses,
            waiting=windows.window,
            comm_hook=comm_hook.over(groups, world_size) if comm_hook is not None else None,
            bucket_view=bucket_view,
        )
        runtime = BurstRuntime(
            captured,
            schedule,
            rank=rank,
            device=device,
            grad_sync=grad_sync,
            windows=windows,
            redistribution=groups.redistribution,
            messages=messages,
            shared=shared_batch,
        )
        every = {**params, **unplanned}
        names = {id(p): name for name, p in every.items()}
        unheld = (
            UnheldGradients(every, owners, rank=rank, world_size=world_size, device=device)
            if reads_gradients
            else None
        )
        installed = cls(
            plan,
            captured,
            schedule,
            groups,
            runtime,
            grad_sync,
            names,
            owners,
            unheld,
            bucket_bytes,
        )
        installed._graphs[captured.key] = (captured, schedule, runtime)
        installed._planned_structure = captured.graph.structure
        return installed

    def use_graph(self, key: int) -> bool:
        """Switch to the graph captured for calls whose rows carry `key` (`prepare`d on the current
        graph), where one was (else False: capture it, `capture_shape`)."""
        found = self._graph_for(key)
        if found is not None:
            self.captured, self.schedule, self.runtime = found
        return found is not None

    def runtime_at(self, key: int) -> BurstRuntime | None:
        """The runtime of the graph captured for calls whose rows carry `key`, if any."""
        found = self._graph_for(key)
        return found[2] if found is not None else None

    def _graph_for(self, key: int) -> tuple[CapturedGraph, Schedule, BurstRuntime] | None:
        """A row's key holds the values the current graph's forward read; each graph read its own (one
        that ran a layer only some shapes use read that layer's too): the graph whose shapes and
        arguments give `key` with those values, and whose own values are as it found them."""
        if key == self.captured.key:
            return self._graphs[key]
        now = self.captured.state.current()
        for found in self._graphs.values():
            graph = found[0]
            if call_key(graph.samples, (now, graph.call.read)) == key and graph.state.unchanged():
                return found
        return None

    def add_graph(self, captured: CapturedGraph) -> None:
        """Run the plan on `captured` (the planned forward captured again, at other per-sample shapes or
        for other values it read) from now on. Layers the plan has no width for (a block that joins
        forward from some step on, another task's head) run at full width on every rank's own samples,
        their parameters (used nowhere in the planned capture, so held by every rank) averaged over
        every rank, as DDP does. Raises ValueError, naming what differs, where such a layer uses a
        parameter that only some ranks hold, a layer can no longer run at its placement (fewer rows
        than parts), or the values forward read have taken more than `MAX_STATES` sets."""
        states = {(g.state.captured, g.call.read) for g, _, _ in self._graphs.values()}
        states.add((captured.state.captured, captured.call.read))
        moved = self.captured.state.changes(self.captured.state.current()) + [
            f"argument {before!r} -> {after!r}"
            for before, after in zip(self.captured.call.read, captured.call.read)
            if before != after
        ]
        where = f"with {'; '.join(moved[:4])}" if moved else f"at per-sample shapes {captured.samples}"
        if len(states) > MAX_STATES:
            raise ValueError(
                f"deeppool: the module values and non-tensor arguments forward reads took {len(states)} "
                f"different sets of values in this fit (now {where}), and each needs its own capture. Keep "
                "such values fixed during training (a counter read in forward that changes every step), or "
                "read them outside forward"
            )
        planned = self.plan.widths()
        new = [layer.name for layer in captured.graph.layers if layer.name not in planned]
        if new:
            captured = self._unplanned_layers(captured, new, where)
        try:
            placements = placements_for(self.plan, captured.graph)
        except ValueError as err:
            raise ValueError(f"deeppool: the plan cannot run the forward {where}: {err}") from err
        schedule = build_schedule(
            captured.graph,
            placements,
            captured.layer_params,
            {name: p.numel() * p.element_size() for name, p in self.grad_sync.params.items()},
            self.schedule.world_size,
            self.bucket_bytes,
        )
        self.captured, self.schedule = captured, schedule
        self.runtime = self.runtime.for_shape(captured, schedule)
        # Buckets may launch during backward only where they are the plan's own.
        self.runtime.overlap = captured.graph.structure == self._planned_structure
        self._graphs[captured.key] = (captured, schedule, self.runtime)

    def _unplanned_layers(self, captured: CapturedGraph, new: list[str], where: str) -> CapturedGraph:
        """`captured` with the parameters of its layers `new` (which the plan has no width for) named as
        the gradient synchronisation knows them. Raises ValueError if one is held by some ranks only."""
        held = {name: self.names[id(p)] for name, p in captured.module.named_parameters()}
        narrow = [
            f"{layer} uses {name}"
            for layer in new
            for name in captured.layer_params.get(layer, ())
            if len(self.owners[held[name]]) < self.schedule.world_size
        ]
        if narrow:
            raise ValueError(
                f"deeppool: {where} the planned forward runs layers the plan has no width for ({new[:5]}), "
                f"and they use parameters only some ranks hold ({narrow[:3]}), so they cannot run at full "
                "width. Give forward the same layers whatever those values are (run a layer always, scaled "
                "by 0, rather than only from some step on), or pin the layers that share those parameters "
                "to full width"
            )
        layer_params = {
            layer: [held[name] if layer in new else name for name in names]
            for layer, names in captured.layer_params.items()
        }
        if dist.get_rank() == 0:
            print(
                f"deeppool: {where} forward runs layers the plan has no width for ({', '.join(new[:5])}): "
                "they run at full width, their gradients averaged over every rank as DDP does",
                flush=True,
            )
        return dataclasses.replace(captured, layer_params=layer_params)

    @functools.cached_property
    def data_parallel(self) -> bool:
        """Every layer runs on every rank's own samples: the plan is data parallelism (asked a few
        times a step; the schedule does not change once built)."""
        home = Placement(self.schedule.world_size)
        return not self.runtime.shared and all(stage.placement == home for stage in self.schedule.stages)

    def owns_everything(self, rank: int) -> bool:
        return all(rank in ranks for ranks in self.owners.values())

    def not_held(self, rank: int) -> list[str]:
        """The parameters `rank` does not hold, in order."""
        return [name for name, ranks in self.owners.items() if rank not in ranks]

    @property
    def narrow(self) -> bool:
        """Whether some rank does not hold every parameter (the same on every rank)."""
        if self._narrow is None:
            self._narrow = any(len(ranks) < dist.get_world_size() for ranks in self.owners.values())
        return self._narrow

    def release_unheld(self, rank: int) -> None:
        """Free the storage of the parameters `rank` does not hold (after an optimizer step): no rank
        keeps them current there, so each becomes a NaN placeholder (`runtime.unheld_weights`), and a
        read of it gives NaN rather than a value that looks right, until `hold_unheld`."""
        params = self.grad_sync.params
        self.released += [name for name in self.not_held(rank) if release(params[name])]

    def hold_unheld(self) -> None:
        """Give the released parameters storage again, NaN-filled: before a refresh writes rank 0's
        values into them, or code outside training writes them in place."""
        for name in self.released:
            hold(self.grad_sync.params[name])
        self.released = []

    def send_unheld(self) -> None:
        """Give every rank rank 0's values of the trainable parameters it does not hold (after an
        optimizer step: rank 0 holds every parameter), one message per rank and dtype, on the plan's
        own messages. Collective."""
        rank, params = dist.get_rank(), self.grad_sync.params
        receivers = range(1, dist.get_world_size()) if rank == 0 else (rank,)
        parts: dict[int, dict[torch.dtype, list[torch.Tensor]]] = {}
        for r in receivers:
            for name in self._sent_to(r):
                parts.setdefault(r, {}).setdefault(params[name].dtype, []).append(params[name])
        messages = self.grad_sync.messages
        with torch.no_grad():
            for dtype in sorted({d for by_dtype in parts.values() for d in by_dtype}, key=str):
                if rank == 0:
                    outgoing = {
                        r: torch.cat([t.reshape(-1) for t in by_dtype[dtype]])
                        for r, by_dtype in parts.items()
                        if dtype in by_dtype
                    }
                    messages.post(outgoing, {}).wait()
                    continue
                tensors = parts[rank][dtype]
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
                messages.post({}, {0: flat}).wait()
                for t, values in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(values.view_as(t))

    def current_weights_bytes(self) -> int:
        """The bytes `send_unheld` sends from rank 0 after each optimizer step, to every rank."""
        params = self.grad_sync.params
        return sum(
            params[name].numel() * params[name].element_size()
            for r in range(1, dist.get_world_size())
            for name in self._sent_to(r)
        )

    def _sent_to(self, rank: int) -> list[str]:
        """The trainable parameters `rank` does not hold, which `send_unheld` gives it."""
        return [name for name in self.not_held(rank) if self.grad_sync.params[name].requires_grad]

    def check_replicas(self) -> None:
        """Raise on every rank if the ranks that hold a parameter hold different values of it: the
        first such parameter, in order, is named. Collective."""
        rank, params = dist.get_rank(), self.grad_sync.params
        shared = [name for name, ranks in self.owners.items() if len(ranks) > 1]
        mine = [checksum([params[name]]) if rank in self.owners[name] else None for name in shared]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        for i, name in enumerate(shared):
            found = {r: every[r][i] for r in self.owners[name]}
            if len(set(found.values())) > 1:
                raise RuntimeError(
                    f"deeppool: the ranks that train {name!r} together hold different values of it "
                    f"(checksums by rank: {found}): a parameter was changed on some ranks only, or "
                    "ranks computed its update differently, as when gradients are clipped by a norm "
                    "computed over the optimizer's parameters (each rank's optimizer holds only those "
                    "it trains: clip over self.parameters(), or use Trainer(gradient_clip_val=...)). "
                    "Change parameters the same way on every rank; if the training code does, please "
                    "report this to lightning-deeppool"
                )

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
        if self.unheld_gradients is not None:
            self.unheld_gradients.publish()

    def _settle(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """First synchronisation: parameters some rank used outside the planned forward are reduced over
        every rank from now on; then each rank drops from its optimizers what it does not hold."""
        names = sorted(name for name in self.owners if not name.startswith(UNPLANNED))
        flags = torch.tensor([name in self.grad_sync.outside for name in names], dtype=torch.float32)
        flags = flags.to(self.runtime.device)
        if len(names):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        outside = [
            name
            for name, flag in zip(names, flags.tolist())
            if flag and len(self.owners[name]) < dist.get_world_size()
        ]
        self.grad_sync.reduce_over_world(outside)
        for name in outside:
            self.owners[name] = tuple(range(dist.get_world_size()))
        self._narrow = None
        rank = dist.get_rank()
        self._groups = {id(o): [list(g["params"]) for g in o.param_groups] for o in optimizers}
        self._original = {id(o): [p for g in o.param_groups for p in g["params"]] for o in optimizers}
        dropped = self.not_held(rank)
        self.grad_sync.drop(dropped)
        self._dropped = set(dropped)
        self._prune(optimizers)
        self.settled = True

    def _prune(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        _prune_optimizers(optimizers, lambda p: self.names.get(id(p)) not in self._dropped)

    @contextmanager
    def whole_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
        """`optimizers` with every parameter they were given inside (to load a state rank 0 saved);
        after, this rank drops again what it does not hold, with its state and gradients."""
        if not self.settled:
            yield
            return
        for optimizer in optimizers:
            for group, params in zip(optimizer.param_groups, self._groups.get(id(optimizer), [])):
                group["params"][:] = params
        try:
            yield
        finally:
            self._prune(optimizers)

    def close(self) -> None:
        """Release the plan's groups and links; the module keeps storage for every parameter."""
        self.hold_unheld()
        self.runtime.close()
        self.groups.destroy()


def _parameters(
    root: nn.Module, captured: CapturedGraph
) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """The parameters the planned layers use, by their name in the graph, and every other parameter
    of `root` (used outside the planned forward, if at all), by `UNPLANNED` + its name in `root`."""
    used = {name for names in captured.layer_params.values() for name in names}
    params = {name: p for name, p in captured.module.named_parameters() if name in used}
    planned = {id(p) for p in params.values()}
    unplanned = {f"{UNPLANNED}{name}": p for name, p in root.named_parameters() if id(p) not in planned}
    return params, unplanned


def _global_batch_size(
    args: tuple[Any, ...], kwargs: dict[str, Any], world_size: int, idle: IdleWindows, shared: bool
) -> tuple[int, bool]:
    """Sum of the ranks' sample counts (tensor arguments are batches), or with a shared batch the
    count every rank read; and whether every rank's tensor arguments have the same per-sample shapes
    and dtypes. Collective."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    mine = (leaves[0].shape[0] if leaves else 0, repr([(tuple(t.shape[1:]), t.dtype) for t in leaves]))
    gathered: list[Any] = [None] * world_size
    with idle.window("global_batch_size"):
        dist.all_gather_object(gathered, mine)
    counts = [count for count, _ in gathered]
    same_shapes = len({shapes for _, shapes in gathered}) == 1
    if shared:
        if len(set(counts)) > 1 or not counts[0]:
            raise ValueError(
                f"shared_batch=True needs every rank to read the same global batch, but the ranks read "
                f"{counts} samples; give every rank the same data"
            )
        return int(counts[0]), same_shapes
    total = sum(counts)
    if total < world_size:
        raise ValueError(
            f"the global batch has {total} samples ({counts} per rank), fewer than the {world_size} "
            "devices: every device needs at least one sample. Increase the DataLoader batch_size, or, "
            "for a convolutional model whose layers can split each sample by height, pass "
            "DeepPoolStrategy(shared_batch=True) and give every rank the whole batch"
        )
    return int(total), same_shapes


def _broadcast_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], src: int, device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rank `src`'s call arguments on every rank, its tensors on `device` (they travel on the CPU):
    every rank captures the forward at that rank's shapes. Collective."""

    def to_cpu(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().cpu().requires_grad_(t.requires_grad and t.is_floating_point())

    def to_device(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    box = [pytree.tree_map(to_cpu, (args, kwargs)) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return pytree.tree_map(to_device, box[0])


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
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, captured.graph.fingerprint)
    if len(set(seen)) == 1:
        return
    raise RuntimeError(
        f"ranks captured different graphs (fingerprints {seen}): the forward's structure "
        "depends on each rank's data. Make forward's control flow independent of the batch"
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
