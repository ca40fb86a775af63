import pytest
import torch
from torch import nn

from lightning_deeppool.capture import CapturedGraph, capture_graph
from lightning_deeppool.ir.profile import AlphaBeta, CommProfile, LayerProfile, Profile
from lightning_deeppool.profiling import layers as layers_module
from lightning_deeppool.profiling.layers import (
    assign_layers,
    candidate_batch_sizes,
    measure_optimizer_step,
    merge_layer_profiles,
    profile_layers,
    time_whole_model,
)

pytestmark = pytest.mark.floors

SIZES = [1, 3, 6]
# relu joins bn; flatten would stop bn splitting by height and emb does not read it: a layer of its own;
# cat joins emb, dropout joins fc.
LAYERS = ["conv", "bn", "flatten", "emb", "fc"]


class _Net(nn.Module):
    """Conv + BatchNorm branch and an embedding branch (integer input), joined; dropout at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(4 * 6 * 6 + 8, 5)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().flatten(1)
        return self.drop(self.fc(torch.cat([h, self.emb(ids)], 1)))


@pytest.fixture
def net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _capture(module: nn.Module) -> tuple[CapturedGraph, dict]:
    args = (torch.randn(4, 3, 6, 6), torch.randint(0, 10, (4,)))
    captured = capture_graph(module, args)
    return captured, captured.bind(args, {})


def _profile(module: nn.Module, **kwargs) -> dict[str, LayerProfile]:
    captured, env = _capture(module)
    return profile_layers(captured, env, SIZES, warmup=0, repeats=1, **kwargs)


def test_candidate_batch_sizes_are_the_distinct_per_device_batches():
    assert candidate_batch_sizes(32, 4) == [8, 11, 16, 32]


def test_candidate_batch_sizes_stop_at_one_sample_per_device():
    assert candidate_batch_sizes(3, 8) == [1, 2, 3]


def test_candidate_batch_sizes_subset_is_geometric_and_keeps_both_ends():
    assert candidate_batch_sizes(1024, 64, max_sizes=8) == [16, 29, 52, 94, 171, 342, 512, 1024]


def test_candidate_batch_sizes_reject_an_empty_batch():
    with pytest.raises(ValueError, match="global_batch_size >= 1"):
        candidate_batch_sizes(0, 2)


def test_profile_has_every_layer_at_every_batch_size(net):
    profiles = _profile(net)
    assert list(profiles) == LAYERS
    for name, layer in profiles.items():
        assert layer.name == name
        assert layer.batch_sizes == tuple(SIZES)
        assert len(layer.seconds) == len(SIZES) and all(s > 0 for s in layer.seconds)
        assert layer.activation_bytes is not None and len(layer.activation_bytes) == len(SIZES)


def test_profile_time_grows_with_batch_size():
    captured = capture_graph(nn.Linear(512, 512), (torch.randn(2, 512),))
    env = captured.bind((torch.randn(2, 512),), {})
    (layer,) = profile_layers(captured, env, [1, 512], warmup=1, repeats=3).values()
    assert layer.seconds[1] > layer.seconds[0]


def test_a_profile_records_the_timed_runs_median_and_their_spread_about_it(monkeypatch):
    captured = capture_graph(nn.Linear(4, 4), (torch.randn(2, 4),))
    runs = iter([9.0, 1.0, 2.0, 3.0, 10.0, 5.0])  # a warm-up run, then five timed ones
    monkeypatch.setattr(layers_module, "_timed_once", lambda *args: next(runs))
    env = captured.bind((torch.randn(2, 4),), {})
    (layer,) = profile_layers(captured, env, [2], warmup=0, repeats=5).values()
    assert layer.seconds == (3.0,)
    assert layer.spread == (2.0,)  # the median of the deviations 2, 1, 0, 7, 2


def test_profiling_leaves_parameter_grads_none(net):
    _profile(net)
    assert all(p.grad is None for p in net.parameters())


def test_profiling_keeps_batchnorm_running_stats(net):
    before = {name: b.clone() for name, b in net.named_buffers()}
    _profile(net)
    for name, b in net.named_buffers():
        assert torch.equal(b, before[name]), name


def test_profiling_restores_training_flags(net):
    net.train()
    net.bn.eval()
    _profile(net)
    assert net.training and net.conv.training and net.drop.training
    assert not net.bn.training


def test_profiling_keeps_the_rng_state(net):
    captured, env = _capture(net)
    before = torch.get_rng_state()
    profile_layers(captured, env, SIZES, warmup=0, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


def test_profiling_subsets_and_merging_covers_all_layers(net):
    captured, env = _capture(net)
    names = [layer.name for layer in captured.graph.layers]
    parts = [
        profile_layers(captured, env, SIZES, layers=assign_layers(names, 3, rank), warmup=0, repeats=1)
        for rank in range(3)
    ]
    merged = merge_layer_profiles(parts)
    assert sorted(merged) == sorted(LAYERS)
    assert all(layer.batch_sizes == tuple(SIZES) for layer in merged.values())


def test_profiling_an_in_place_layer_works():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    captured = capture_graph(module, (torch.randn(2, 4),))
    profiles = profile_layers(captured, captured.bind((torch.randn(2, 4),), {}), [1, 2], warmup=0, repeats=1)
    assert list(profiles) == ["_0"]  # the ReLU joins the linear layer


def test_a_failing_layer_is_named_with_its_batch_size():
    # A leaf module runs as Python: BatchNorm1d refuses one sample in training.
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    captured = capture_graph(module, (torch.randn(4, 4),), leaf_modules=["1"])
    with pytest.raises(RuntimeError, match="profiling layer '_1' at per-device batch size 1 failed"):
        profile_layers(captured, captured.bind((torch.randn(2, 4),), {}), [1, 2], warmup=0, repeats=1)


def test_progress_is_reported_after_each_layer(net):
    calls = []
    _profile(net, layers=["conv", "fc"], progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 2), (2, 2)]


def test_profiling_an_unknown_layer_names_it(net):
    with pytest.raises(ValueError, match=r"no layers named \['nope'\]"):
        _profile(net, layers=["nope"])


def test_assign_layers_gives_each_layer_to_exactly_one_rank():
    shares = [assign_layers(LAYERS, 3, rank) for rank in range(3)]
    assert shares == [["conv", "emb"], ["bn", "fc"], ["flatten"]]


def test_merge_rejects_a_layer_profiled_twice():
    layer = LayerProfile("fc", (1, 2), (1.0, 2.0))
    with pytest.raises(ValueError, match="layer 'fc' was profiled by more than one rank"):
        merge_layer_profiles([{"fc": layer}, {"fc": layer}])


def test_merge_rejects_different_batch_sizes():
    parts = [{"a": LayerProfile("a", (1, 2), (1.0, 2.0))}, {"b": LayerProfile("b", (1, 4), (1.0, 2.0))}]
    with pytest.raises(ValueError, match=r"ranks disagree"):
        merge_layer_profiles(parts)


def test_optimizer_step_is_timed_on_copies_leaving_parameters_and_state_alone():
    layer = nn.Linear(256, 256)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in layer.parameters()]
    seconds = measure_optimizer_step([optimizer]).seconds
    assert seconds > 0
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in layer.parameters())


def test_optimizer_step_time_scales_to_every_element_when_sampling():
    layers = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(8)))
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1, momentum=0.9)
    full = measure_optimizer_step([optimizer], repeats=5).seconds
    sampled = measure_optimizer_step([optimizer], max_elements=512 * 512, repeats=5).seconds
    assert 0.2 * full < sampled < 5 * full


def test_optimizer_step_time_scales_to_every_element_when_sampling_rows_of_one_large_parameter():
    layer = nn.Linear(2048, 2048, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    full = measure_optimizer_step([optimizer], repeats=5)
    sampled = measure_optimizer_step([optimizer], max_elements=64 * 2048, repeats=5)
    assert 0.2 * full.seconds < sampled.seconds < 5 * full.seconds
    assert sampled.states == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("optimizer", "states"),
    [
        (lambda params: torch.optim.SGD(params, lr=0.1), 0.0),
        (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1.0),
        (lambda params: torch.optim.Adam(params), 2.0),
    ],
)
def test_optimizer_state_is_measured_in_bytes_per_parameter_byte(optimizer, states):
    layer = nn.Linear(256, 256)
    assert measure_optimizer_step([optimizer(layer.parameters())]).states == pytest.approx(states, abs=1e-3)


@pytest.mark.parametrize(("activation", "outputs_kept"), [(nn.Tanh(), 1), (nn.GELU(), 2)])
def test_a_layer_keeps_what_autograd_saves_beyond_its_inputs_and_parameters(activation, outputs_kept):
    # Linear saves its input and weight (not counted); tanh saves its output, GELU its input (the
    # linear's output) as well: one or two 128-float outputs per sample.
    model = nn.Sequential(nn.Linear(64, 128), activation, nn.Linear(128, 8))
    captured = capture_graph(model, (torch.randn(4, 64),))
    env = captured.bind((torch.randn(4, 64),), {})
    first = profile_layers(captured, env, [1, 4], warmup=0, repeats=1)[captured.graph.layers[0].name]
    assert first.activation_bytes == tuple(outputs_kept * 128 * 4 * b for b in (1, 4))


def test_profiling_keeps_no_reference_to_a_layers_weights():
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))
    captured = capture_graph(model, (torch.randn(4, 64),))
    profile_layers(captured, captured.bind((torch.randn(4, 64),), {}), [1, 4], warmup=0, repeats=1)
    weight = model[0].weight
    storage = weight.untyped_storage()._weak_ref()
    weight.data = torch.zeros(0)
    assert torch.UntypedStorage._expired(storage)
    torch.UntypedStorage._free_weak_ref(storage)


def test_a_whole_pass_leaves_grads_and_running_stats_alone(net):
    before = {name: b.clone() for name, b in net.named_buffers()}
    captured, env = _capture(net)
    assert time_whole_model(captured, env, 3, warmup=0, repeats=1) > 0
    assert all(p.grad is None for p in net.parameters())
    for name, b in net.named_buffers():
        assert torch.equal(b, before[name]), name


def test_a_whole_pass_takes_longer_on_more_samples():
    captured = capture_graph(nn.Sequential(nn.Linear(512, 512), nn.ReLU()), (torch.randn(2, 512),))
    env = captured.bind((torch.randn(2, 512),), {})
    assert time_whole_model(captured, env, 512, repeats=3) > time_whole_model(captured, env, 1, repeats=3)


def test_calibration_scales_layer_times_to_the_whole_pass():
    layers = {"a": LayerProfile("a", (1, 4), (1.0, 3.0)), "b": LayerProfile("b", (1, 4), (0.5, 1.0))}
    profile = Profile("f", "cpu", "float32", layers).calibrated(whole_s=6.0, batch_size=4)
    assert profile.compute_scale == pytest.approx(1.5)
    assert profile.layer("a").time(4) == pytest.approx(4.5)
    assert profile.layer("b").time(1) == pytest.approx(0.75)
    assert profile.layers["a"].seconds == (1.0, 3.0)  # the measurements are kept as measured


def test_calibration_survives_json_and_older_profiles_load_unscaled():
    layers = {"a": LayerProfile("a", (1,), (1.0,))}
    profile = Profile("f", "cpu", "float32", layers).calibrated(whole_s=2.0, batch_size=1)
    assert Profile.from_dict(profile.to_dict()) == profile
    older = {key: value for key, value in profile.to_dict().items() if key != "compute_scale"}
    assert Profile.from_dict(older).compute_scale == 1.0


def test_all_reduce_calibration_scales_the_modelled_time_to_the_measured_one():
    comm = CommProfile(allreduce={2: AlphaBeta(1e-3, 1e-9)}, bucket_bytes=10**6)
    assert comm.allreduce_time(2, 2 * 10**6) == pytest.approx(2e-3 + 2e-3)
    calibrated = comm.calibrated(measured_s=1.2e-2, group_size=2, nbytes=2 * 10**6, pass_s=2e-2)
    assert calibrated.allreduce_scale == pytest.approx(3.0)
    assert calibrated.allreduce_time(2, 10**6) == pytest.approx(3 * 2e-3)
    assert calibrated.sync_wait_s == 0.0
    assert CommProfile.from_dict(calibrated.to_dict()) == calibrated


def test_what_a_small_all_reduce_cannot_explain_is_the_ranks_wait_once_a_step():
    comm = CommProfile(allreduce={2: AlphaBeta(1e-3, 1e-9)}, bucket_bytes=10**6)
    # 4 ms modelled, a fifth of a 20 ms pass is the limit: at a 100 ms pass the bytes explain nothing
    calibrated = comm.calibrated(measured_s=1.2e-2, group_size=2, nbytes=2 * 10**6, pass_s=0.1)
    assert calibrated.allreduce_scale == 1.0
    assert calibrated.sync_wait_s == pytest.approx(8e-3)
    assert CommProfile.from_dict(calibrated.to_dict()) == calibrated


def test_an_all_reduce_measured_below_its_model_leaves_the_model_alone():
    comm = CommProfile(allreduce={2: AlphaBeta(1e-3, 1e-9)}, bucket_bytes=10**6)
    assert comm.calibrated(measured_s=1e-3, group_size=2, nbytes=2 * 10**6, pass_s=2e-2) == comm


def test_profiles_without_an_all_reduce_scale_load_unscaled():
    data = CommProfile().to_dict()
    del data["allreduce_scale"], data["sync_wait_s"]
    assert CommProfile.from_dict(data).allreduce_scale == 1.0
    assert CommProfile.from_dict(data).sync_wait_s == 0.0
