"""Charts of a plan (width and predicted time per layer) and of a projection (throughput against
device count), drawn with matplotlib when it is installed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_deeppool.planner.plan import Plan
from lightning_deeppool.planner.simulate import Projection


class ChartError(Exception):
    """A chart cannot be drawn or written; the message says why."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ChartError("--chart needs matplotlib: pip install matplotlib (or the [plot] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plan_chart(plan: Plan, path: str) -> None:
    """Two panels per layer: its ranks, a bar from its first rank as tall as its width (hatched and
    labelled ``s2`` where split by height), and its compute/sync/transfer milliseconds stacked."""
    plt = _pyplot()
    names = [layer.name for layer in plan.layers]
    positions = range(len(names))
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(max(6.0, 0.45 * len(names) + 2), 5.5), height_ratios=(1, 1.4)
    )
    bars = top.bar(
        positions,
        [layer.width for layer in plan.layers],
        bottom=[layer.first for layer in plan.layers],
        color="tab:blue",
    )
    for bar, layer in zip(bars, plan.layers, strict=True):
        if layer.spatial > 1:  # split by height: hatched, with the parts per sample on top
            bar.set_hatch("//")
            top.annotate(
                f"s{layer.spatial}",
                (bar.get_x() + bar.get_width() / 2, layer.first + layer.width),
                ha="center",
            )
    top.set_ylabel("ranks" if any(layer.first for layer in plan.layers) else "width (devices)")
    top.set_ylim(0, plan.world_size + (0.9 if any(layer.spatial > 1 for layer in plan.layers) else 0.5))
    top.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
    top.set_title(
        f"{plan.world_size} devices, global batch {plan.global_batch_size}: "
        f"{plan.predicted_step_time_s * 1e3:.1f} ms/step predicted, "
        f"DDP {plan.predicted_ddp_step_time_s * 1e3:.1f} ms ({plan.speedup:.2f}x)",
        fontsize=10,
    )
    bottom_of = [0.0] * len(names)
    for label, field, color in (
        ("compute", "compute_s", "tab:green"),
        ("gradient sync", "sync_s", "tab:red"),
        ("transfer", "transfer_s", "tab:orange"),
    ):
        values = [getattr(layer, field) * 1e3 for layer in plan.layers]
        bottom.bar(positions, values, bottom=bottom_of, label=label, color=color)
        bottom_of = [b + v for b, v in zip(bottom_of, values, strict=True)]
    bottom.set_ylabel("predicted ms per step")
    bottom.legend(fontsize=8)
    bottom.set_xticks(list(positions), names, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def simulation_chart(projections: Sequence[Projection], path: str) -> None:
    """Throughput (samples/s) against device count for DDP, burst and burst + background fill."""
    plt = _pyplot()
    devices = [p.devices for p in projections]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, values in (
        ("data parallel", [p.ddp_samples_per_s for p in projections]),
        ("burst plan", [p.burst_samples_per_s for p in projections]),
        ("burst + background fill", [p.total_samples_per_s for p in projections]),
    ):
        ax.plot(devices, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices, [str(n) for n in devices])
    ax.set_xlabel("devices")
    ax.set_ylabel("samples/s (foreground-equivalent)")
    ax.set_title(f"Projected throughput at global batch {projections[0].global_batch_size}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def _save_figure(fig: Any, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as err:
        raise ChartError(f"cannot write chart {path!r}: {err}") from None
