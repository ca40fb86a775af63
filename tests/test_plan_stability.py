"""Two profiles of one model, measured on the development machine once quiet and once beside a CPU
burner, give one plan: noise decides neither a layer's width nor a near-tie between plans.

The profiles (`tests/data/profiles/`) were written by `deeppool plan ... --profile-out` for the
benchmark's VGG-like model and the quickstart's digits CNN, on 2 and 4 devices.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lightning_deeppool.ir.graph import LayerGraph
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, LayerProfile, Profile
from lightning_deeppool.planner.search import search

pytestmark = pytest.mark.floors

PROFILES = Path(__file__).parent / "data" / "profiles"
# Roughly this machine's gloo link between two processes: 1.3 GB/s, 100 us per message.
LINK = CommProfile(link=AlphaBeta(100e-6, 1 / 1.3e9), overlap=False)
CASES = {"vgg": (2, 32), "vgg4": (4, 32), "digits": (2, 64), "digits4": (4, 64)}


def _load(name: str) -> tuple[LayerGraph, Profile]:
    data = json.loads((PROFILES / f"{name}.json").read_text())
    graph = LayerGraph.from_dict(data.pop("graph"))
    return graph, dataclasses.replace(Profile.from_dict(data), comm=LINK)


def _widths(name: str, profile: Profile | None = None) -> dict[str, int]:
    world_size, batch = CASES[name.split("_")[0]]
    graph, loaded = _load(name)
    return search(graph, profile or loaded, world_size=world_size, global_batch_size=batch).widths()


@pytest.mark.parametrize("model", list(CASES))
def test_a_quiet_and_a_loaded_profile_give_the_same_plan(model):
    assert _widths(f"{model}_quiet") == _widths(f"{model}_loaded")


@pytest.mark.parametrize("model", list(CASES))
def test_the_plans_run_the_head_narrower_than_the_convolutions(model):
    widths = _widths(f"{model}_quiet")
    assert widths["features_0"] > 1
    assert min(w for name, w in widths.items() if not name.startswith("features")) == 1


def test_a_noisy_inversion_cannot_make_a_layer_look_faster_on_more_samples():
    # The quickstart's failure: half the batch measured slower than all of it put the first
    # convolution on one device (time(B/2) * 2 > 2 * time(B) breaks the amplification limit).
    _, profile = _load("digits_quiet")
    first = profile.layers["features_0"]
    times = list(first.seconds)
    times[-2] = 1.5 * times[-1]
    noisy = dataclasses.replace(
        profile,
        layers={**profile.layers, "features_0": LayerProfile(first.name, first.batch_sizes, tuple(times))},
    )
    assert _widths("digits_quiet", noisy) == _widths("digits_quiet")
