"""The cost model: predicted seconds of one training step for a placement of every layer. Pure
functions, no torch. A layer at `Placement(w, s)` (a plain int is width w, s = 1) runs as
``g = w // s`` sample groups of s consecutive ranks, each sample split by height in s parts;
``b = ceil(B / g)`` is its per-device batch. Per layer:

- compute: the profiled fwd+bwd time at b. Split by height, a part computes ``ceil(H / s)`` of the H
  rows plus the halo it reads: the time at ``b * min(1, ceil(H / s) / H + halo share)`` samples
  (`effective_samples`), interpolated between profiled batches and, below the smallest, along the
  line through the two smallest, never below 0, so a fixed per-call cost does not shrink
  (`fractional_time`).
- sync: its gradients all-reduced among its w devices (its ranks, however the samples are split),
  plus, for a layer that rank 0 does not run (``first > 0``), one message of them to rank 0, which
  holds every parameter and updates it (`sync_time`). A parameter several layers share is reduced
  once, among the ranks of all its users, and charged to the widest (`synced_bytes`,
  `sync_group_sizes`); the search's DP, seeing one layer at a time, charges it to its first user.
- transfer: activations forward and their gradients backward on every edge whose ends have different
  placements, charged to the consumer (a graph output's return to width N: to its producer). Sized by
  the samples the busiest rank sends or receives (`busiest_samples`) or, with an end split by height,
  its share of samples, rows counted as fractions of a sample of the consumer's height
  (`busiest_shares`, `value_rows`), then priced as the spatial layers' messages
  (`CommProfile.halo_time`: the runtime moves values on their links where they have them).
- halo, split by height: ``halo_bytes * b`` out and the halo gradients back (`halo_time`), charged to
  the layer's transfer.
- overlap (`hidden_sync`): with ``comm.overlap``, gradient all-reduces run beside backward as the
  runtime launches them: layers' gradients in buckets cut as the runtime cuts them (per run of one
  placement, in backward order, by `buckets.cut_into_buckets`), a bucket starting once the backward
  of its last layer is done (`BACKWARD_SHARE` of the layer's compute and half its transfers) and the
  bucket before it has been reduced. The step is the later of backward's end and the last
  all-reduce's; the sync seconds that fit before it are `StepCost.hidden_s`.
- contention (`hidden_sync`): compute beside an all-reduce loses ``comm.contention`` of its speed
  (the all-reduce's kernels share the device's multiprocessors and memory), so backward ends
  ``contention`` seconds later per all-reduce second before its end, and the step is the later of
  that end and the last all-reduce's; what this adds is `StepCost.contention_s`. Transfers beside an
  all-reduce are not slowed, nor the all-reduce by the compute.
- concurrency (`scheduled_step`): layers on disjoint ranks (independent branches, ``first > 0``) run
  side by side. Each rank runs its layers' forward in execution order and their backward in reverse,
  a layer starting once all its ranks are free and its inputs (forward) or its consumers' gradients
  (backward) are there; its transfers run on its own ranks. All-reduces on disjoint ranks run side by
  side too. The step is the latest rank's clock; `StepCost.concurrent_s` is what that saves over
  running every layer one after the other (0 when every layer starts at rank 0).
- memory: `planner.memory` estimates it per rank, apart from time.
- sizes: graph inputs and outputs live at width N (with B < N, ranks B.. hold no sample). Every layer
  needs ``g <= B``, so with B < N only layers split by height run wider than B, and layers that reduce
  over each rank's samples (`Layer.per_rank`) cannot run at all (`checks.check_sizes`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_deeppool.ir.buckets import cut_into_buckets
from lightning_deeppool.ir.graph import Layer, LayerGraph
from lightning_deeppool.ir.placement import Placement, equal_width_runs, per_device_batch
from lightning_deeppool.ir.profile import CommProfile, LayerProfile, Profile
from lightning_deeppool.planner.checks import check_sizes

# Forward activations plus backward gradients: every redistribution happens twice per step.
DIRECTIONS = 2
# Of a layer's profiled forward+backward time, the share backward takes: it computes the gradients of
# the layer's input and of its weights, two products to forward's one.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class LayerCost:
    """Predicted seconds of one layer at its placement."""

    compute_s: float
    sync_s: float
    transfer_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.sync_s + self.transfer_s


@dataclass(frozen=True)
class StepCost:
    """Per-layer costs (execution order) and the predicted step time: their sum (`serial_s`) less the
    all-reduce seconds that run beside backward (`hidden_s`, see `hidden_sync`) and the seconds saved
    by layers on disjoint ranks running side by side (`concurrent_s`, see `scheduled_step`), plus what
    the all-reduces beside backward slow it by (`contention_s`)."""

    layers: dict[str, LayerCost]
    hidden_s: float = 0.0
    concurrent_s: float = 0.0
    contention_s: float = 0.0

    @property
    def serial_s(self) -> float:
        """Every layer's compute, sync and transfer one after the other."""
        return sum(cost.total_s for cost in self.layers.values())

    @property
    def total_s(self) -> float:
        return self.serial_s - self.hidden_s - self.concurrent_s + self.contention_s


