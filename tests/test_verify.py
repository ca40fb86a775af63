"""The first-step check names the first layer whose planned value differs from one device's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_deeppool.capture import capture_graph
from lightning_deeppool.ir.placement import Placement
from lightning_deeppool.runtime.verify import first_difference

from models import make_model

pytestmark = pytest.mark.floors


def _planned(captured, x, width: int = 2) -> SimpleNamespace:
    """A step as the runtime leaves it on rank 0: every layer's value at some width."""
    with torch.no_grad():
        values = captured.run_all({captured.batch_inputs[0]: x}, len(x), {})
    return SimpleNamespace(
        values={(name, Placement(width)): value for name, value in values.items() if name in captured.code}
    )


def test_matching_values_pass():
    x = torch.randn(6, 3, 8, 8)
    captured = capture_graph(make_model("convnet"), (x,))
    assert first_difference(captured, _planned(captured, x), captured.bind((x,), {})) is None


def test_the_first_differing_layer_is_named():
    x = torch.randn(6, 3, 8, 8)
    captured = capture_graph(make_model("convnet"), (x,))
    step = _planned(captured, x)
    for name in ("features_2", "head"):
        (value,) = pytree.tree_leaves(step.values[(name, Placement(2))])
        value.add_(1e-3)
    assert "layer 'features_2' differs" in first_difference(captured, step, captured.bind((x,), {}))


def test_the_rows_a_rank_holds_of_a_value_split_by_height_are_not_compared():
    x = torch.randn(6, 3, 8, 8)
    captured = capture_graph(make_model("convnet"), (x,))
    step = _planned(captured, x)
    (value,) = pytree.tree_leaves(step.values[("features_0", Placement(2))])
    step.values[("features_0", Placement(2, spatial=2))] = value[:, :, :4]  # as moved to a split layer
    assert first_difference(captured, step, captured.bind((x,), {})) is None


def test_models_with_dropout_are_not_compared():
    x = torch.randn(6, 4)
    captured = capture_graph(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), (x,))
    step = _planned(captured, x)
    step.values = {key: tuple(v + 1 for v in value) for key, value in step.values.items()}
    assert captured.stochastic
    assert first_difference(captured, step, captured.bind((x,), {})) is None
