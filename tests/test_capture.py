"""Capture (one process): export where it works, recording where it does not, layers by submodule
call, values split by sample, and a clear refusal for whatever cannot be split by sample."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from lightning_deeppool.capture import Break, CaptureError, GuardError, capture_graph, widest

from models import ConvNet, images
from zoo import (
    GPT2,
    SEQ,
    VOCAB,
    CausalEncoder,
    DemoTransformer,
    ReentrantCheckpoint,
    ReservedNames,
    ReturnsDataclass,
    ReturnsModelOutput,
    tokens,
)

pytestmark = pytest.mark.floors


def _replayed(captured, *args, **kwargs):
    """The forward's outputs, evaluated layer by layer from the capture (no grad)."""
    inputs = captured.bind(args, kwargs)
    batch = {name: inputs[name] for name in captured.batch_inputs}
    count = next(iter(batch.values())).shape[0]
    with torch.no_grad():
        values = captured.run_all(batch, count, {})
        return captured.forward_outputs(values, count, {})


def _close(a, b) -> bool:
    return all(torch.allclose(x, y, atol=1e-6) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def test_hugging_face_gpt2_is_exported_with_a_symbolic_batch_size():
    torch.manual_seed(0)
    model = GPT2()
    ids = tokens(6).tensors[0]
    captured = capture_graph(model, (ids[:4], ids[:4]))
    assert captured.tracer == "export"
    with torch.no_grad():
        assert _close(model(ids[:3], ids[:3]), _replayed(captured, ids[:3], ids[:3]))


def test_hugging_face_gpt2s_tied_embedding_is_listed_with_the_layers_that_share_it():
    ids = tokens(4).tensors[0]
    graph = capture_graph(GPT2(), (ids, ids)).graph
    wte = graph.layer("model_transformer_wte")
    assert [(t.param, t.param_bytes, t.users) for t in graph.tied] == [
        ("model.lm_head.weight", VOCAB * 32 * 4, ("model_transformer_wte", "model_lm_head"))
    ]
    # Counted once, at its first user (which also holds the position embedding); export names it by
    # the head.
    assert wte.param_bytes == (VOCAB + SEQ) * 32 * 4


@pytest.mark.parametrize("leaf_modules", [(), ("meta",)], ids=["export", "record"])
def test_submodules_named_like_graph_module_attributes_capture_and_replay(leaf_modules):
    torch.manual_seed(0)
    model = ReservedNames()
    x = images(5).tensors[0]
    captured = capture_graph(model, (x[:4],), leaf_modules=leaf_modules)
    assert [layer.name for layer in captured.graph.layers] == ["graph", "meta", "code"]
    with torch.no_grad():
        assert _close(model(x[:3]), _replayed(captured, x[:3]))


class Outputs(OrderedDict):
    """A mapping type torch's pytree does not know."""


class ReturnsMapping(ConvNet):
    def forward(self, x: torch.Tensor) -> Outputs:  # type: ignore[override]
        features = self.features(x)
        return Outputs(logits=self.head(features.flatten(1)), features=features)


@pytest.mark.parametrize("leaf_modules", [(), ("head",)], ids=["export", "record"])
@pytest.mark.parametrize(
    "model",
    [ReturnsDataclass, ReturnsModelOutput, ReturnsMapping],
    ids=["dataclass", "model-output", "mapping"],
)
def test_a_dataclass_or_model_output_return_is_split_like_a_dict(model, leaf_modules):
    torch.manual_seed(0)
    module = model()
    x = images(5).tensors[0]
    captured = capture_graph(module, (x[:4],), leaf_modules=leaf_modules)
    with torch.no_grad():
        expected, replayed = module(x[:3]), _replayed(captured, x[:3])
    assert type(replayed) is type(expected)
    tensors = [
        [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)] for out in (expected, replayed)
    ]
    assert _close(*tensors)
    assert [t.shape[0] for t in tensors[1]] == [3] * len(tensors[1])