def halo_share(graph: LayerGraph, layer: Layer) -> float:
    """What a middle part of the layer reads from its neighbours, as a share of a sample of its (first)
    input: ``halo_bytes`` over that input's bytes per sample (0 without a halo)."""
    if not layer.halo_bytes or not layer.inputs:
        return 0.0
    sample_bytes = graph.value_sample_bytes(layer.inputs[0])
    return layer.halo_bytes / sample_bytes if sample_bytes else 0.0


def row_share(layer: Layer, spatial: int, halo: float = 0.0) -> float:
    """Share of a sample one part computes and holds: 1 unsplit, else ``ceil(H / s) / H`` plus the
    `halo` share it reads from its neighbours, at most 1."""
    if spatial == 1:
        return 1.0
    return min(1.0, math.ceil(layer.height / spatial) / layer.height + halo)


def effective_samples(layer: Layer, placement: Placement, global_batch_size: int, halo: float = 0.0) -> float:
    """The samples' worth one device of the layer computes: its group's ``ceil(B / groups)`` samples,
    times the share of each it computes (`row_share`)."""
    batch = per_device_batch(global_batch_size, placement.groups)
    return batch * row_share(layer, placement.spatial, halo)


def fractional_time(measured: LayerProfile, samples: np.ndarray | float) -> np.ndarray:
    """Seconds at (fractional) sample counts: linear between profiled batch sizes; below the smallest,
    along the line through the two smallest (through the origin if only one was profiled), never below
    0; above the largest, the profile's out-of-range error."""
    x = np.asarray(samples, dtype=float)
    batches = np.asarray(measured.batch_sizes, dtype=float)
    seconds = np.asarray(measured.seconds, dtype=float)
    if x.size and float(x.max()) > batches[-1]:
        measured.time(math.ceil(float(x.max())))  # raises, naming the profiled range
    if len(batches) > 1:
        slope = (seconds[1] - seconds[0]) / (batches[1] - batches[0])
    else:
        slope = seconds[0] / batches[0]
    below = np.maximum(seconds[0] + slope * (x - batches[0]), 0.0)
    return np.where(x < batches[0], below, np.interp(x, batches, seconds))


def compute_time(
    profile: Profile, layer: Layer, width: int | Placement, global_batch_size: int, *, halo: float = 0.0
) -> float:
    """Profiled fwd+bwd seconds at ``ceil(B / width)``, which raises outside the profiled batch sizes;
    split by height, at the fractional `effective_samples` (`halo`: the layer's `halo_share`)."""
    placement = Placement.of(width)
    measured = profile.layer(layer.name)
    if placement.spatial == 1:
        return measured.time(per_device_batch(global_batch_size, placement.width))
    return float(fractional_time(measured, effective_samples(layer, placement, global_batch_size, halo)))


def halo_time(comm: CommProfile, layer: Layer, width: int | Placement, global_batch_size: int) -> float:
    """Seconds of the layer's halo exchange, forward and backward (0 unless split by height): a middle
    part's `halo_bytes` for each of its group's samples."""
    placement = Placement.of(width)
    if placement.spatial == 1:
        return 0.0
    samples = per_device_batch(global_batch_size, placement.groups)
    return DIRECTIONS * comm.halo_time(layer.halo_bytes * samples)


