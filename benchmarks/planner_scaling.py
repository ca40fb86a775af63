"""Search time over graph size and device count, on ResNet-like and Inception-like (four branches per
block, which the search may run side by side) synthetic graphs and profiles.

Writes ``benchmarks/results/planner_scaling.json``: a list of ``{"graph", "layers", "devices",
"seconds"}`` (best of three runs). Usage: ``python benchmarks/planner_scaling.py``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from lightning_deeppool.ir.graph import GraphInput, Layer, LayerGraph
from lightning_deeppool.ir.profile import LayerProfile, Profile
from lightning_deeppool.planner.search import search

GLOBAL_BATCH_SIZE = 1024
LAYERS = (50, 100, 200, 500)
DEVICES = (8, 64, 256, 1024)
RESULTS = Path(__file__).parent / "results" / "planner_scaling.json"


def resnet_like(n_layers: int, rng: random.Random) -> tuple[LayerGraph, dict[str, tuple[float, float]]]:
    """Stem, residual blocks (conv -> conv -> add with the block input), a linear head.

    Returns the graph and per-layer (fixed seconds, seconds per sample): early convolutions scale well,
    later ones less, the head barely.
    """
    layers: list[Layer] = []
    times: dict[str, tuple[float, float]] = {}

    def add(
        name: str, inputs: list[str], op: str, sample_bytes: int, params: int, per_sample_s: float
    ) -> str:
        layers.append(
            Layer(name, op, name.replace("_", "."), tuple(inputs), sample_bytes, params, 4 * params)
        )
        times[name] = (rng.uniform(20e-6, 80e-6), per_sample_s)
        return name

    current = add("stem", ["x"], "call_module", 802_816, 9_408, 40e-6)
    block = 0
    while len(layers) < n_layers - 1:
        depth = len(layers) / n_layers
        channels = 64 * 2 ** int(4 * depth)
        sample_bytes = 4 * channels * max(7, int(56 / 2 ** int(4 * depth))) ** 2
        params = 9 * channels * channels
        per_sample = rng.uniform(10e-6, 40e-6) * (1 - 0.8 * depth)
        skip = current
        current = add(f"block{block}_conv1", [current], "call_module", sample_bytes, params, per_sample)
        current = add(f"block{block}_conv2", [current], "call_module", sample_bytes, params, per_sample)
        current = add(f"block{block}_add", [current, skip], "call_function", sample_bytes, 0, 1e-7)
        block += 1
    add("fc", [current], "call_module", 4000, 2_049_000, 2e-7)
    graph = LayerGraph((GraphInput("x", 602_112),), tuple(layers), (layers[-1].name,))
    return graph, times


def inception_like(n_layers: int, rng: random.Random) -> tuple[LayerGraph, dict[str, tuple[float, float]]]:
    """Stem, blocks of four branches from the block input to a concatenation (1x1; 1x1 -> 3x3;
    1x1 -> 3x3 -> 3x3; pool -> 1x1), a linear head. Branch layers are small (a large fixed time, little
    per sample), so running branches side by side pays off."""
    layers: list[Layer] = []
    times: dict[str, tuple[float, float]] = {}

    def add(
        name: str, inputs: list[str], op: str, sample_bytes: int, params: int, per_sample_s: float
    ) -> str:
        layers.append(
            Layer(name, op, name.replace("_", "."), tuple(inputs), sample_bytes, params, 4 * params)
        )
        times[name] = (rng.uniform(50e-6, 200e-6), per_sample_s)
        return name

    current = add("stem", ["x"], "call_module", 401_408, 9_408, 40e-6)
    block = 0
    while len(layers) < n_layers - 10:
        fork, ends = current, []
        for b, depth in enumerate((1, 2, 3, 2)):
            current = fork
            for i in range(depth):
                kind = "pool" if b == 3 and i == 0 else "conv"
                params = 0 if kind == "pool" else 64 * 64 * (1 if i == 0 else 9)
                name = f"block{block}_branch{b}_{kind}{i}"
                current = add(name, [current], "call_module", 50_176, params, rng.uniform(1e-6, 5e-6))
            ends.append(current)
        current = add(f"block{block}_cat", ends, "call_function", 200_704, 0, 1e-7)
        block += 1
    add("fc", [current], "call_module", 4000, 2_049_000, 2e-7)
    graph = LayerGraph((GraphInput("x", 602_112),), tuple(layers), (layers[-1].name,))
    return graph, times


GRAPHS: dict[str, Callable[[int, random.Random], tuple[LayerGraph, dict[str, tuple[float, float]]]]] = {
    "resnet": resnet_like,
    "inception": inception_like,
}


def profile_for(graph: LayerGraph, times: dict[str, tuple[float, float]]) -> Profile:
    batches = tuple(2**i for i in range(GLOBAL_BATCH_SIZE.bit_length()))
    return Profile(
        graph.fingerprint,
        "synthetic",
        "float16",
        {
            name: LayerProfile(name, batches, tuple(fixed + per_sample * b for b in batches))
            for name, (fixed, per_sample) in times.items()
        },
    )


def measure(kind: str, n_layers: int, devices: int) -> float:
    graph, times = GRAPHS[kind](n_layers, random.Random(n_layers))
    profile = profile_for(graph, times)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        search(graph, profile, world_size=devices, global_batch_size=GLOBAL_BATCH_SIZE)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    results = []
    for kind in GRAPHS:
        for n_layers in LAYERS:
            for devices in DEVICES:
                seconds = measure(kind, n_layers, devices)
                results.append(
                    {"graph": kind, "layers": n_layers, "devices": devices, "seconds": round(seconds, 4)}
                )
                print(f"{kind:9s} {n_layers:4d} layers {devices:5d} devices: {seconds:.3f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