class CheckpointsTheInput(ConvNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.features, x, use_reentrant=True).flatten(1))


@pytest.mark.parametrize("model", [ReentrantCheckpoint, CheckpointsTheInput], ids=["hidden", "input"])
def test_layers_under_a_reentrant_checkpoint_get_one_devices_gradients(model):
    """A checkpoint of a hidden value trains its layers; one of the input, which does not require
    grad, leaves them without gradients, on one device as in the capture."""
    torch.manual_seed(0)
    module = model()
    x = images(6).tensors[0]
    captured = capture_graph(module, (x[:4],))
    module(x).square().sum().backward()
    expected = {name: p.grad for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    values = captured.run_all({"x": x}, 6, {})
    captured.forward_outputs(values, 6, {}).square().sum().backward()
    for name, p in module.named_parameters():
        assert (p.grad is None) == (expected[name] is None), name
        assert p.grad is None or torch.allclose(p.grad, expected[name], atol=1e-6), name
    assert (expected["features.2.weight"] is None) == (model is CheckpointsTheInput)


def test_a_loss_computed_inside_forward_is_a_per_rank_layer():
    torch.manual_seed(0)
    ids = tokens(4).tensors[0]
    graph = capture_graph(GPT2(), (ids, ids)).graph
    assert [layer.name for layer in graph.layers if layer.per_rank] == [graph.layers[-1].name]
    assert not any(layer.per_rank for layer in graph.layers[:-1])


def test_graph_inputs_say_whether_the_example_batch_requires_grad():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    data = capture_graph(model, (torch.randn(3, 4),)).graph.inputs
    graded = capture_graph(model, (torch.randn(3, 4, requires_grad=True),)).graph.inputs
    assert [i.requires_grad for i in data] == [False]
    assert [i.requires_grad for i in graded] == [True]


def test_an_argument_passed_twice_is_captured_as_two_inputs():
    torch.manual_seed(0)
    model = GPT2()
    ids = tokens(4).tensors[0]
    captured = capture_graph(model, (ids, ids))  # labels=ids: the same tensor twice
    labels = ids.clone()
    labels[:, :3] = -100
    with torch.no_grad():
        assert _close(model(ids, labels), _replayed(captured, ids, labels))


def test_the_lightning_demo_transformer_is_recorded_when_export_fails():
    torch.manual_seed(0)
    model = DemoTransformer()
    ids, targets = tokens(6).tensors
    captured = capture_graph(model, (ids[:4], targets[:4]))
    assert captured.tracer == "record"
    assert captured.guards  # the causal-mask check on its constant mask
    with torch.no_grad():
        assert _close(model(ids[:5], targets[:5]), _replayed(captured, ids[:5], targets[:5]))


def test_flattened_outputs_split_by_their_rows_per_sample():
    torch.manual_seed(0)
    ids, targets = tokens(4).tensors
    captured = capture_graph(DemoTransformer(), (ids, targets))
    last = captured.meta[captured.graph.outputs[-1]]
    assert [(leaf.rows, leaf.shape) for leaf in last.leaves] == [(SEQ, (SEQ, VOCAB))]


def test_layers_are_submodule_calls_in_execution_order():
    torch.manual_seed(0)
    graph = capture_graph(CausalEncoder(), (tokens(4).tensors[0],)).graph
    names = [layer.name for layer in graph.layers]
    assert names[0] == "embed" and names[-1] == "head"
    assert names.index("encoder_layers_0_self_attn") < names.index("encoder_layers_1_self_attn")
    assert {layer.module for layer in graph.layers} >= {"embed", "encoder.layers.0.linear1", "head"}


def test_a_changed_captured_branch_is_detected_by_its_guard():
    torch.manual_seed(0)
    model = CausalEncoder()
    captured = capture_graph(model, (tokens(4).tensors[0],))
    assert captured.tracer == "record"
    captured.run_guards({})
    with torch.no_grad():
        model.mask.zero_()  # no longer causal: nn.TransformerEncoder would take the other branch
    with pytest.raises(GuardError, match="branched on"):
        captured.run_guards({})


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x - x.mean(0, keepdim=True))


