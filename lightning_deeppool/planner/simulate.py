"""Scaling projections: step time and throughput of DDP, the burst plan and burst + background fill.

Pure functions over a layer graph and a profile (no torch). The model, at a fixed global batch B on N
devices:

- **DDP**: every layer at width N, costed by `cost.ddp_baseline` (with B < N, on B devices: the
  most data parallelism can use).
- **Burst**: the plan `search.search` finds, costed by the same model; it may split samples by height
  (`placement.Placement`), which lets layers use more devices than there are samples.
- **Burst + background fill**: device-time the plan leaves idle runs background training. A rank is
  idle during the compute of every layer whose ranks do not include it (`Plan.idle_fractions`, over
  the step's compute with independent branches side by side); time spent in transfers and gradient
  syncs is not counted as idle. Background work is valued in
  *foreground-equivalent* samples: a background job is assumed to train the same model alone on one
  device at batch B, so an idle device-second yields ``efficiency * B / T1`` samples, where T1 is the
  single-device step time at batch B. ``efficiency`` is the share of idle time background work really
  turns into progress. The default, `DEFAULT_BACKGROUND_EFFICIENCY`, is about what
  `benchmarks/background.py` measured on CPU (rank 1 turned 64% of its step, idle, into 0.26 of a
  device); on GPUs it has not been measured: state your own. `assumptions` spells out the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, Profile
from lightning_deeppool.planner import checks, cost, memory
from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.search import search
from lightning_deeppool.planner.tables import aligned

DEFAULT_BACKGROUND_EFFICIENCY = 0.4


@dataclass(frozen=True)
class Projection:
    """Predicted step times (seconds) at one device count, and the throughputs they imply."""

    devices: int
    global_batch_size: int
    ddp_step_s: float
    burst_step_s: float
    single_device_step_s: float
    idle_device_s: float
    background_efficiency: float
    plan: Plan

    @property
    def ddp_samples_per_s(self) -> float:
        return self.global_batch_size / self.ddp_step_s

    @property
    def burst_samples_per_s(self) -> float:
        return self.global_batch_size / self.burst_step_s

    @property
    def idle_fraction(self) -> float:
        """Idle device-time over all device-time of a burst step."""
        return self.idle_device_s / (self.devices * self.burst_step_s)

    @property
    def background_samples_per_s(self) -> float:
        """Foreground-equivalent samples/s that background jobs add in the idle device-time."""
        idle_device_s_per_s = self.idle_device_s / self.burst_step_s
        single_device_rate = self.global_batch_size / self.single_device_step_s
        return self.background_efficiency * idle_device_s_per_s * single_device_rate

    @property
    def total_samples_per_s(self) -> float:
        """Cluster throughput of burst + background fill, in foreground-equivalent samples/s."""
        return self.burst_samples_per_s + self.background_samples_per_s


def idle_device_seconds(plan: Plan) -> float:
    """Device-seconds per step during which ranks run no layer's compute, summed over ranks."""
    compute = sum(layer.compute_s for layer in plan.layers)
    return sum(plan.idle_fractions()) * compute


def project(
    graph: LayerGraph,
    profile: Profile,
    *,
    devices: Sequence[int],
    global_batch_size: int,
    amplification_limit: float = 2.0,
    background_efficiency: float = DEFAULT_BACKGROUND_EFFICIENCY,
) -> list[Projection]:
    """One projection per device count, at a fixed global batch, under `profile`'s cost model.

    The profile must cover per-device batches ``ceil(B / N)`` .. ``B`` for every N (profile with
    ``candidate_batch_sizes(B, max(devices))``); otherwise the profile's out-of-range error is raised.
    A device count above B needs layers that can be split by height (`checks.check_sizes`).
    """
    if not devices:
        raise ValueError("no device counts to project; give at least one, e.g. 8,16,32")
    if not 0 <= background_efficiency <= 1:
        raise ValueError(f"background efficiency must be in 0..1, got {background_efficiency}")
    for n in devices:
        checks.check_sizes(n, global_batch_size, graph)
    single = cost.evaluate(
        graph,
        profile,
        cost.ddp_widths(graph, 1),
        world_size=1,
        global_batch_size=global_batch_size,
    ).total_s
    projections = []
    for n in devices:
        plan = search(
            graph,
            profile,
            world_size=n,
            global_batch_size=global_batch_size,
            amplification_limit=amplification_limit,
        )
        projections.append(
            Projection(
                devices=n,
                global_batch_size=global_batch_size,
                ddp_step_s=plan.predicted_ddp_step_time_s,
                burst_step_s=plan.predicted_step_time_s,
                single_device_step_s=single,
                idle_device_s=idle_device_seconds(plan),
                background_efficiency=background_efficiency,
                plan=plan,
            )
        )
    return projections