def sync_time(comm: CommProfile, layer: Layer, width: int | Placement) -> float:
    """Seconds to all-reduce the layer's gradients among its ``width`` devices (0 at width 1), plus
    their message to rank 0 where rank 0 does not run the layer (`to_rank_zero_time`)."""
    placement = Placement.of(width)
    return comm.allreduce_time(placement.width, layer.param_bytes) + to_rank_zero_time(
        comm, placement, layer.param_bytes
    )


def to_rank_zero_time(comm: CommProfile, placement: Placement, nbytes: float) -> float:
    """Seconds to send `nbytes` of summed gradients to rank 0, which holds every parameter, from a layer
    at `placement` that rank 0 does not run (0 where it does): what all-reducing them between two
    devices costs, which moves as many bytes each way, of gradients written afresh as these are."""
    return comm.allreduce_time(2, nbytes) if placement.first > 0 else 0.0


def synced_bytes(graph: LayerGraph, widths: Mapping[str, int]) -> dict[str, int]:
    """Gradient bytes each layer's sync all-reduces under `widths`: its own parameters, a shared one
    moved from its first user to its widest (the first of them), where the runtime reduces it."""
    synced = {layer.name: layer.param_bytes for layer in graph.layers}
    for tied in graph.tied:
        widest = max(tied.users, key=lambda name: (widths[name], -graph.position(name)))
        synced[tied.users[0]] -= tied.param_bytes
        synced[widest] += tied.param_bytes
    return synced


def sync_group_sizes(graph: LayerGraph, placements: Mapping[str, Placement]) -> dict[str, int]:
    """Devices each layer's sync all-reduces among: its width, or, for the widest user of a shared
    parameter, the ranks of all its users (the same where every layer starts at rank 0)."""
    sizes = {name: placement.width for name, placement in placements.items()}
    for tied in graph.tied:
        widest = max(tied.users, key=lambda name: (sizes[name], -graph.position(name)))
        users = set().union(*(placements[name].ranks for name in tied.users))
        sizes[widest] = max(sizes[widest], len(users))
    return sizes


def transfer_time(
    comm: CommProfile,
    sample_bytes: int,
    src_width: int | Placement,
    dst_width: int | Placement,
    *,
    world_size: int,
    global_batch_size: int,
    rows: int = 0,
    directions: int = DIRECTIONS,
) -> float:
    """Seconds to redistribute one value between two placements, forward and backward (`directions`
    1: forward only, for a value without gradient; 0 if the placements are equal).

    Between widths the busiest rank's whole samples (`busiest_samples`); where either side is split by
    height, its share of samples with rows as fractions (`busiest_shares`) of a value of `rows` rows,
    priced as the spatial layers' messages.
    """
    src, dst = Placement.of(src_width), Placement.of(dst_width)
    if src == dst:
        return 0.0
    split = src.spatial > 1 or dst.spatial > 1
    if split and rows < 1:
        raise ValueError(f"moving a value between {src} and {dst} needs its rows (>= 1), got {rows}")
    share = _busiest_share(src, dst, rows if split else 1, world_size, global_batch_size)
    price = comm.halo_time if split else comm.redistribute_time
    return directions * price(share * sample_bytes)


def move_directions(graph: LayerGraph, value: str) -> int:
    """How often a step moves `value` between placements: forward and backward, or forward only for a
    graph input that does not require grad (a batch's data)."""
    if graph.position(value) >= 0:
        return DIRECTIONS
    return next(DIRECTIONS if i.requires_grad else 1 for i in graph.inputs if i.name == value)


@functools.lru_cache(maxsize=1 << 16)
def _busiest_share(
    src: Placement, dst: Placement, rows: int, world_size: int, global_batch_size: int
) -> float:
    # Plans repeat a few pairs of placements on many edges, and the search costs many plans.
    return float(busiest_shares([src, dst], rows, world_size, global_batch_size)[0, 1])


