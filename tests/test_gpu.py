"""CUDA paths: CUDA-event profiling and peak memory, 16-mixed and bf16-mixed on the runtime, NCCL
burst runtime, the shared batch's summary. Skipped without CUDA (tests/conftest.py); the multi-GPU
ones also need two devices."""

import pytest
import torch
from torch import nn

from lightning_deeppool import DeepPoolStrategy
from lightning_deeppool.capture import capture_graph
from lightning_deeppool.profiling.layers import profile_layers
from lightning_deeppool.runtime.shared_batch import checksum

from distributed import run_distributed
from models import fit_one_device, max_param_diff

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16 * 16 * 16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def test_cuda_profile_has_event_times_and_the_measured_bytes_kept_for_backward():
    net = _Net().cuda()
    x = torch.randn(4, 3, 16, 16, device="cuda")
    captured = capture_graph(net, (x,))
    profiles = profile_layers(captured, captured.bind((x,), {}), [1, 64], device="cuda", repeats=3)
    conv = profiles["conv"]
    assert all(s > 0 for s in conv.seconds)
    assert conv.activation_bytes is not None
    # relu keeps its output (16 x 16 x 16 floats a sample); the convolution keeps only its input
    kept = 64 * 16 * 16 * 16 * 4
    assert kept <= conv.activation_bytes[1] <= 2 * kept
    assert conv.activation_bytes[1] > conv.activation_bytes[0]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_one_gpu_trains_like_lightnings_ddp(precision: str):
    reference, reference_losses = fit_one_device("ddp", accelerator="cuda", precision=precision)
    strategy = DeepPoolStrategy(cache_dir=False, profile_warmup=1, profile_repeats=1)
    planned, losses = fit_one_device(strategy, accelerator="cuda", precision=precision)
    # The same kernels in the same order (cuDNN may pick another algorithm for a captured call);
    # half precision moves the losses by about 1e-3 from float32's, so 1e-4 tells them apart.
    assert max_param_diff(planned, reference) < 1e-4
    assert losses == pytest.approx(reference_losses, abs=1e-4)
    assert all(p.dtype == torch.float32 for p in planned.values())  # master weights stay float32


def _nccl_gradients(rank: int) -> float:
    from lightning_deeppool.comm.groups import PlanGroups
    from lightning_deeppool.comm.messages import GroupMessages
    from lightning_deeppool.lowering.schedule import build_schedule
    from lightning_deeppool.runtime.grad_sync import GradSync
    from lightning_deeppool.runtime.runtime import BurstRuntime

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    net, reference = _Net().cuda(), _Net().cuda()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(8, 3, 16, 16, device="cuda")
    reference(x).square().mean().backward()
    captured = capture_graph(net, (x[:4],))
    widths = {layer.name: (1 if layer.name == "head" else 2) for layer in captured.graph.layers}
    params = dict(captured.module.named_parameters())
    sizes = {n: p.numel() * p.element_size() for n, p in params.items()}
    schedule = build_schedule(captured.graph, widths, captured.layer_params, sizes, 2)
    groups = PlanGroups(schedule.param_ranks.values(), 2)
    grad_sync = GradSync.for_schedule(schedule, params, GroupMessages(groups.redistribution, groups), rank)
    runtime = BurstRuntime(
        captured, schedule, rank=rank, device=torch.device("cuda", rank), grad_sync=grad_sync
    )
    runtime.forward(x[rank * 4 : (rank + 1) * 4]).square().mean().backward()  # a DDP rank's loss
    grad_sync.sync()
    reference_grads = dict(reference.named_parameters())
    error = max(
        (p.grad - reference_grads[n].grad).abs().max().item()
        for n, p in params.items()
        if schedule.owns(rank, n)
    )
    runtime.close()
    groups.destroy()
    return error


@two_gpus
def test_nccl_burst_gradients_equal_single_device():
    errors = run_distributed(_nccl_gradients, 2, backend="nccl")
    assert max(errors) < 1e-5


def _sixteen_mixed(rank: int) -> int:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_deeppool import DeepPoolStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).float().square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(64, 3, 16, 16))
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=2,
        precision="16-mixed",
        strategy=DeepPoolStrategy(plan={"": 2, "net.head": 1}, cache_dir=False, start_method="spawn"),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=8))
    return trainer.global_step


@two_gpus
def test_sixteen_mixed_trains_with_a_mixed_width_plan():
    assert _sixteen_mixed(0) == 4


def test_a_shared_batch_summary_on_the_gpu_equals_the_cpus():
    x = torch.randn(2, 3, 33, 17)
    labels = torch.randint(0, 4, (2, 5))
    on_cpu = checksum([x, labels])
    assert checksum([x.cuda(), labels.cuda()]) == on_cpu
    assert checksum([x.flip(3).cuda(), labels.cuda()]) != on_cpu


@pytest.mark.parametrize("compile_layers", [{}, {"mode": "reduce-overhead"}], ids=["inductor", "cuda-graphs"])
def test_compiled_and_cuda_graphed_layers_train_like_eager_ones(compile_layers: dict):
    eager, eager_losses = fit_one_device(DeepPoolStrategy(cache_dir=False), accelerator="cuda")
    strategy = DeepPoolStrategy(cache_dir=False, compile_layers=compile_layers)
    compiled, losses = fit_one_device(strategy, accelerator="cuda")
    # Inductor fuses and reorders float32 arithmetic: the weights agree to rounding, not bits.
    assert max_param_diff(compiled, eager) < 1e-4
    assert losses == pytest.approx(eager_losses, abs=1e-4)