def table(projections: Sequence[Projection]) -> str:
    """Aligned text table: step times, throughputs (samples/s) and the gains over DDP; below it, per
    device count, the burst plan's estimated memory per rank (`memory.memory_per_rank`)."""
    header = (
        "devices",
        "DDP ms",
        "DDP samples/s",
        "burst ms",
        "burst samples/s",
        "idle",
        "burst+bg samples/s",
        "burst/DDP",
        "burst+bg/DDP",
    )
    rows = [
        (
            str(p.devices),
            f"{p.ddp_step_s * 1e3:.3f}",
            f"{p.ddp_samples_per_s:,.0f}",
            f"{p.burst_step_s * 1e3:.3f}",
            f"{p.burst_samples_per_s:,.0f}",
            f"{p.idle_fraction:.0%}",
            f"{p.total_samples_per_s:,.0f}",
            f"{p.burst_samples_per_s / p.ddp_samples_per_s:.2f}x",
            f"{p.total_samples_per_s / p.ddp_samples_per_s:.2f}x",
        )
        for p in projections
    ]
    lines = aligned([header, *rows])
    if projections:
        p = projections[0]
        lines.append(
            f"global batch {p.global_batch_size}; background fill at efficiency "
            f"{p.background_efficiency:g}, valued as the same model on one device "
            f"(single-device step {p.single_device_step_s * 1e3:.3f} ms)"
        )
    split = [(p.devices, spatial_summary(p.plan)) for p in projections if spatial_summary(p.plan)]
    if split:
        lines.append("split by height: " + "; ".join(f"{n} devices: {summary}" for n, summary in split))
    placed = [(p.devices, branch_summary(p.plan)) for p in projections if branch_summary(p.plan)]
    if placed:
        lines.append("side by side: " + "; ".join(f"{n} devices: {summary}" for n, summary in placed))
    estimated = [p for p in projections if p.plan.memory_bytes]
    if estimated:
        lines.append(
            "memory per rank (params+grads+optimizer+activations, estimated): "
            + "; ".join(f"{p.devices} devices: {memory.summary(p.plan.memory_bytes)}" for p in estimated)
        )
    return "\n".join(lines)


def branch_summary(plan: Plan) -> str:
    """``3 of 7 layers off rank 0 (ranks 2-3, 4-7)`` for a plan that runs layers side by side on
    disjoint ranks (some layer not starting at rank 0), else ``""``."""
    away = [layer for layer in plan.layers if layer.first]
    if not away:
        return ""
    ranks = ", ".join(dict.fromkeys(layer.ranks for layer in away))
    return f"{len(away)} of {len(plan.layers)} layers off rank 0 (ranks {ranks})"


def spatial_summary(plan: Plan) -> str:
    """``3 of 4 layers, 2 parts per sample`` for a plan that splits samples by height, else ``""``."""
    parts = sorted({layer.spatial for layer in plan.layers if layer.spatial > 1})
    if not parts:
        return ""
    count = sum(layer.spatial > 1 for layer in plan.layers)
    return f"{count} of {len(plan.layers)} layers, {'/'.join(map(str, parts))} parts per sample"


def assumptions(profile: Profile, projections: Sequence[Projection]) -> str:
    """What a projection assumes, one line each: where compute times come from, the communication
    models (per device count: the all-reduce algorithm), and what is left out."""
    comm = profile.comm
    algorithms = ", ".join(
        f"{p.devices} devices: {comm.algorithm(p.devices)}" for p in projections if p.devices > 1
    )
    lines = [
        f"compute: profiled on {profile.device} ({profile.dtype}); times between profiled batch sizes "
        f"interpolated; layer times scaled by {profile.compute_scale:.2f} (a whole pass over the sum of "
        "its layers)",
        f"point-to-point: {_describe(comm.redistribute or comm.link)}"
        + (" (measured)" if comm.redistribute is not None else "")
        + (f"; halo exchanges: {_describe(comm.halo)} (measured)" if comm.halo is not None else ""),
        f"collectives: {_describe(comm.collective or comm.link)} per link, unless measured; gradients in "
        f"buckets of {comm.bucket_bytes / 2**20:g} MB; {algorithms or 'one device: none'}; all-reduce "
        f"times scaled by {comm.allreduce_scale:.2f} (a training pass's gradients over messages timed "
        f"alone); the ranks' wait for each other, {comm.sync_wait_s * 1e3:.3f} ms a step as measured, at "
        "every device count",
        _overlap(comm),
        _optimizer(profile),
        "not modelled: contention between concurrent transfers, or of transfers with compute; topology "
        "(one link model for every pair of devices)",
    ]
    if any(spatial_summary(p.plan) for p in projections):
        lines.append(
            "splits by height: a part's compute is the profiled time at its share of the samples' rows "
            "(interpolated, and below the smallest profiled batch extrapolated from the two smallest); "
            "its halo exchange is point-to-point, forward and backward"
        )
    if projections:
        lines.append(
            f"background fill: efficiency {projections[0].background_efficiency:g} of idle device-time, "
            "valued as the same model on one device"
        )
    return "\n".join(f"assumes {line}" for line in lines)


def _overlap(comm: CommProfile) -> str:
    if not comm.overlap:
        return "gradient all-reduces after backward, not beside it (as on CPU ranks, whose cores do both)"
    slowed = (
        f"; compute beside them at {1 - comm.contention:.0%} of its speed"
        if comm.contention
        else "; compute beside them not slowed"
    )
    return (
        "gradient all-reduces beside backward: a bucket starts once its last layer's backward "
        f"({cost.BACKWARD_SHARE:.0%} of the layer's profiled time) and the bucket before it are done" + slowed
    )


def _optimizer(profile: Profile) -> str:
    if not profile.optimizer_s:
        return "no optimizer update (the profile has none)"
    update_ms = profile.optimizer_s * 1e3
    return f"the optimizer update: {update_ms:.3f} ms a step (the profile's), alike for every plan"


def _describe(link: AlphaBeta) -> str:
    bandwidth = 1 / link.seconds_per_byte / 1e9 if link.seconds_per_byte else float("inf")
    return f"{bandwidth:g} GB/s, {link.latency_s * 1e6:g} us per message"


def parse_devices(text: str) -> list[int]:
    """``"8,16,32"`` -> ``[8, 16, 32]``; raises ValueError on anything but positive integers."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"device counts must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"device counts must be positive integers, got {text!r}")
    return sorted(set(values))
