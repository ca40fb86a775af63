"""Search: the placement of every layer (width, and spatial split) that minimizes the predicted step
time under hard constraints, by dynamic programming over the layers in execution order.

- states: the placements of the *live* values (produced and still read by a later layer): one in a
  chain, two in a residual block. Exact while at most ``max_states`` states survive a layer; beyond,
  the cheapest are kept (a beam search, a heuristic).
- the step it minimizes is the *serial* one (`cost.StepCost.serial_s`: every all-reduce after
  backward), a sum over layers; where all-reduces run beside backward (``comm.overlap``), a step is
  not a sum over layers, and the plan found is then compared with full width, and widened, by the
  overlapped step (`cost.evaluate`), so it is never predicted slower than full width.
- unsplit candidates (`candidate_widths`): every width 1..N while N <= ``EXHAUSTIVE_UP_TO``; above, for
  each distinct per-device batch ``ceil(B / w)`` the smallest such w, plus N. Widths of one per-device
  batch compute alike but split the batch differently, so not alike for transfers: the exhaustive set
  keeps small worlds exactly optimal. Only widths up to B (every device of a layer needs a sample), so
  with B < N no unsplit layer runs wider than B.
- split candidates (`candidate_placements`, layers with a height): ``(w, s)`` for s parts in
  `spatial_parts` (2, 3, 4, then powers of two only, which keeps large worlds fast), s dividing w, at
  most B sample groups, s at most the layer's height, and only where a part computes fewer samples'
  worth than the finest sample split can, ``ceil(B / (w / s)) / s < ceil(B / min(N, B))`` (always so
  for w > B); otherwise an unsplit width is about as fast without the halo exchange (what is left out
  gains less than one sample per device). Above ``EXHAUSTIVE_UP_TO`` devices, per number of parts,
  only the fewest groups for each per-group batch.
- branches side by side (`side_by_side`, after the DP, which places every layer from rank 0): for each
  region of independent branches (`branches.find_regions`) without a pinned layer, the branches get
  disjoint ranges of ranks by a min-max allocation, each branch's layers at one unsplit width, the best
  its range allows among the widths every layer of the branch meets the amplification limit at (full
  width's exemption does not reach a branch), and the region keeps them where `cost.evaluate` (which
  runs layers on disjoint ranks side by side) predicts a faster step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from lightning_deeppool.ir.graph import Layer, LayerGraph, under
from lightning_deeppool.ir.placement import Placement, equal_width_runs
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner import branches as branch_regions
from lightning_deeppool.planner import checks, cost, margin, memory
from lightning_deeppool.planner.plan import Plan, plan_with_widths

# Layers faster than this alone (100 us at width 1) are exempt from the amplification limit: their
# device-time is too small to matter and their profiled times are mostly launch overhead.
DEFAULT_EXEMPT_BELOW_S = 1e-4
# A plan predicted to gain less than this over full width (DDP) is not worth the risk: a profile is
# noisy, and a burst plan's gain is only as good as its prediction. Full width is chosen instead.
DEFAULT_MIN_GAIN = 0.03
# Plans within this fraction of the best predicted step are ties that noise decides: the wider one
# (closer to DDP, fewer redistributions) is chosen, so two profiles of one model give one plan.
DEFAULT_TIE_TOLERANCE = 0.01
EXHAUSTIVE_UP_TO = 64
# Every number of spatial parts up to this is a candidate; beyond it, powers of two only.
SPATIAL_EXHAUSTIVE_UP_TO = 4
DEFAULT_MAX_STATES = 4096
_REFITS = 8  # `_within_budget`'s tries
_LAMBDA_STEPS = 30


def candidate_widths(world_size: int, global_batch_size: int) -> list[int]:
    """Widths worth considering for an unpinned layer (see the module docstring)."""
    if world_size <= EXHAUSTIVE_UP_TO:
        return list(range(1, world_size + 1))
    smallest: dict[int, int] = {}
    for width in range(1, world_size + 1):
        smallest.setdefault(cost.per_device_batch(global_batch_size, width), width)
    return sorted({*smallest.values(), world_size})


def spatial_parts(world_size: int) -> list[int]:
    """Numbers of parts a sample may be split in by height: 2..4, then powers of two up to N."""
    parts = list(range(2, min(SPATIAL_EXHAUSTIVE_UP_TO, world_size) + 1))
    power = 2 ** SPATIAL_EXHAUSTIVE_UP_TO.bit_length()
    while power <= world_size:
        parts.append(power)
        power *= 2
    return parts


def candidate_placements(world_size: int, global_batch_size: int) -> list[Placement]:
    """Placements worth considering for an unpinned layer (see the module docstring): the candidate
    widths of at most B groups, then the spatial splits (for layers with a height)."""
    plain = [Placement(w) for w in candidate_widths(world_size, global_batch_size) if w <= global_batch_size]
    finest = cost.per_device_batch(global_batch_size, min(world_size, global_batch_size))
    large = world_size > EXHAUSTIVE_UP_TO
    split = []
    for parts in spatial_parts(world_size):
        seen = set()
        for groups in range(1, min(global_batch_size, world_size // parts) + 1):
            width, batch = groups * parts, cost.per_device_batch(global_batch_size, groups)
            if batch >= parts * finest or (large and batch in seen):
                continue
            seen.add(batch)
            split.append(Placement(width, parts))
    return plain + split


def resolve_pins(
    graph: LayerGraph,
    pins: Mapping[str, int | Placement | Mapping[str, object]] | None,
    world_size: int,
    global_batch_size: int | None = None,
) -> dict[str, Placement]:
    """Placement of every pinned layer. A pin is a width (int), a `Placement` or a mapping
    ``{"width": 4, "spatial": 2}`` (4 devices: 2 sample groups, each sample in 2 parts) or
    ``{"ranks": [2, 3]}`` (consecutive ranks, here 2 and 3; "spatial" may be given too). A pin matches
    a layer whose module (also without the ``_orig_mod`` of a compiled submodule) or name equals the
    prefix or starts with ``prefix + "."``; ``""`` matches everything; the longest matching prefix
    wins. Every layer a pin decides must be able to run at it (`checks.check_placement`, with
    `global_batch_size` when given)."""
    if not pins:
        return {}
    placements = {}
    for prefix, value in pins.items():
        placement = checks.as_placement(value, f"pin {prefix!r}")
        if not 1 <= placement.width <= world_size:
            raise ValueError(
                f"pin {prefix!r}: width {placement.width} is outside 1..{world_size}; pin a width between 1 "
                "and the world size"
            )
        if placement.first + placement.width > world_size:
            raise ValueError(
                f"pin {prefix!r}: ranks {placement.first}..{placement.first + placement.width - 1} are not "
                f"all in a world of {world_size} ranks (0..{world_size - 1})"
            )
        placements[prefix] = placement

    def matches(prefix: str, layer: Layer) -> bool:
        keys = [key for key in (layer.module, _uncompiled(layer.module), layer.name) if key is not None]
        return any(under(key, prefix) for key in keys)

    def inside(prefix: str, layer: Layer) -> bool:  # a graph break runs its submodules as Python
        return layer.own_samples and layer.module is not None and under(prefix, layer.module)

    for prefix in pins:
        if not any(matches(prefix, layer) or inside(prefix, layer) for layer in graph.layers):
            examples = list(dict.fromkeys(layer.module for layer in graph.layers if layer.module))[:8]
            raise ValueError(
                f"pin {prefix!r} matches no layer; pin a module name or a prefix of one, e.g. {examples}"
            )
    resolved = {}
    for layer in graph.layers:
        matching = [prefix for prefix in pins if matches(prefix, layer)]
        if matching:
            prefix = max(matching, key=len)
            try:
                checks.check_placement(
                    layer,
                    placements[prefix],
                    world_size=world_size,
                    global_batch_size=global_batch_size,
                )
            except ValueError as err:
                raise ValueError(f"pin {prefix!r}: {err}") from None
            resolved[layer.name] = placements[prefix]
    return resolved


def _uncompiled(module: str | None) -> str | None:
    """A module path as the user wrote it: without the ``_orig_mod`` that `torch.compile` inserts."""
    return module.replace("._orig_mod", "").removeprefix("_orig_mod.") if module else module


def full_width_layers(graph: LayerGraph, world_size: int) -> dict[str, Placement]:
    """Per-rank layers (reductions over each rank's own samples) and graph breaks (code run as Python on
    each rank's own samples) run at full width, whatever the pins."""
    return {
        layer.name: Placement(world_size) for layer in graph.layers if layer.per_rank or layer.own_samples
    }


def amplification(
    profile: Profile, layer: Layer, width: int | Placement, global_batch_size: int, *, halo: float = 0.0
) -> float:
    """Device-time of the layer at ``width`` (or a placement) over its time alone: ``time(w) * w / time(1)``
    (`halo`: the layer's `cost.halo_share`)."""
    placement = width if isinstance(width, Placement) else Placement(width)
    alone = cost.compute_time(profile, layer, 1, global_batch_size)
    spread = cost.compute_time(profile, layer, placement, global_batch_size, halo=halo) * placement.width
    return spread / alone if alone > 0 else 1.0


def search(
    graph: LayerGraph,
    profile: Profile,
    *,
    world_size: int,
    global_batch_size: int,
    amplification_limit: float = 2.0,
    exempt_below_s: float = DEFAULT_EXEMPT_BELOW_S,
    pins: Mapping[str, int | Placement | Mapping[str, object]] | None = None,
    memory_budget_bytes: float | None = None,
    max_states: int = DEFAULT_MAX_STATES,
    min_gain: float = DEFAULT_MIN_GAIN,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    branches: bool = True,
) -> Plan:
    """The plan with the least predicted step time.

    Hard constraints: every unpinned layer whose time at width 1 is at least ``exempt_below_s`` keeps
    ``time(w) * w <= amplification_limit * time(1)`` at its placement (width 1 and data parallelism,
    full width unsplit, always qualify; ``inf`` disables it; the plan names the layers it constrained);
    pinned layers take their pin's placement unchecked (the user's choice; `pins` as `resolve_pins`
    reads them); rank 0's estimated bytes (`memory`: parameters, gradients, optimizer state and
    activations; rank 0 holds the most) stay within ``memory_budget_bytes`` (Lagrangian relaxation).
    When the best plan is predicted to beat every unpinned layer at full width (N, or B devices when
    the batch is smaller: data parallelism) by less than `min_gain` (a fraction), or by no more than
    the layer profiles' spread over the layers the two place differently (`margin.spread_between`),
    full width is returned (never a plan predicted slower than it);
    otherwise each run of layers of one placement is widened (to full width, else to a neighbouring
    run's placement: more devices, or as many with fewer spatial parts) while the predicted step stays
    within `tie_tolerance` of the best, or within that spread of it. With `branches`, independent
    branches may then run side by side on disjoint ranks (`side_by_side`), kept only where they gain
    more than `tie_tolerance` and the plan still beats full width by `min_gain`; ``branches=False``
    places every layer from rank 0.
    The plan's `alternative` is the best plan of another shape beside it (`_alternative`), which its
    table's footer compares it with.
    """
    checks.check_sizes(world_size, global_batch_size, graph)
    checks.check_profile(graph, profile)
    if amplification_limit < 1:
        raise ValueError(
            f"amplification limit {amplification_limit} is below 1, which no width above 1 can meet; use "
            "a limit >= 1 (float('inf') disables it)"
        )
    pinned = {
        **resolve_pins(graph, pins, world_size, global_batch_size),
        **full_width_layers(graph, world_size),
    }
    tables = _Tables.build(
        graph,
        profile,
        world_size=world_size,
        global_batch_size=global_batch_size,
        amplification_limit=amplification_limit,
        exempt_below_s=exempt_below_s,
        pinned=pinned,
    )
    sizes = {"world_size": world_size, "global_batch_size": global_batch_size}
    if memory_budget_bytes is None:
        choice = _dp(tables, 0.0, max_states)
    else:
        choice = _within_budget(graph, profile, tables, memory_budget_bytes, max_states, **sizes)
    found = {layer.name: tables.placements[i] for layer, i in zip(graph.layers, choice, strict=True)}
    placements = found
    if memory_budget_bytes is None:
        placements = _prefer_wide(graph, profile, tables, placements, min_gain, tie_tolerance, **sizes)
    if branches:
        placements = side_by_side(
            graph,
            profile,
            tables,
            placements,
            pinned=set(pinned),
            min_gain=min_gain if memory_budget_bytes is None else None,
            tie_tolerance=tie_tolerance,
            memory_budget_bytes=memory_budget_bytes,
            **sizes,
        )
    plan = plan_with_widths(
        graph, profile, placements, amplification_limit=amplification_limit, limited=tables.limited, **sizes
    )
    return replace(plan, alternative=_alternative(graph, profile, tables, placements, found, **sizes))


def _alternative(
    graph: LayerGraph,
    profile: Profile,
    tables: _Tables,
    chosen: dict[str, Placement],
    found: dict[str, Placement],
    *,
    world_size: int,
    global_batch_size: int,
) -> margin.Alternative | None:
    """The best plan of another shape than `chosen`: full width (data parallelism) beside any other
    plan; beside full width, the plan the DP found where it was not full width, else the best plan
    with one layer placed otherwise (`_one_layer_changed`). None where no layer can change."""
    widest = Placement(min(world_size, global_batch_size))
    full = _full_width(tables, graph, widest)
    other: dict[str, Placement] | None
    if full is not None and full != chosen:
        other = full
    elif found != chosen:
        other = found
    else:
        other = _one_layer_changed(tables, chosen)
    if other is None:
        return None
    step = cost.evaluate(graph, profile, other, world_size=world_size, global_batch_size=global_batch_size)
    return margin.Alternative(
        margin.describe(graph, other, widest),
        step.total_s + profile.per_step_s,
        margin.spread_between(graph, profile, chosen, other, global_batch_size),
    )


def _one_layer_changed(tables: _Tables, chosen: dict[str, Placement]) -> dict[str, Placement] | None:
    """`chosen` with the one layer placed otherwise that adds the least to the step the DP minimizes
    (its own cost and its moves from and to its neighbours where `chosen` places them); None where
    no layer has another allowed placement or `chosen` places one outside the candidates."""
    index = {p: i for i, p in enumerate(tables.placements)}
    if any(placement not in index for placement in chosen.values()):
        return None
    at = [index[chosen[name]] for name in tables.names]
    column = [int(np.flatnonzero(allowed == i)[0]) for allowed, i in zip(tables.allowed, at, strict=True)]
    position = {name: k for k, name in enumerate(tables.names)}
    added = [tables.own[k] - tables.own[k][column[k]] for k in range(len(tables.names))]
    for k, layer_edges in enumerate(tables.edges):
        for producer, matrix in layer_edges:
            p = position[producer]
            added[k] = added[k] + matrix[at[p]] - matrix[at[p], column[k]]
            added[p] = added[p] + matrix[tables.allowed[p], column[k]] - matrix[at[p], column[k]]
    best: tuple[float, int, int] | None = None
    for k, seconds in enumerate(added):
        others = seconds.copy()
        others[column[k]] = np.inf
        j = int(np.argmin(others))
        if np.isfinite(others[j]) and (best is None or others[j] < best[0]):
            best = (float(others[j]), k, j)
    if best is None:
        return None
    _, k, j = best
    return {**chosen, tables.names[k]: tables.placements[int(tables.allowed[k][j])]}


def _prefer_wide(
    graph: LayerGraph,
    profile: Profile,
    tables: _Tables,
    placements: dict[str, Placement],
    min_gain: float,
    tie_tolerance: float,
    *,
    world_size: int,
    global_batch_size: int,
) -> dict[str, Placement]:
    """Full width if the best plan gains less than `min_gain` over it, or no more than the layer
    profiles' spread over the layers the two place differently (`margin.spread_between`), else the
    best plan with each run of one placement widened while it stays within `tie_tolerance` of the
    best, or within that spread of it (see `search`)."""

    def step(candidate: dict[str, Placement]) -> float:
        total = cost.evaluate(
            graph, profile, candidate, world_size=world_size, global_batch_size=global_batch_size
        )
        return total.total_s + profile.per_step_s

    def tied(candidate: dict[str, Placement], candidate_s: float) -> bool:
        """No more than the layer profiles' spread over what it places otherwise than the best."""
        spread = margin.spread_between(graph, profile, found, candidate, global_batch_size) or 0.0
        return candidate_s - best <= spread

    widest = Placement(min(world_size, global_batch_size))
    found, best = placements, step(placements)
    full = _full_width(tables, graph, widest)
    if full is not None and full != placements:
        full_s = step(full)
        if best > (1 - min_gain) * full_s or tied(full, full_s):
            return full
    allowed = {
        layer.name: {tables.placements[i] for i in indices}
        for layer, indices in zip(graph.layers, tables.allowed, strict=True)
    }
    runs = equal_width_runs((layer.name for layer in graph.layers), placements)
    for i, run in enumerate(runs):
        current = placements[run[0]]
        neighbours = {placements[r[0]] for r in runs[max(i - 1, 0) : i + 2]}
        for option in sorted({widest, *neighbours}, key=_breadth, reverse=True):
            if _breadth(option) <= _breadth(current) or any(option not in allowed[name] for name in run):
                continue
            trial = {**placements, **dict.fromkeys(run, option)}
            trial_s = step(trial)
            if trial_s <= (1 + tie_tolerance) * best or tied(trial, trial_s):
                placements = trial
                break
    return placements


def side_by_side(
    graph: LayerGraph,
    profile: Profile,
    tables: _Tables,
    placements: dict[str, Placement],
    *,
    pinned: set[str],
    min_gain: float | None,
    tie_tolerance: float,
    memory_budget_bytes: float | None,
    world_size: int,
    global_batch_size: int,
) -> dict[str, Placement]:
    """`placements` with the branches of each region (`branches.find_regions`) without a pinned layer
    on disjoint ranks (`_allocate`) where `cost.evaluate` predicts a faster step and, with a memory
    budget, every rank's estimated bytes stay within it. Unchanged unless the regions kept gain more
    than `tie_tolerance` (ties keep every layer from rank 0) and, with `min_gain`, the result beats
    full width by `min_gain` as `search` requires."""
    sizes = {"world_size": world_size, "global_batch_size": global_batch_size}

    def fits(candidate: dict[str, Placement]) -> bool:
        if memory_budget_bytes is None:
            return True
        return max(memory.memory_per_rank(graph, candidate, profile=profile, **sizes)) <= memory_budget_bytes

    regions = [r for r in branch_regions.find_regions(graph) if not pinned.intersection(r.layers)]
    if not regions:
        return placements
    start = cost.evaluate(graph, profile, placements, **sizes)
    best, current = start.total_s, placements
    layer_costs = start.layers
    allocate = _Allocation(tables, graph)
    for region in regions:
        allocated = allocate(region, current)
        if allocated is None:
            continue
        estimate, trial = allocated
        readers = {m for name in region.layers for m in allocate.readers[name]} - set(region.layers)
        serial = sum(layer_costs[name].total_s for name in region.layers)
        if estimate >= serial + sum(layer_costs[name].transfer_s for name in readers):
            continue  # side by side, the branches would not even finish sooner
        candidate = {**current, **trial}
        step = cost.evaluate(graph, profile, candidate, **sizes)
        if step.total_s < best and fits(candidate):
            best, current, layer_costs = step.total_s, candidate, step.layers
    if best > (1 - tie_tolerance) * start.total_s:
        return placements
    if min_gain is not None:
        full = _full_width(tables, graph, Placement(min(world_size, global_batch_size)))
        if full is not None:
            full_s = cost.evaluate(graph, profile, full, **sizes).total_s + profile.per_step_s
            if best + profile.per_step_s > (1 - min_gain) * full_s:
                return placements
    return current


class _Allocation:
    """Disjoint rank ranges for a region's branches, each branch's layers at one width (`__call__`)."""

    def __init__(self, tables: _Tables, graph: LayerGraph) -> None:
        self._tables = tables
        self._graph = graph
        self._position = {name: k for k, name in enumerate(tables.names)}
        self._index = {p: i for i, p in enumerate(tables.placements)}
        self._plain = np.array(
            [i for i, p in enumerate(tables.placements) if p.spatial == 1 and p.first == 0], dtype=np.int64
        )
        self.readers: dict[str, list[str]] = {name: [] for name in tables.names}  # layers reading it
        for name, layer_edges in zip(tables.names, tables.edges, strict=True):
            for producer, _ in layer_edges:
                self.readers[producer].append(name)

    def __call__(
        self, region: branch_regions.Region, placements: Mapping[str, Placement]
    ) -> tuple[float, dict[str, Placement]] | None:
        """The allocation minimizing the slowest branch's seconds (`_branch_seconds`), by bisection on
        that time, each branch taking the fewest devices within it (a branch's least time on at most k
        devices only falls with k). The branch with the most parameter bytes starts at rank 0 (its
        gradients need no message to rank 0), the others follow in order. Returns the slowest branch's
        seconds and the placements; None where the branches fit no ranges."""
        widths = self._tables.widths[self._plain]
        seconds = [self._branch_seconds(branch, placements)[self._plain] for branch in region.branches]
        bounds = np.unique(np.concatenate(seconds))
        bounds = bounds[np.isfinite(bounds)]

        def needs(bound: float) -> list[int] | None:
            """Per branch, the index (into the plain candidates) of the fewest devices within `bound`;
            None if they do not fit the world."""
            chosen = []
            for at in seconds:
                within = np.flatnonzero(at <= bound)
                if not len(within):
                    return None
                chosen.append(int(within[0]))
            return chosen if int(widths[chosen].sum()) <= self._tables.world_size else None

        low, high = 0, len(bounds) - 1
        if high < 0 or needs(float(bounds[high])) is None:
            return None
        while low < high:
            middle = (low + high) // 2
            if needs(float(bounds[middle])) is None:
                low = middle + 1
            else:
                high = middle
        chosen = needs(float(bounds[low]))
        assert chosen is not None
        order = sorted(
            range(len(region.branches)),
            key=lambda j: (-sum(self._graph.layer(name).param_bytes for name in region.branches[j]), j),
        )
        trial, first = {}, 0
        for j in order:
            width = int(widths[chosen[j]])
            trial.update(dict.fromkeys(region.branches[j], Placement(width, 1, first)))
            first += width
        return float(bounds[low]), trial

    def _branch_seconds(self, branch: tuple[str, ...], placements: Mapping[str, Placement]) -> np.ndarray:
        """Seconds of the branch with every layer at each candidate (inf where some layer may not run at
        it): its layers' `_Tables.own` plus the moves of values between it and the layers outside it at
        their `placements`, as from rank 0 (a placement not among the candidates is left out)."""
        tables = self._tables
        total = np.zeros(len(tables.placements))
        inside = set(branch)
        for name in branch:
            k = self._position[name]
            seconds = np.full(len(tables.placements), np.inf)
            seconds[tables.allowed[k]] = tables.own[k]
            for producer, matrix in tables.edges[k]:
                row = self._candidate(placements[producer])
                if producer not in inside and row is not None:
                    seconds[tables.allowed[k]] += matrix[row]
            for reader in self.readers[name]:
                m = self._position[reader]
                column = np.flatnonzero(tables.allowed[m] == self._candidate(placements[reader]))
                if reader not in inside and len(column):
                    matrix = next(matrix for producer, matrix in tables.edges[m] if producer == name)
                    seconds += matrix[:, column[0]]
            total += seconds
        return total

    def _candidate(self, placement: Placement) -> int | None:
        """Index of `placement`, or of its width and split from rank 0, among the candidates."""
        return self._index.get(placement, self._index.get(placement._replace(first=0)))


def _breadth(placement: Placement) -> tuple[int, int]:
    """Wider first: more devices, then (on as many) fewer spatial parts, closer to data parallelism."""
    return placement.width, -placement.spatial


def _full_width(tables: _Tables, graph: LayerGraph, widest: Placement) -> dict[str, Placement] | None:
    """Every layer at `widest` but the pinned ones, if the constraints allow it."""
    full = {}
    for layer, allowed in zip(graph.layers, tables.allowed, strict=True):
        options = [tables.placements[i] for i in allowed]
        if len(options) == 1 and options[0] != widest:
            full[layer.name] = options[0]  # pinned
        elif widest in options:
            full[layer.name] = widest
        else:
            return None
    return full


@dataclass(frozen=True)
class _Tables:
    """Per-layer cost vectors over its allowed placements, indexed into the shared candidate list."""

    placements: list[Placement]  # (C,) candidate placements
    allowed: list[np.ndarray]  # per layer: indices into `placements`
    own: list[np.ndarray]  # per layer: compute + sync + halo + transfers from graph inputs and to outputs
    memory: list[np.ndarray]  # per layer: bytes on each of its devices
    edges: list[list[tuple[str, np.ndarray]]]  # per layer: (producer layer, (C, allowed) transfer s)
    last_use: dict[str, int]  # layer -> position of its last consumer (absent: none)
    names: list[str]
    limited: tuple[str, ...]  # layers the amplification limit kept from some placements
    widths: np.ndarray  # (C,) each candidate's width
    world_size: int

    @classmethod
    def build(
        cls,
        graph: LayerGraph,
        profile: Profile,
        *,
        world_size: int,
        global_batch_size: int,
        amplification_limit: float,
        exempt_below_s: float,
        pinned: Mapping[str, Placement],
    ) -> _Tables:
        tallest = max((layer.height for layer in graph.layers if layer.name not in pinned), default=0)
        base = [
            p for p in candidate_placements(world_size, global_batch_size) if p.spatial <= max(tallest, 1)
        ]
        full = Placement(world_size)  # where graph inputs and outputs live
        placements = sorted({*base, *pinned.values(), full, Placement(1)})
        index = {p: i for i, p in enumerate(placements)}
        widths = np.array([p.width for p in placements])
        spatial = np.array([p.spatial for p in placements])
        batches = -(-global_batch_size // (widths // spatial))
        plain = np.array([index[p] for p in base if p.spatial == 1])
        split = np.array([index[p] for p in base if p.spatial > 1], dtype=np.int64)
        transfer = _TransferTable(profile, placements, world_size, global_batch_size)
        outputs = set(cost.output_layers(graph))

        widest = min(world_size, global_batch_size)
        allowed, own, memory_of, edges, limited = [], [], [], [], []
        for layer in graph.layers:
            halo = cost.halo_share(graph, layer)
            if layer.name in pinned:
                idx = np.array([index[pinned[layer.name]]])
                times = _times(profile, layer, idx, batches, spatial, halo)
            else:
                idx = np.concatenate([plain, split[spatial[split] <= layer.height]])
                times = _times(profile, layer, idx, batches, spatial, halo)
                alone = float(times[widths[idx] == 1][0])
                ok = _within_limit(times, widths[idx], alone, amplification_limit, exempt_below_s)
                # Data parallelism is exempt, as DDP is: no plan is ever denied it.
                ok |= (widths[idx] == widest) & (spatial[idx] == 1)
                if not ok.all():
                    limited.append(layer.name)
                idx, times = idx[ok], times[ok]
            sync = np.array([cost.sync_time(profile.comm, layer, placements[i]) for i in idx])
            halos = [cost.halo_time(profile.comm, layer, placements[i], global_batch_size) for i in idx]
            vector = times + sync + np.array(halos)
            layer_edges = []
            for name in dict.fromkeys(layer.inputs):
                rows = cost.value_rows(graph, name, layer)
                matrix = transfer.seconds(graph.value_sample_bytes(name), rows)[:, idx]
                if graph.position(name) >= 0:
                    layer_edges.append((name, matrix))
                else:
                    directions = cost.move_directions(graph, name)
                    vector = vector + matrix[index[full]] * directions / cost.DIRECTIONS
            if layer.name in outputs:
                rows = cost.value_rows(graph, layer.name, None)
                vector = vector + transfer.seconds(layer.sample_bytes, rows)[idx, index[full]]
            allowed.append(idx)
            own.append(vector)
            # Rank 0 holds a layer it does not run (pinned to other ranks): its parameters, gradients
            # and optimizer state, not its activations.
            away = np.array([placements[i].first > 0 for i in idx], dtype=bool)
            on_rank_zero = _memory(profile, layer, batches[idx], spatial[idx], halo)
            memory_of.append(np.where(away, memory.held_bytes(layer.param_bytes, profile), on_rank_zero))
            edges.append(layer_edges)
        last_use = {name: k for k, layer in enumerate(graph.layers) for name in layer.inputs}
        names = [layer.name for layer in graph.layers]
        return cls(
            placements, allowed, own, memory_of, edges, last_use, names, tuple(limited), widths, world_size
        )


def _times(
    profile: Profile,
    layer: Layer,
    idx: np.ndarray,
    batches: np.ndarray,
    spatial: np.ndarray,
    halo: float,
) -> np.ndarray:
    """Compute seconds at candidates `idx`: profiled times at their per-device batches (the profile's
    own error outside its range), split by height at their fractional `cost.effective_samples`."""
    measured = profile.layer(layer.name)
    batch, parts = batches[idx], spatial[idx]
    unsplit = parts == 1
    times = np.empty(len(idx))
    if unsplit.any():
        for size in (int(batch[unsplit].min()), int(batch[unsplit].max())):
            measured.time(size)
        times[unsplit] = np.interp(batch[unsplit], measured.batch_sizes, measured.seconds)
    if not unsplit.all():
        shares = [cost.row_share(layer, int(s), halo) for s in parts[~unsplit]]
        times[~unsplit] = cost.fractional_time(measured, batch[~unsplit] * np.array(shares))
    return times


def _memory(
    profile: Profile, layer: Layer, batches: np.ndarray, spatial: np.ndarray, halo: float
) -> np.ndarray:
    """Bytes on each device of the layer at per-device `batches` split by height in `spatial` parts:
    its activations (`memory.per_sample_activations`) and what it holds (`memory.held_bytes`); the input
    copies a placement makes depend on its neighbours' and are counted once a plan is chosen
    (`_within_budget`)."""
    shares = np.array([cost.row_share(layer, int(s)) for s in spatial])
    kept = memory.per_sample_activations(layer, profile, batches) * batches * shares
    return kept + memory.held_bytes(layer.param_bytes, profile)


def _within_limit(
    times: np.ndarray, widths: np.ndarray, alone: float, limit: float, exempt_below_s: float
) -> np.ndarray:
    """Mask of placements meeting the amplification limit; times[i] is the time at widths[i] devices and
    `alone` the time at width 1."""
    if math.isinf(limit) or alone < exempt_below_s:
        return np.ones(len(widths), dtype=bool)
    return (times * widths <= limit * alone) | (widths == 1)


class _TransferTable:
    """Seconds (both directions) to move a value between any two candidate placements, per sample size
    and (where a side is split by height) the value's rows."""

    def __init__(
        self, profile: Profile, placements: list[Placement], world_size: int, global_batch_size: int
    ) -> None:
        self._placements = placements
        self._sizes = (world_size, global_batch_size)
        unsplit = [Placement(p.width, 1, p.first) for p in placements]
        self._plain = cost.busiest_shares(unsplit, 1, world_size, global_batch_size).astype(np.int64)
        self._split = np.array([p.spatial > 1 for p in placements])
        self._comm = profile.comm
        self._busiest: dict[int, tuple[np.ndarray, np.ndarray, tuple[int, int]]] = {}
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def _shares(self, rows: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
        """Distinct busiest shares between every pair, and where each pair's is; a pair with a side
        split by height has its share negated, to be priced as the spatial layers' messages."""
        rows = rows if self._split.any() else 0
        if rows not in self._busiest:
            busiest: np.ndarray = self._plain
            if rows:
                either = self._split[:, None] | self._split[None, :]
                shares = cost.busiest_shares(self._placements, rows, *self._sizes)
                busiest = np.where(either, -shares, self._plain)
            values, inverse = np.unique(busiest, return_inverse=True)
            self._busiest[rows] = values, inverse, busiest.shape
        return self._busiest[rows]

    def seconds(self, sample_bytes: int, rows: int) -> np.ndarray:
        key = (sample_bytes, rows if self._split.any() else 0)
        if key not in self._cache:
            values, inverse, shape = self._shares(rows)
            comm = self._comm
            per_value = np.array(
                [
                    comm.redistribute_time(v * sample_bytes) if v >= 0 else comm.halo_time(-v * sample_bytes)
                    for v in values.tolist()
                ]
            )
            self._cache[key] = cost.DIRECTIONS * per_value[inverse].reshape(shape)
        return self._cache[key]


@dataclass(frozen=True)
class _DPLayer:
    """What reconstruction needs of one DP step: the incoming states sorted by group, and per new state
    its group and chosen column."""

    live: list[str]
    order: np.ndarray  # sorted position -> row of the previous step's states
    states: np.ndarray
    costs: np.ndarray
    starts: np.ndarray
    group: np.ndarray
    column: np.ndarray


def _dp(tables: _Tables, weight: float, max_states: int) -> list[int]:
    """Candidate index per layer minimizing the sum of (own + weight * memory) and edge transfers."""
    live: list[str] = []
    states = np.zeros((1, 0), dtype=np.int64)
    costs = np.zeros(1)
    steps = []
    for k, name in enumerate(tables.names):
        keep = [i for i, value in enumerate(live) if tables.last_use[value] > k]
        order, starts = _sort_groups(states[:, keep], len(tables.placements))
        states, costs = states[order], costs[order]
        best = np.minimum.reduceat(_step_costs(tables, k, live, states, costs, weight), starts, axis=0)
        kept = states[starts][:, keep]
        groups, cols = best.shape
        stays_live = tables.last_use.get(name, -1) > k
        if stays_live:
            group, column = np.repeat(np.arange(groups), cols), np.tile(np.arange(cols), groups)
            new_states = np.hstack([kept[group], tables.allowed[k][column][:, None]])
            new_costs = best.ravel()
        else:
            group, column = np.arange(groups), best.argmin(axis=1)
            new_states, new_costs = kept, best[group, column]
        if len(new_costs) > max_states:
            survivors = np.argpartition(new_costs, max_states - 1)[:max_states]
            group, column, new_states, new_costs = (
                group[survivors],
                column[survivors],
                new_states[survivors],
                new_costs[survivors],
            )
        steps.append(_DPLayer(live, order, states, costs, starts, group, column))
        live = [live[i] for i in keep] + ([name] if stays_live else [])
        states, costs = new_states, new_costs
    return _reconstruct(tables, steps, int(np.argmin(costs)), weight)


def _step_costs(
    tables: _Tables,
    k: int,
    live: list[str],
    states: np.ndarray,
    costs: np.ndarray,
    weight: float,
    column: int | slice = slice(None),
) -> np.ndarray:
    """Cost so far plus layer k's own cost and incoming transfers, per state and allowed width (or one)."""
    step = np.add.outer(costs, (tables.own[k] + weight * tables.memory[k])[column])
    for producer, matrix in tables.edges[k]:
        step += np.take(matrix[:, column], states[:, live.index(producer)], axis=0)
    return step


def _reconstruct(tables: _Tables, steps: list[_DPLayer], row: int, weight: float) -> list[int]:
    """Walk back from the best final state, recomputing each step's arg-min within the chosen group."""
    choice = []
    for k in reversed(range(len(steps))):
        step = steps[k]
        group, column = int(step.group[row]), int(step.column[row])
        choice.append(int(tables.allowed[k][column]))
        end = int(step.starts[group + 1]) if group + 1 < len(step.starts) else len(step.states)
        members = np.arange(int(step.starts[group]), end)
        values = _step_costs(tables, k, step.live, step.states[members], step.costs[members], weight, column)
        row = int(step.order[members[np.argmin(values)]])
    return choice[::-1]


def _sort_groups(kept: np.ndarray, radix: int) -> tuple[np.ndarray, np.ndarray]:
    """Order that brings states with equal kept columns together, and where each group starts."""
    if kept.shape[1] == 0:
        return np.arange(len(kept)), np.zeros(1, dtype=np.int64)
    if kept.shape[1] * math.log2(radix) < 62:
        keys = kept @ (radix ** np.arange(kept.shape[1], dtype=np.int64))
    else:
        keys = np.unique(kept, axis=0, return_inverse=True)[1].reshape(-1)
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    return order, np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])


def _within_budget(
    graph: LayerGraph,
    profile: Profile,
    tables: _Tables,
    budget: float,
    max_states: int,
    *,
    world_size: int,
    global_batch_size: int,
) -> list[int]:
    """`_fit_memory`'s choice under `budget` lowered by what the chosen plan's whole estimate
    (`memory.memory_per_rank`, with the input copies its placements make) exceeds it by, until that
    estimate fits."""
    sizes = {"world_size": world_size, "global_batch_size": global_batch_size}
    target = budget
    for _ in range(_REFITS):
        choice = _fit_memory(tables, target, max_states)
        placements = {layer.name: tables.placements[i] for layer, i in zip(graph.layers, choice, strict=True)}
        over = max(memory.memory_per_rank(graph, placements, profile=profile, **sizes)) - budget
        if over <= 0:
            return choice
        target -= over
    raise ValueError(
        f"no plan found within the memory budget of {budget:,.0f} bytes once the copies of values "
        "moved between placements are counted; raise the budget or lower the global batch size"
    )


def _fit_memory(tables: _Tables, budget: float, max_states: int) -> list[int]:
    """Fastest choice whose rank-0 memory fits the budget: bisect the Lagrange weight on memory."""

    def memory(choice: list[int]) -> float:
        return sum(
            float(m[np.flatnonzero(idx == c)[0]])
            for m, idx, c in zip(tables.memory, tables.allowed, choice, strict=True)
        )

    choice = _dp(tables, 0.0, max_states)
    if memory(choice) <= budget:
        return choice
    least = sum(float(m.min()) for m in tables.memory)
    if least > budget:
        raise ValueError(
            f"even the plan with the least memory needs {least:,.0f} bytes on rank 0, over the budget "
            f"of {budget:,.0f} bytes; lower the global batch size, relax the amplification limit or "
            "pins, or raise the budget"
        )
    low, high = 0.0, 1e-18
    while memory(best := _dp(tables, high, max_states)) > budget:
        low, high = high, high * 10
        if high > 1e6:
            raise ValueError(f"no plan found within the memory budget of {budget:,.0f} bytes")
    for _ in range(_LAMBDA_STEPS):
        middle = (low + high) / 2
        choice = _dp(tables, middle, max_states)
        if memory(choice) <= budget:
            high, best = middle, choice
        else:
            low = middle
    return best
