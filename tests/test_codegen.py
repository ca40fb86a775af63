"""Layers run as generated code: the same values as the interpreter, from the live module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_deeppool.capture import capture_graph
from lightning_deeppool.capture.codegen import CompiledLayer, compilable
from lightning_deeppool.capture.graph import evaluate

pytestmark = pytest.mark.floors


def _captured():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4)
    )
    x = torch.randn(4, 3, 8, 8)
    captured = capture_graph(model, (x,))
    return captured, {name: x for name in captured.batch_inputs}


def _interpreted(captured, inputs) -> dict:
    env = dict(inputs)
    for layer in captured.graph.layers:
        for node in captured.code[layer.name].nodes:
            env[node.name] = evaluate(captured.module, node, env)
    return env


def test_every_layer_runs_as_generated_code_with_the_interpreters_values():
    captured, inputs = _captured()
    compiled = captured.run_all(inputs, 4, {})
    env = _interpreted(captured, inputs)
    for layer in captured.graph.layers:
        assert isinstance(captured._compiled[layer.name], CompiledLayer)
        for name, value in zip(captured.code[layer.name].outputs, compiled[layer.name]):
            assert torch.equal(value, env[name]), (layer.name, name)


def test_generated_code_reads_parameters_replaced_since_it_was_generated():
    captured, inputs = _captured()
    captured.run_all(inputs, 4, {})
    last = captured.graph.layers[-1].name
    weight = next(node.target for node in captured.code[last].nodes if node.op == "get_attr")
    owner, _, leaf = str(weight).rpartition(".")
    module = captured.module.get_submodule(owner)
    setattr(module, leaf, nn.Parameter(torch.zeros_like(getattr(module, leaf))))
    bias = captured.run_all(inputs, 4, {})[last][0]
    assert torch.equal(bias, _interpreted(captured, inputs)[captured.code[last].outputs[0]])


def test_nodes_that_ran_without_gradients_keep_the_interpreter():
    captured, _ = _captured()
    nodes = captured.code[captured.graph.layers[0].name].nodes
    assert compilable(nodes)
    nodes[-1].meta["no_grad"] = True
    assert not compilable(nodes)


def test_consecutive_layers_run_as_one_function_with_the_interpreters_values():
    captured, inputs = _captured()
    layers = [layer.name for layer in captured.graph.layers]
    last = layers[-1]
    outputs = captured.run_layers(layers, [layers[0], last], inputs, 4, {})
    env = _interpreted(captured, inputs)
    assert sorted(outputs) == sorted([layers[0], last])
    for layer in (layers[0], last):
        for name, value in zip(captured.code[layer].outputs, outputs[layer]):
            assert torch.equal(value, env[name]), (layer, name)
    assert isinstance(captured._stages[(tuple(layers), (layers[0], last))], CompiledLayer)
    assert not captured._compiled  # no layer ran on its own


def test_layers_that_cannot_run_as_generated_code_run_one_by_one():
    captured, inputs = _captured()
    layers = [layer.name for layer in captured.graph.layers]
    captured.code[layers[0]].nodes[-1].meta["no_grad"] = True
    outputs = captured.run_layers(layers, [layers[-1]], inputs, 4, {})
    assert torch.equal(outputs[layers[-1]][0], captured.run_all(inputs, 4, {})[layers[-1]][0])
    assert captured._stages[(tuple(layers), (layers[-1],))] is None