class _SequenceFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).transpose(0, 1)


class _PerSampleLoop(nn.Module):
    """Python that depends on each sample's values: only capturable as a leaf module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([row * 2 if row.sum() > 0 else -row for row in x])


class _WithLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loop = _PerSampleLoop()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.loop(x))


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.linear(x)


def test_an_operation_that_mixes_samples_is_refused():
    with pytest.raises(CaptureError, match="mixes samples"):
        capture_graph(_Mixer(), (torch.randn(4, 4),))


def test_an_output_whose_batch_dimension_is_not_first_is_refused():
    with pytest.raises(CaptureError, match="whose batch dimension is not dimension 0"):
        capture_graph(_SequenceFirst(), (torch.randn(4, 3, 4),))


class _LoopInForward(nn.Module):
    """The per-sample loop in the planned module's own forward, after a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PerSampleLoop()(self.linear(x))


def test_data_dependent_code_in_a_submodule_breaks_the_graph_there_and_replays_as_forward():
    model = _WithLoop()
    x = torch.randn(5, 4)
    captured = capture_graph(model, (x[:4],))
    [found] = captured.breaks
    assert (found.path, found.kind) == ("loop", "_PerSampleLoop")
    assert "row.sum() > 0" in found.reason  # the user's line
    assert [layer.own_samples for layer in captured.graph.layers] == [True, False]
    with torch.no_grad():
        assert _close(model(x), _replayed(captured, x))


def test_data_dependent_code_in_the_planned_forward_makes_the_whole_forward_one_break():
    model = _LoopInForward()
    x = torch.randn(5, 4)
    captured = capture_graph(model, (x[:4],))
    assert [(b.path, b.kind) for b in captured.breaks] == [("", "_LoopInForward")]
    assert "trains data-parallel" in captured.breaks[0].describe()
    assert [layer.own_samples for layer in captured.graph.layers] == [True]
    with torch.no_grad():
        assert _close(model(x), _replayed(captured, x))


def test_a_leaf_module_runs_its_own_python_on_every_shard():
    model = _WithLoop()
    x = torch.randn(5, 4)
    captured = capture_graph(model, (x[:4],), leaf_modules=["loop"])
    with torch.no_grad():
        assert _close(model(x), _replayed(captured, x))


def test_breaks_several_ranks_found_become_one_set_without_those_inside_another():
    inner, outer, other = Break("enc.cut", "Cut", "a"), Break("enc", "Enc", "b"), Break("moe", "MoE", "c")
    assert widest([inner, other, outer, inner]) == (outer, other)


def test_a_capture_starting_from_a_wider_break_keeps_it():
    model = _WithLoop()
    x = torch.randn(5, 4)
    captured = capture_graph(model, (x[:4],), breaks=[Break("", "_WithLoop", "another rank's")])
    assert [b.path for b in captured.breaks] == [""]
    with torch.no_grad():
        assert _close(model(x), _replayed(captured, x))


def test_a_buffer_reassigned_in_forward_is_refused():
    with pytest.raises(CaptureError, match="does not update buffer 'calls'"):
        capture_graph(_Counter(), (torch.randn(4, 4),))


def test_a_hugging_face_cache_output_asks_to_turn_the_cache_off():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(CaptureError, match=r"returns a DynamicCache.*use_cache = False"):
        capture_graph(model, (tokens(4).tensors[0],))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x) * scale


def test_a_changed_non_tensor_argument_is_refused_at_bind():
    captured = capture_graph(_Scaled(), (torch.randn(4, 4),))
    captured.bind((torch.randn(2, 4),), {"scale": 1.0})
    with pytest.raises(ValueError, match=r"captured with the argument value 1.0 and is now called with 2.0"):
        captured.bind((torch.randn(4, 4),), {"scale": 2.0})
