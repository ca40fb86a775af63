"""Gradient synchronisation: a bucket reduced whole leaves its gradients as views of one flat tensor
(nothing copied back after the sum), gradients not zeroed between steps still add up as on one
device, and a bucket launches inside the backward once its gradients are final. One rank: the
bucket's sum is over itself; the storage and the timing are what is tested."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_deeppool.comm.messages import GroupMessages
from lightning_deeppool.lowering.schedule import Bucket
from lightning_deeppool.runtime.grad_sync import GradSync

pytestmark = pytest.mark.floors


def _layer_and_sync() -> tuple[nn.Linear, GradSync]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    params = dict(layer.named_parameters())
    return layer, GradSync(params, GroupMessages(), 1, [Bucket(0, (0,), tuple(params))])


def _backward(layer: nn.Linear, sync: GradSync, x: torch.Tensor) -> None:
    sync.arm(True)
    with sync.in_stage():
        layer(x).square().sum().backward()
    sync.sync()


def _plain(x: torch.Tensor, times: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    for _ in range(times):
        layer(x).square().sum().backward()
    return {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}


def test_a_whole_buckets_gradients_end_as_views_of_one_flat_storage():
    layer, sync = _layer_and_sync()
    x = torch.randn(5, 4)
    for _ in range(2):  # the second step's gradients are new tensors again (set to None in between)
        _backward(layer, sync, x)
        assert layer.weight.grad is not None and layer.bias.grad is not None
        storage = layer.weight.grad.untyped_storage().data_ptr()
        assert layer.bias.grad.untyped_storage().data_ptr() == storage
        assert torch.equal(layer.weight.grad, _plain(x, 1)["weight"])
        layer.zero_grad(set_to_none=True)


def test_gradients_not_zeroed_between_steps_add_up_as_on_one_device():
    layer, sync = _layer_and_sync()
    x = torch.randn(5, 4)
    for _ in range(3):
        _backward(layer, sync, x)
    plain = _plain(x, 3)
    assert torch.allclose(layer.weight.grad, plain["weight"]) and torch.allclose(
        layer.bias.grad, plain["bias"]
    )


def test_a_bucket_launches_inside_backward_before_the_next_buckets_gradients_arrive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    params = dict(model.named_parameters())
    last, first = Bucket(0, (0,), ("1.weight", "1.bias")), Bucket(1, (0,), ("0.weight", "0.bias"))
    sync = GradSync(params, GroupMessages(), 1, [last, first])
    fresh_at_first_layer: list[set[str]] = []
    # Registered after the sync's own hook, so it sees what that hook left.
    model[0].weight.register_hook(lambda _: fresh_at_first_layer.append(sync.fresh()))
    sync.arm(True)
    with sync.in_stage():
        model(torch.randn(3, 4)).sum().backward()
    assert fresh_at_first_layer[0] & {"1.weight", "1.bias"} == set()  # the last layer's bucket left
    assert "0.weight" in fresh_at_first_layer[0]
    assert sync.fresh() == set()  # the first layer's bucket launched where the backward ended


def test_without_bucket_views_each_gradient_keeps_a_storage_of_its_own():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    params = dict(layer.named_parameters())
    sync = GradSync(params, GroupMessages(), 1, [Bucket(0, (0,), tuple(params))], bucket_view=False)
    x = torch.randn(5, 4)
    _backward(layer, sync, x)
    assert layer.weight.grad is not None and layer.bias.grad is not None
    assert layer.bias.grad.untyped_storage().data_ptr() != layer.weight.grad.untyped_storage().data_ptr()
    assert torch.equal(layer.weight.grad, _plain(x, 1)["weight"])
