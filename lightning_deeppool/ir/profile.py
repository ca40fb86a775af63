"""Profiles: measured layer times and communication models, as plain JSON-serializable data."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

# A profile file of another version is refused and a cached one is not found (the version is part of
# the key), so the model is profiled again: raise it whenever what a profile holds, or how it is
# measured, changes.
PROFILE_VERSION = 5


@dataclass(frozen=True)
class LayerProfile:
    """Forward+backward seconds (median) of one layer at increasing per-device batch sizes.

    `activation_bytes` is, at each batch size, what the layer's forward leaves alive for its backward
    (its output and the tensors autograd saved, not its inputs or parameters): measured on CUDA,
    computed from the tensors' storages on CPU; None where not recorded. `saved_input_bytes` is, at each
    batch size, the bytes of its inputs autograd saved (a copy of an input the runtime makes, moved from
    another placement or padded with a halo, stays alive that far), computed on every device. `spread`
    is, per batch size, the median absolute deviation of the timed runs from their median; None where
    not recorded.
    """

    name: str
    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    activation_bytes: tuple[int, ...] | None = None
    spread: tuple[float, ...] | None = None
    saved_input_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ValueError(f"layer {self.name!r}: profile has no batch sizes")
        if len(self.seconds) != len(self.batch_sizes):
            raise ValueError(
                f"layer {self.name!r}: {len(self.batch_sizes)} batch sizes but {len(self.seconds)} times"
            )
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(
                f"layer {self.name!r}: batch sizes must be increasing and >= 1: {self.batch_sizes}"
            )
        if any(s < 0 for s in self.seconds):
            raise ValueError(f"layer {self.name!r}: negative time in {self.seconds}")
        for label, values in (
            ("activation_bytes", self.activation_bytes),
            ("saved_input_bytes", self.saved_input_bytes),
        ):
            if values is not None and len(values) != len(self.batch_sizes):
                raise ValueError(f"layer {self.name!r}: {label} does not match batch_sizes")
        if self.spread is not None and (
            len(self.spread) != len(self.batch_sizes) or any(s < 0 for s in self.spread)
        ):
            raise ValueError(f"layer {self.name!r}: spread {self.spread} does not match batch_sizes")

    def time(self, batch_size: int) -> float:
        """Seconds at `batch_size`, linearly interpolated; outside the measured range it raises."""
        return _interpolate(self.name, "time", self.batch_sizes, self.seconds, batch_size)

    def fitted(self) -> LayerProfile:
        """The times fitted to a non-decreasing function of the batch size (least squares, by pooling
        adjacent violators): a noisy measurement cannot make a layer look faster on more samples."""
        return replace(self, seconds=tuple(nondecreasing(self.seconds)))


def _scaled(layer: LayerProfile, factor: float) -> LayerProfile:
    if factor == 1.0:
        return layer
    spread = None if layer.spread is None else tuple(s * factor for s in layer.spread)
    return replace(layer, seconds=tuple(s * factor for s in layer.seconds), spread=spread)


def nondecreasing(values: tuple[float, ...] | list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, count in blocks for _ in range(int(count))]


def _interpolate(
    name: str, what: str, xs: tuple[int, ...], ys: tuple[float, ...] | tuple[int, ...], x: int
) -> float:
    if x < xs[0] or x > xs[-1]:
        raise ValueError(
            f"layer {name!r}: {what} at batch size {x} is outside the profiled range {xs[0]}..{xs[-1]}; "
            "profile again for this global batch size and device count"
        )
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return float(ys[i])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class AlphaBeta:
    """Latency-bandwidth model of one communication pattern: `latency_s + nbytes * seconds_per_byte`."""

    latency_s: float
    seconds_per_byte: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.seconds_per_byte < 0:
            raise ValueError(f"alpha-beta parameters must be >= 0, got {self}")

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte if nbytes > 0 else 0.0


# Documented defaults when no process group is available to measure: a PCIe-4-class link
# (about 20 GB/s, 20 us per message). `deeppool plan --bandwidth/--latency` overrides them.
DEFAULT_LATENCY_S = 20e-6
DEFAULT_BANDWIDTH_BYTES_PER_S = 20e9
# Gradients are all-reduced in buckets of this size (the strategy's `bucket_mb`).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# Gradients whose modelled all-reduce is below this share of a pass cannot explain what the pass's
# all-reduce measured beyond it (the difference of two noisy pass times, and the ranks' lag): their
# all-reduce model stays as measured alone.
MEASURABLE_SHARE = 0.2


@dataclass(frozen=True)
class CommProfile:
    """Communication models.

    `link` models a point-to-point message (moving activations, when `redistribute` was not measured);
    `halo`, when measured, the exchanges of spatially split layers (their own links on CPU), else
    `redistribute`'s;
    `collective`, when given, the per-link figures of collectives (an inter-node network, say), else
    `link`'s. With `overlap`, gradient all-reduces run beside backward as their buckets fill (NCCL on a
    stream of its own); without, after it (on CPU, where the ranks' cores compute and communicate
    alike). `allreduce[k]` models one all-reduce call among k devices as measured (algorithm
    included). Gradients are reduced in buckets of `bucket_bytes`: a layer pays the bandwidth term for
    its bytes and the latency term for its share of a bucket, so latency grows per bucket, not per
    layer. Group sizes without a measurement use the faster (for a full bucket) of a ring, ``2(k-1)``
    latencies and ``2(k-1)/k`` of the bytes per link, and a tree, ``2 log2 k`` latencies and twice
    the bytes, on per-link figures derived from the nearest measured size, else from
    `collective`/`link`. `allreduce_scale` is the all-reduce of a training pass's gradients as measured
    (freshly written, each in its bucket, see `calibrated`) over what this model predicts for it, where
    that all-reduce is a large enough share of a pass for its bytes to explain the difference;
    elsewhere the difference is `sync_wait_s`: the ranks waiting for each other once a step.
    `contention` is the share of its speed compute loses beside an all-reduce (0.25: it runs at 75%),
    as the all-reduce's kernels take multiprocessors and memory bandwidth from it; 0 where not known
    (and on CPU, where all-reduces do not run beside backward).
    """

    link: AlphaBeta = field(
        default_factory=lambda: AlphaBeta(DEFAULT_LATENCY_S, 1.0 / DEFAULT_BANDWIDTH_BYTES_PER_S)
    )
    allreduce: dict[int, AlphaBeta] = field(default_factory=dict)
    redistribute: AlphaBeta | None = None
    measured: bool = False
    collective: AlphaBeta | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    allreduce_scale: float = 1.0
    sync_wait_s: float = 0.0
    halo: AlphaBeta | None = None
    overlap: bool = True
    contention: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.contention < 1:
            raise ValueError(
                f"contention (the share of compute speed lost beside an all-reduce) must be in [0, 1), "
                f"got {self.contention}"
            )

    def allreduce_time(self, group_size: int, nbytes: float) -> float:
        """Seconds `nbytes` of gradients add to the bucketed all-reduces among `group_size` devices
        (0 for one device)."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        call = self.allreduce_call(group_size)
        return (
            call.latency_s * nbytes / self.bucket_bytes + call.seconds_per_byte * nbytes
        ) * self.allreduce_scale

    def calibrated(self, measured_s: float, group_size: int, nbytes: float, pass_s: float) -> CommProfile:
        """This model fitted to `measured_s`, what all-reducing `nbytes` of a training pass's gradients
        among `group_size` devices added to a `pass_s` pass. A message timed alone reuses one warm
        buffer; a step's gradients are written afresh, and the ranks meet after computing, not in
        lockstep. Where the modelled all-reduce is at least `MEASURABLE_SHARE` of the pass, its times
        are scaled; below, the bytes cannot explain a difference, which is the ranks' `sync_wait_s`."""
        predicted = replace(self, allreduce_scale=1.0).allreduce_time(group_size, nbytes)
        if measured_s <= predicted:
            return self
        if predicted >= MEASURABLE_SHARE * pass_s:
            return replace(self, allreduce_scale=measured_s / predicted)
        return replace(self, sync_wait_s=measured_s - predicted)

    def allreduce_call(self, group_size: int) -> AlphaBeta:
        """One all-reduce call among `group_size` devices: its latency and its seconds per byte."""
        return self._algorithms(group_size)[self.algorithm(group_size)]

    def algorithm(self, group_size: int) -> str:
        """``"measured"``, or the ring or tree algorithm the model assumes for `group_size`."""
        options = self._algorithms(group_size)
        return min(options, key=lambda name: options[name].time(self.bucket_bytes))

    def _algorithms(self, group_size: int) -> dict[str, AlphaBeta]:
        if group_size in self.allreduce:
            return {"measured": self.allreduce[group_size]}
        if self.allreduce:
            nearest = min(self.allreduce, key=lambda k: (abs(k - group_size), k))
            per_link = _ring_link(self.allreduce[nearest], nearest)
        else:
            per_link = self.collective or self.link
        rounds = 2 * (group_size - 1)
        depth = 2 * math.ceil(math.log2(group_size))
        return {
            "ring": AlphaBeta(rounds * per_link.latency_s, rounds / group_size * per_link.seconds_per_byte),
            "tree": AlphaBeta(depth * per_link.latency_s, 2 * per_link.seconds_per_byte),
        }

    def redistribute_time(self, busiest_rank_bytes: float) -> float:
        """Seconds to redistribute activations when the busiest rank sends/receives that many bytes."""
        model = self.redistribute or self.link
        return model.time(busiest_rank_bytes)

    def halo_time(self, nbytes: float) -> float:
        """Seconds of one exchange of `nbytes` between the parts of spatially split samples."""
        return (self.halo or self.redistribute or self.link).time(nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "link": asdict(self.link),
            "allreduce": {str(k): asdict(v) for k, v in sorted(self.allreduce.items())},
            "redistribute": asdict(self.redistribute) if self.redistribute else None,
            "measured": self.measured,
            "collective": asdict(self.collective) if self.collective else None,
            "bucket_bytes": self.bucket_bytes,
            "allreduce_scale": self.allreduce_scale,
            "sync_wait_s": self.sync_wait_s,
            "halo": asdict(self.halo) if self.halo else None,
            "overlap": self.overlap,
            "contention": self.contention,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommProfile:
        collective = data.get("collective")
        return cls(
            link=AlphaBeta(**data["link"]),
            allreduce={int(k): AlphaBeta(**v) for k, v in data["allreduce"].items()},
            redistribute=AlphaBeta(**data["redistribute"]) if data["redistribute"] else None,
            measured=data["measured"],
            collective=AlphaBeta(**collective) if collective else None,
            bucket_bytes=int(data.get("bucket_bytes", DEFAULT_BUCKET_BYTES)),
            allreduce_scale=float(data.get("allreduce_scale", 1.0)),
            sync_wait_s=float(data.get("sync_wait_s", 0.0)),
            halo=AlphaBeta(**data["halo"]) if data.get("halo") else None,
            overlap=bool(data.get("overlap", True)),
            contention=float(data.get("contention", 0.0)),
        )


def _ring_link(model: AlphaBeta, group_size: int) -> AlphaBeta:
    """Per-link parameters implied by a measured ring all-reduce among `group_size` devices."""
    steps = 2 * (group_size - 1)
    return AlphaBeta(model.latency_s / steps, model.seconds_per_byte * group_size / steps)


@dataclass(frozen=True)
class Profile:
    """Everything the cost model needs about one model on one kind of device.

    `optimizer_s` is one optimizer update of every parameter on one device: rank 0 owns every layer,
    so every plan (and DDP) pays it once per step. `optimizer_states` is the optimizer's state in bytes
    per parameter byte (1 for SGD with momentum, 2 for Adam), measured on a replica of the optimizers.
    `compute_scale` is a whole forward+backward pass over the sum of its layers' times (see
    `calibrated`); the planner reads layer times scaled by it.
    """

    graph_fingerprint: str
    device: str
    dtype: str
    layers: dict[str, LayerProfile]
    comm: CommProfile = field(default_factory=CommProfile)
    optimizer_s: float = 0.0
    optimizer_states: float = 1.0
    compute_scale: float = 1.0
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.optimizer_states < 0:
            raise ValueError(f"optimizer_states must be >= 0, got {self.optimizer_states}")
        if not self.compute_scale > 0:
            raise ValueError(f"compute_scale must be > 0, got {self.compute_scale}")

    def calibrated(self, whole_s: float, batch_size: int) -> Profile:
        """This profile, its layer times scaled to a measured whole pass: `whole_s` seconds of every
        layer's forward and backward at `batch_size`. Layers timed alone miss what a pass adds (cold
        caches, the autograd graph between layers, other ranks computing at the same time)."""
        fitted = sum(layer.fitted().time(batch_size) for layer in self.layers.values())
        return replace(self, compute_scale=whole_s / fitted) if fitted > 0 and whole_s > 0 else self

    @property
    def per_step_s(self) -> float:
        """What every plan pays once a step besides its layers: the optimizer update and the ranks'
        wait for each other."""
        return self.optimizer_s + self.comm.sync_wait_s

    def layer(self, name: str) -> LayerProfile:
        """A layer's profile as the planner reads it: fitted to be non-decreasing in the batch size and
        scaled by `compute_scale` (`layers` keeps the raw measurements)."""
        try:
            return self._fitted[name]
        except KeyError:
            raise KeyError(f"no profile for layer {name!r}; the profile was made for another graph") from None

    @cached_property
    def _fitted(self) -> dict[str, LayerProfile]:
        return {name: _scaled(layer.fitted(), self.compute_scale) for name, layer in self.layers.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "graph_fingerprint": self.graph_fingerprint,
            "device": self.device,
            "dtype": self.dtype,
            "layers": {
                name: {**asdict(p), "batch_sizes": list(p.batch_sizes), "seconds": list(p.seconds)}
                for name, p in self.layers.items()
            },
            "comm": self.comm.to_dict(),
            "optimizer_s": self.optimizer_s,
            "optimizer_states": self.optimizer_states,
            "compute_scale": self.compute_scale,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')} is not {PROFILE_VERSION}; profile again")
        layers = {
            name: LayerProfile(
                name=p["name"],
                batch_sizes=tuple(p["batch_sizes"]),
                seconds=tuple(p["seconds"]),
                activation_bytes=_optional(p.get("activation_bytes")),
                spread=_optional(p.get("spread")),
                saved_input_bytes=_optional(p.get("saved_input_bytes")),
            )
            for name, p in data["layers"].items()
        }
        return cls(
            graph_fingerprint=data["graph_fingerprint"],
            device=data["device"],
            dtype=data["dtype"],
            layers=layers,
            comm=CommProfile.from_dict(data["comm"]),
            optimizer_s=float(data["optimizer_s"]),
            optimizer_states=float(data.get("optimizer_states", 1.0)),
            compute_scale=float(data.get("compute_scale", 1.0)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _optional(values: list[Any] | None) -> tuple[Any, ...] | None:
    return None if values is None else tuple(values)
