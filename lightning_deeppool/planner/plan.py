"""Plans: the placement (width, and spatial split) of every layer plus the predicted costs, as versioned
JSON the runtime reads.

JSON encodes an infinite ``amplification_limit`` (no limit) as the string ``"inf"``. A layer without
``"spatial"`` loads with spatial 1 (not split), one without ``"first"`` starts at rank 0 (the key is
written only where a layer starts elsewhere, as are the plan's ``concurrent_s`` and ``compute_span_s``,
so plans that place every layer from rank 0 read as before). A plan without ``"memory_bytes"`` (written
before plans carried the estimate) loads with none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.ir.profile import Profile
from lightning_deeppool.planner import checks, cost, memory
from lightning_deeppool.planner.margin import Alternative
from lightning_deeppool.planner.tables import aligned

PLAN_VERSION = 1


@dataclass(frozen=True)
class LayerPlan:
    """One layer's placement and its predicted costs (seconds): it runs on ranks first..first+width-1,
    as ``width // spatial`` sample groups, each sample split by height in `spatial` parts (1: not split).
    A layer's halo exchange is part of its `transfer_s`; where rank 0 does not run it, the message of its
    gradients to rank 0 is part of its `sync_s`."""

    name: str
    module: str | None
    width: int
    compute_s: float
    sync_s: float
    transfer_s: float
    params: int
    spatial: int = 1
    first: int = 0

    @property
    def placement(self) -> Placement:
        return Placement(self.width, self.spatial, self.first)

    @property
    def ranks(self) -> str:
        """Its ranks as text: ``"0-3"``, or ``"2"`` for one."""
        last = self.first + self.width - 1
        return str(self.first) if last == self.first else f"{self.first}-{last}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.first:
            del data["first"]
        return data


@dataclass(frozen=True)
class Plan:
    """Placements of every layer (execution order) for one graph, world size and global batch size.

    The predicted step times are the sum of the layers' costs less `hidden_sync_s`, the all-reduce
    seconds that run beside backward (`cost.hidden_sync`), less `concurrent_s`, the seconds saved by
    layers on disjoint ranks running side by side (`cost.scheduled_step`), plus `optimizer_s`, the
    update of every parameter that rank 0 (which holds every parameter) does each step, and
    `sync_wait_s`, the ranks' wait for each other (see `CommProfile`). `compute_span_s` is the compute
    of one step with such layers side by side (None: the layers' compute one after the other).
    `alternative` is the best plan of another shape the search weighed it against (None for a plan
    it did not search: given, or costed from widths). `memory_bytes` is the estimated peak bytes per
    rank (`memory.memory_per_rank`, estimated; empty in plans written before it).
    """

    world_size: int
    global_batch_size: int
    amplification_limit: float
    predicted_step_time_s: float
    predicted_ddp_step_time_s: float
    graph_fingerprint: str
    layers: tuple[LayerPlan, ...]
    optimizer_s: float = 0.0
    sync_wait_s: float = 0.0
    limited: tuple[str, ...] = ()  # layers the amplification limit kept from some placements
    hidden_sync_s: float = 0.0
    concurrent_s: float = 0.0
    compute_span_s: float | None = None
    alternative: Alternative | None = None
    memory_bytes: tuple[int, ...] = ()
    version: int = PLAN_VERSION

    def width(self, name: str) -> int:
        """Width of layer ``name``; KeyError naming the known layers otherwise."""
        for layer in self.layers:
            if layer.name == name:
                return layer.width
        known = ", ".join(layer.name for layer in self.layers[:10])
        raise KeyError(
            f"layer {name!r} is not in the plan (layers: {known}{', ...' if len(self.layers) > 10 else ''})"
        )

    def widths(self) -> dict[str, int]:
        return {layer.name: layer.width for layer in self.layers}

    def placements(self) -> dict[str, Placement]:
        """Every layer's width, spatial split and first rank."""
        return {layer.name: layer.placement for layer in self.layers}

    @property
    def speedup(self) -> float:
        """Predicted DDP step time over predicted plan step time."""
        return (
            self.predicted_ddp_step_time_s / self.predicted_step_time_s if self.predicted_step_time_s else 1.0
        )

    def idle_fractions(self) -> list[float]:
        """Per rank, the fraction of the plan's predicted compute time (`compute_span_s`) during which
        it runs no layer (a layer runs on the ranks of its placement)."""
        total = sum(layer.compute_s for layer in self.layers)
        span = total if self.compute_span_s is None else self.compute_span_s
        if span <= 0:
            return [0.0] * self.world_size
        return [
            max(0.0, span - sum(layer.compute_s for layer in self.layers if rank in layer.placement.ranks))
            / span
            for rank in range(self.world_size)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "amplification_limit": "inf"
            if math.isinf(self.amplification_limit)
            else self.amplification_limit,
            "predicted_step_time_s": self.predicted_step_time_s,
            "predicted_ddp_step_time_s": self.predicted_ddp_step_time_s,
            "graph_fingerprint": self.graph_fingerprint,
            "optimizer_s": self.optimizer_s,
            "sync_wait_s": self.sync_wait_s,
            "limited": list(self.limited),
            "hidden_sync_s": self.hidden_sync_s,
            **({"concurrent_s": self.concurrent_s} if self.concurrent_s else {}),
            **({"compute_span_s": self.compute_span_s} if self.compute_span_s is not None else {}),
            **({"alternative": asdict(self.alternative)} if self.alternative is not None else {}),
            **({"memory_bytes": list(self.memory_bytes)} if self.memory_bytes else {}),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if data.get("version") != PLAN_VERSION:
            raise ValueError(
                f"plan version {data.get('version')!r} is not supported (expected {PLAN_VERSION}); "
                "plan again with this version of lightning_deeppool"
            )
        limit = data["amplification_limit"]
        return cls(
            world_size=int(data["world_size"]),
            global_batch_size=int(data["global_batch_size"]),
            amplification_limit=math.inf if limit == "inf" else float(limit),
            predicted_step_time_s=float(data["predicted_step_time_s"]),
            predicted_ddp_step_time_s=float(data["predicted_ddp_step_time_s"]),
            graph_fingerprint=str(data["graph_fingerprint"]),
            layers=tuple(LayerPlan(**layer) for layer in data["layers"]),
            optimizer_s=float(data.get("optimizer_s", 0.0)),
            sync_wait_s=float(data.get("sync_wait_s", 0.0)),
            limited=tuple(data.get("limited", ())),
            hidden_sync_s=float(data.get("hidden_sync_s", 0.0)),
            concurrent_s=float(data.get("concurrent_s", 0.0)),
            compute_span_s=None if data.get("compute_span_s") is None else float(data["compute_span_s"]),
            alternative=Alternative(**data["alternative"]) if data.get("alternative") else None,
            memory_bytes=tuple(int(value) for value in data.get("memory_bytes", ())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())

    def table(self, current_weights_bytes: int | None = None) -> str:
        """Aligned text table of the layers, with predicted step time, speedup and idle fraction per rank;
        a ``spatial`` column (parts per sample) when some layer is split by height, a ``ranks`` column
        (``0-3``, ``2-3``) when some layer does not start at rank 0; with `current_weights_bytes`, what
        the strategy's ``current_weights`` sends after each optimizer step."""
        split = any(layer.spatial > 1 for layer in self.layers)
        placed = any(layer.first for layer in self.layers)
        header = (
            "layer",
            "module",
            "width",
            *(("ranks",) if placed else ()),
            *(("spatial",) if split else ()),
            "compute ms",
            "sync ms",
            "transfer ms",
            "params",
        )
        rows = [
            (
                layer.name,
                layer.module or "-",
                str(layer.width),
                *((layer.ranks,) if placed else ()),
                *((str(layer.spatial),) if split else ()),
                f"{layer.compute_s * 1e3:.3f}",
                f"{layer.sync_s * 1e3:.3f}",
                f"{layer.transfer_s * 1e3:.3f}",
                f"{layer.params:,}",
            )
            for layer in self.layers
        ]
        per_step = [
            f"{what}, {seconds * 1e3:.3f} ms"
            for what, seconds in (
                ("the optimizer update", self.optimizer_s),
                ("the ranks' wait for each other", self.sync_wait_s),
            )
            if seconds
        ]
        optimizer = f"; both include {' and '.join(per_step)}" if per_step else ""
        hidden = (
            f"; {self.hidden_sync_s * 1e3:.3f} ms of the sync column runs beside backward"
            if self.hidden_sync_s
            else ""
        )
        concurrent = (
            f"; layers on disjoint ranks side by side save {self.concurrent_s * 1e3:.3f} ms"
            if self.concurrent_s
            else ""
        )
        footer = [
            f"predicted step time {self.predicted_step_time_s * 1e3:.3f} ms vs DDP "
            f"{self.predicted_ddp_step_time_s * 1e3:.3f} ms: speedup {self.speedup:.2f}x "
            f"({self.world_size} devices, global batch {self.global_batch_size}{optimizer}){hidden}"
            f"{concurrent}",
            "idle fraction per rank: " + memory.by_rank([f"{f:.0%}" for f in self.idle_fractions()]),
        ]
        if self.memory_bytes:
            footer.append(
                "memory per rank (params+grads+optimizer+activations, estimated): "
                + memory.summary(self.memory_bytes)
            )
        if self.alternative is not None:
            footer.append(self._margin())
        if self.limited:
            shown = ", ".join(self.limited[:6]) + (
                f" and {len(self.limited) - 6} more" if len(self.limited) > 6 else ""
            )
            footer.append(
                f"amplification limit {self.amplification_limit:g} kept {len(self.limited)} layers from some "
                f"widths: {shown}"
            )
        if current_weights_bytes is not None:
            footer.append(
                f"current_weights: rank 0 sends {current_weights_bytes:,} bytes "
                f"({current_weights_bytes / 2**20:.1f} MiB) after each optimizer step, the weights of "
                "layers some ranks do not run (not in the predicted step time)"
            )
        return "\n".join([*aligned([header, *rows], left=2), *footer])

    def _margin(self) -> str:
        """The footer's line on the best plan of another shape: by how much this one is predicted
        faster, and how that compares with the layer profiles' spread over what the two differ in."""
        other = self.alternative
        assert other is not None
        margin = other.step_time_s - self.predicted_step_time_s
        line = (
            f"margin {margin * 1e3:+.3f} ms ({other.step_time_s / self.predicted_step_time_s:.2f}x) over the "
            f"best plan of another shape ({other.shape}: {other.step_time_s * 1e3:.3f} ms)"
        )
        if other.spread_s is None:
            return f"{line}; the profile records no spread to judge it by"
        spread_ms = other.spread_s * 1e3
        spread = f"the layer profiles' spread over the layers they place differently ({spread_ms:.3f} ms)"
        if margin <= 0:
            why = f"within {spread}" if -margin <= other.spread_s else "below the minimum gain"
            return f"{line}: {why}, so full width was kept"
        if margin <= other.spread_s:
            return f"{line}: within {spread}, a near tie that noise could decide"
        ratio = f"{margin / other.spread_s:.1f}x" if other.spread_s > 0 else "above"
        return f"{line}: {ratio} {spread}"

    def check_matches(self, graph: LayerGraph, world_size: int) -> None:
        """Raise ValueError if the plan was made for another graph or another world size."""
        if self.graph_fingerprint != graph.fingerprint:
            planned = [layer.name for layer in self.layers]
            actual = [layer.name for layer in graph.layers]
            missing = [name for name in actual if name not in set(planned)]
            extra = [name for name in planned if name not in set(actual)]
            detail = (
                f"layers missing from the plan: {missing[:5]}, layers the model lacks: {extra[:5]}"
                if missing or extra
                else "the layer names match but the structure or sizes differ"
            )
            raise ValueError(
                f"the plan was made for a different graph (fingerprint {self.graph_fingerprint}, this "
                f"model's is {graph.fingerprint}; {detail}); plan again for this model"
            )
        if self.world_size != world_size:
            raise ValueError(
                f"the plan was made for world size {self.world_size}, but the world size is {world_size}; "
                "plan again for this number of devices"
            )


def validate_plan(plan: Plan, graph: LayerGraph) -> None:
    """Raise ValueError naming the layer if a graph layer is missing or unknown, or its placement is one
    it cannot run at: width outside 1..N, a spatial split that does not divide the width, is not
    allowed on the layer or exceeds its rows, or more sample groups than the global batch has samples."""
    planned = plan.widths()
    for layer in graph.layers:
        if layer.name not in planned:
            raise ValueError(f"layer {layer.name!r} has no width in the plan; plan again for this model")
    names = {layer.name for layer in graph.layers}
    for layer_plan in plan.layers:
        if layer_plan.name not in names:
            raise ValueError(f"the plan has layer {layer_plan.name!r}, which the model does not have")
        checks.check_placement(
            graph.layer(layer_plan.name),
            layer_plan.placement,
            world_size=plan.world_size,
            global_batch_size=plan.global_batch_size,
        )


def placements_for(plan: Plan, graph: LayerGraph) -> dict[str, Placement]:
    """Each layer of `graph` (the planned forward captured again, for other values it read) at the
    plan's placement, or at full width where the plan has none (a layer the planned capture did not
    run); plan layers `graph` lacks are left out. Raises ValueError naming a layer that cannot run at
    its placement, or a graph break (`Layer.own_samples`) the plan gives less than full width."""
    planned = plan.placements()
    found = {layer.name: planned.get(layer.name, Placement(plan.world_size)) for layer in graph.layers}
    for layer in graph.layers:
        if layer.own_samples and found[layer.name] != Placement(plan.world_size):
            raise ValueError(
                f"layer {layer.name!r} breaks the graph here (code the capture could not follow) but runs at "
                f"{found[layer.name]} in the plan, and a graph break runs at full width; pin "
                f"{layer.module!r} to full width ({plan.world_size})"
            )
        checks.check_placement(
            layer, found[layer.name], world_size=plan.world_size, global_batch_size=plan.global_batch_size
        )
    return found


def plan_with_widths(
    graph: LayerGraph,
    profile: Profile,
    widths: Mapping[str, int | Placement | Mapping[str, object]],
    *,
    world_size: int,
    global_batch_size: int,
    amplification_limit: float,
    limited: tuple[str, ...] = (),
) -> Plan:
    """Cost a given assignment into a Plan: per layer (every one) a width in 1..N, a `Placement`, or a
    mapping ``{"width": w, "spatial": s}`` or ``{"ranks": [2, 3]}`` (`checks.as_placement`), checked as
    `validate_plan` checks a plan; `limited` names the layers the amplification limit constrained."""
    checks.check_sizes(world_size, global_batch_size, graph)
    checks.check_profile(graph, profile)
    names = {layer.name for layer in graph.layers}
    unknown = sorted(set(widths) - names)
    if unknown:
        raise ValueError(f"widths given for unknown layers {unknown[:5]}")
    placements: dict[str, Placement] = {}
    for layer in graph.layers:
        if layer.name not in widths:
            raise ValueError(f"layer {layer.name!r} has no width")
        placement = checks.as_placement(widths[layer.name], f"layer {layer.name!r}")
        checks.check_placement(layer, placement, world_size=world_size, global_batch_size=global_batch_size)
        if (layer.per_rank or layer.own_samples) and placement != Placement(world_size):
            what = "reduces over each rank's samples (a loss inside forward)"
            if layer.own_samples:
                what = "runs code the capture could not follow on each rank's own samples (a graph break)"
            raise ValueError(
                f"layer {layer.name!r} {what}: it must run at the full width {world_size}, not {placement}"
            )
        placements[layer.name] = placement
    sizes = {"world_size": world_size, "global_batch_size": global_batch_size}
    step = cost.evaluate(graph, profile, placements, **sizes)
    ddp = cost.ddp_baseline(graph, profile, **sizes)
    return Plan(
        world_size=world_size,
        global_batch_size=global_batch_size,
        amplification_limit=float(amplification_limit),
        predicted_step_time_s=step.total_s + profile.per_step_s,
        predicted_ddp_step_time_s=ddp.total_s + profile.per_step_s,
        optimizer_s=profile.optimizer_s,
        sync_wait_s=profile.comm.sync_wait_s,
        limited=limited,
        hidden_sync_s=step.hidden_s,
        concurrent_s=step.concurrent_s,
        compute_span_s=cost.compute_span(graph, placements, step.layers, world_size=world_size)
        if any(placement.first for placement in placements.values())
        else None,
        graph_fingerprint=graph.fingerprint,
        memory_bytes=memory.memory_per_rank(graph, placements, profile=profile, **sizes),
        layers=tuple(
            LayerPlan(
                name=layer.name,
                module=layer.module,
                width=placements[layer.name].width,
                compute_s=step.layers[layer.name].compute_s,
                sync_s=step.layers[layer.name].sync_s,
                transfer_s=step.layers[layer.name].transfer_s,
                params=layer.params,
                spatial=placements[layer.name].spatial,
                first=placements[layer.name].first,
            )
            for layer in graph.layers
        ),
    )