def busiest_samples(widths: np.ndarray, world_size: int, global_batch_size: int) -> np.ndarray:
    """``placement.busiest_rank_samples`` between the ``placement.balanced`` layouts of every pair of widths
    (`busiest_shares` of unsplit placements)."""
    unsplit = [Placement(int(width)) for width in widths]
    return busiest_shares(unsplit, 1, world_size, global_batch_size).astype(np.int64)


def busiest_shares(
    placements: Sequence[Placement], rows: int, world_size: int, global_batch_size: int
) -> np.ndarray:
    """``placement.busiest_rank_share`` between the ``placement.Layout.of`` layouts of every pair of
    placements, for a value of `rows` rows. Vectorized (the reference is quadratic in the world size):
    a rank's block under each layout is a range of samples times a range of rows, and it sends
    (receives) what it holds under the old (new) layout minus the overlap of its two blocks."""
    widths = np.array([p.width for p in placements])
    spatial = np.array([p.spatial for p in placements])
    ranks = np.arange(world_size) - np.array([p.first for p in placements])[:, None]  # from each first
    groups = widths // spatial
    group = ranks // spatial[:, None]
    base, extra = np.divmod(global_batch_size, groups)
    inside = (ranks >= 0) & (group < groups[:, None])
    counts = np.where(inside, base[:, None] + (group < extra[:, None]), 0)
    starts = group * base[:, None] + np.minimum(group, extra[:, None])
    part = ranks % spatial[:, None]
    row_base, row_extra = np.divmod(rows, spatial)
    row_counts = row_base[:, None] + (part < row_extra[:, None])
    row_starts = part * row_base[:, None] + np.minimum(part, row_extra[:, None])
    held = counts * row_counts
    busiest = np.empty((len(placements), len(placements)))
    for i in range(len(placements)):
        samples = np.minimum(starts[i] + counts[i], starts + counts) - np.maximum(starts[i], starts)
        common = np.minimum(row_starts[i] + row_counts[i], row_starts + row_counts) - np.maximum(
            row_starts[i], row_starts
        )
        kept = np.clip(samples, 0, None) * np.clip(common, 0, None)
        busiest[i] = np.maximum(held[i] - kept, held - kept).max(axis=1) / rows
    return busiest


def value_rows(graph: LayerGraph, producer: str, consumer: Layer | None) -> int:
    """Rows of a value's split dimension, for costing a move to or from a split by height: the consuming
    layer's height, else (a graph output, or a consumer that cannot be split) the producing layer's,
    else 0 (neither end can be split)."""
    if consumer is not None and consumer.height:
        return consumer.height
    if graph.position(producer) >= 0:
        return graph.layer(producer).height
    return 0


def edges(graph: LayerGraph) -> list[tuple[str, str]]:
    """Every (producer, consumer) value edge, once each, in execution order of the consumer."""
    return [(name, layer.name) for layer in graph.layers for name in dict.fromkeys(layer.inputs)]


def output_layers(graph: LayerGraph) -> list[str]:
    """Layers whose value is a graph output (each once): they return it to width N."""
    return [name for name in dict.fromkeys(graph.outputs) if graph.position(name) >= 0]


def evaluate(
    graph: LayerGraph,
    profile: Profile,
    widths: Mapping[str, int | Placement],
    *,
    world_size: int,
    global_batch_size: int,
) -> StepCost:
    """Predicted per-layer costs of an assignment ``{layer name: width or Placement}`` covering every
    layer (placements are not checked here: `plan.plan_with_widths` does, with `checks`)."""
    check_sizes(world_size, global_batch_size, graph)
    placements = {name: Placement.of(value) for name, value in widths.items()}
    full = Placement(world_size)

    def placement_of(name: str) -> Placement:
        return placements[name] if graph.position(name) >= 0 else full

    def move(value: str, src: Placement, dst: Placement, consumer: Layer | None) -> float:
        return transfer_time(
            profile.comm,
            graph.value_sample_bytes(value),
            src,
            dst,
            world_size=world_size,
            global_batch_size=global_batch_size,
            rows=value_rows(graph, value, consumer),
            directions=move_directions(graph, value),
        )

    synced = synced_bytes(graph, {name: placement.width for name, placement in placements.items()})
    groups = sync_group_sizes(graph, placements)
    transfer = {layer.name: 0.0 for layer in graph.layers}
    for producer, consumer in edges(graph):
        transfer[consumer] += move(
            producer, placement_of(producer), placements[consumer], graph.layer(consumer)
        )
    for producer in output_layers(graph):
        transfer[producer] += move(producer, placements[producer], full, None)
    for layer in graph.layers:
        transfer[layer.name] += halo_time(profile.comm, layer, placements[layer.name], global_batch_size)
    allreduce = {name: profile.comm.allreduce_time(groups[name], synced[name]) for name in placements}
    layers = {
        layer.name: LayerCost(
            compute_time(
                profile,
                layer,
                placements[layer.name],
                global_batch_size,
                halo=halo_share(graph, layer),
            ),
            allreduce[layer.name]
            + to_rank_zero_time(profile.comm, placements[layer.name], synced[layer.name]),
            transfer[layer.name],
        )
        for layer in graph.layers
    }
    buckets = sync_buckets(graph, placements, layers, synced, profile.comm)
    contention = profile.comm.contention
    hidden, slowed = hidden_sync(graph, layers, buckets, contention) if profile.comm.overlap else (0.0, 0.0)
    step = StepCost(layers, hidden, contention_s=slowed)
    if all(placement.first == 0 for placement in placements.values()):
        return step  # every layer shares rank 0: one after the other
    scheduled = scheduled_step(
        graph,
        placements,
        layers,
        buckets,
        allreduce,
        world_size=world_size,
        overlap=profile.comm.overlap,
        contention=contention,
    )
    return StepCost(layers, hidden, max(0.0, step.total_s - scheduled), slowed)


def sync_buckets(
    graph: LayerGraph,
    placements: Mapping[str, Placement],
    layers: Mapping[str, LayerCost],
    synced: Mapping[str, int],
    comm: CommProfile,
) -> list[list[str]]:
    """The layers whose gradients are all-reduced together, in launch order, as the runtime cuts them:
    per run of one placement in backward order, by `buckets.cut_into_buckets` (layers without a sync
    left out)."""
    buckets: list[list[str]] = []
    for run in reversed(equal_width_runs((layer.name for layer in graph.layers), placements)):
        sized = [(name, synced[name]) for name in reversed(run) if layers[name].sync_s > 0]
        buckets.extend(cut_into_buckets(sized, comm.bucket_bytes, first=not buckets))
    return buckets


def hidden_sync(
    graph: LayerGraph,
    layers: Mapping[str, LayerCost],
    buckets: Sequence[Sequence[str]],
    contention: float = 0.0,
) -> tuple[float, float]:
    """Sync seconds that run while backward still computes (module docstring, overlap), every layer one
    after the other: every sync second but those the last all-reduce runs past backward's end; and
    the seconds the step grows by as those all-reduces slow the compute beside them by `contention`
    (module docstring, contention)."""
    clock = sum((1 - BACKWARD_SHARE) * c.compute_s + c.transfer_s / 2 for c in layers.values())
    done: dict[str, float] = {}
    for layer in reversed(graph.layers):
        cost = layers[layer.name]
        clock += BACKWARD_SHARE * cost.compute_s + cost.transfer_s / 2
        done[layer.name] = clock
    free = 0.0  # when the all-reduce before the next one is done
    beside = 0.0  # all-reduce seconds before backward's end
    for bucket in buckets:
        start = max(free, done[bucket[-1]])
        free = start + sum(layers[name].sync_s for name in bucket)
        beside += max(0.0, min(free, clock) - start)
    total = sum(c.sync_s for c in layers.values())
    past = max(0.0, free - clock)
    # Never below 0 from float error in the clocks.
    return max(0.0, total - past), max(0.0, contention * beside - past)


def scheduled_step(
    graph: LayerGraph,
    placements: Mapping[str, Placement],
    layers: Mapping[str, LayerCost],
    buckets: Sequence[Sequence[str]],
    allreduce: Mapping[str, float],
    *,
    world_size: int,
    overlap: bool,
    contention: float = 0.0,
) -> float:
    """Seconds of one step with layers on disjoint ranks side by side (module docstring, concurrency).

    Forward takes ``1 - BACKWARD_SHARE`` of a layer's compute and half its transfers, backward the
    rest. A bucket's all-reduce (`allreduce` seconds of its layers) runs on its ranks' links once the
    bucket before it on those links is done and, with `overlap`, its last layer's backward (without,
    once its ranks' backward is over); the rest of its layers' sync, the message to rank 0, then
    occupies rank 0's link and the first of the bucket's ranks (without `overlap`, once rank 0's
    backward is over too). A rank's backward ends `contention` seconds later per second of
    communication on its link before that end (module docstring, contention). Where every layer
    starts at rank 0 this is the serial step less `hidden_sync`'s seconds plus its contention (or the
    serial step, without `overlap`).
    """
    busy = np.zeros(world_size)  # when each rank's compute is next free
    done: dict[str, float] = {}
    for layer in graph.layers:
        ranks = _span(placements[layer.name])
        ready = max((done[name] for name in layer.inputs if name in done), default=0.0)
        cost = layers[layer.name]
        done[layer.name] = max(float(busy[ranks].max()), ready) + (1 - BACKWARD_SHARE) * cost.compute_s
        done[layer.name] += cost.transfer_s / 2
        busy[ranks] = done[layer.name]
    consumers: dict[str, list[str]] = {}
    for producer, consumer in edges(graph):
        consumers.setdefault(producer, []).append(consumer)
    for layer in reversed(graph.layers):
        ranks = _span(placements[layer.name])
        ready = max((done[name] for name in consumers.get(layer.name, ())), default=0.0)
        cost = layers[layer.name]
        start = max(float(busy[ranks].max()), ready)
        done[layer.name] = start + BACKWARD_SHARE * cost.compute_s + cost.transfer_s / 2
        busy[ranks] = done[layer.name]
    link = np.zeros(world_size)  # when each rank's link is next free
    beside = np.zeros(world_size)  # seconds of communication on each rank's link before its backward ends
    for bucket in buckets:
        placement = placements[bucket[0]]
        ranks = _span(placement)
        ready = done[bucket[-1]] if overlap else float(busy[ranks].max())
        start = max(float(link[ranks].max()), ready)
        end = start + sum(allreduce[name] for name in bucket)
        link[ranks] = end
        beside[ranks] += np.clip(np.minimum(end, busy[ranks]) - start, 0.0, None)
        rest = sum(layers[name].sync_s - allreduce[name] for name in bucket)
        if rest > 0:
            pair = [0, placement.first]
            # Without overlap rank 0 takes the message once its own backward is over.
            start = max(float(link[pair].max()), end, 0.0 if overlap else float(busy[0]))
            link[pair] = start + rest
            beside[pair] += np.clip(np.minimum(link[pair], busy[pair]) - start, 0.0, None)
    return float(max((busy + contention * beside).max(), link.max()))


def compute_span(
    graph: LayerGraph,
    placements: Mapping[str, Placement],
    layers: Mapping[str, LayerCost],
    *,
    world_size: int,
) -> float:
    """Seconds of one step's compute alone (`scheduled_step` without transfers and syncs): the layers'
    compute one after the other, less what layers on disjoint ranks compute side by side."""
    compute = {name: LayerCost(cost.compute_s, 0.0, 0.0) for name, cost in layers.items()}
    return scheduled_step(graph, placements, compute, [], {}, world_size=world_size, overlap=False)


def _span(placement: Placement) -> slice:
    return slice(placement.first, placement.first + placement.width)


def ddp_widths(graph: LayerGraph, world_size: int) -> dict[str, int]:
    """The data-parallel assignment: every layer on every device."""
    return {layer.name: world_size for layer in graph.layers}


def ddp_baseline(graph: LayerGraph, profile: Profile, *, world_size: int, global_batch_size: int) -> StepCost:
    """Plain data parallelism under the same cost model; with a global batch smaller than the world,
    data parallelism on as many devices as samples."""
    return evaluate(
        graph,
        profile,
        ddp_widths(graph, min(world_size, global_batch_size)),
        world_size=world_size,
        global_batch_size=global_batch_size,
    )
