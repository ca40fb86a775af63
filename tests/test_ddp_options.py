"""Every `DDPStrategy` option is accepted by `DeepPoolStrategy`, with DDP's meaning where deeppool has
one, or refused with an error naming it: training with them matches one device, and a communication
hook sums every bucket of the plan's all-reduces over the bucket's own group."""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy
from lightning_deeppool.ir.profile import DEFAULT_BUCKET_BYTES

from distributed import run_distributed
from models import (
    MLP,
    images,
    join_lightning_world,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

# DDPStrategy's and DistributedDataParallel's options are Lightning's and torch's: checked at the floors too.
pytestmark = pytest.mark.floors

TOLERANCE = 1e-5
STEPS = 3
LOCAL_BATCH = 8

# One value other than DDP's default for each option deeppool honours or has nothing to change for.
ACCEPTED: dict[str, Any] = {
    "ddp_comm_state": None,
    "ddp_comm_hook": default_hooks.allreduce_hook,
    "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper,
    "model_averaging_period": 4,
    "find_unused_parameters": True,
    "static_graph": True,
    "gradient_as_bucket_view": True,
    "bucket_cap_mb": 10,
    "broadcast_buffers": False,
    "forward_sync_buffers": True,
    "init_sync": False,
    "check_reduction": True,
    "skip_all_reduce_unused_params": True,
    "output_device": 0,
    "dim": 1,
    "batched_grad_copy": True,
}
# The DistributedDataParallel arguments deeppool cannot honour: it sums over groups of its own plan.
REFUSED: dict[str, Any] = {
    "process_group": object(),
    "device_mesh": object(),
    "mixed_precision": object(),
    "delay_all_reduce_named_params": [("w", nn.Parameter(torch.zeros(1)))],
    "param_to_hook_all_reduce": nn.Parameter(torch.zeros(1)),
    "bucket_cap_mb_list": [1, 2],
}


def ddp_options() -> dict[str, Any]:
    """Every option `DDPStrategy` takes, at its default, and the DistributedDataParallel arguments it
    forwards, as LightningCLI fills them in."""
    strategy = inspect.signature(DDPStrategy.__init__).parameters
    forwarded = inspect.signature(DistributedDataParallel.__init__).parameters
    options = {name: p.default for name, p in strategy.items() if name not in {"self", "kwargs"}}
    options.update(
        {name: p.default for name, p in forwarded.items() if name not in {"self", "module", "device_ids"}}
    )
    return options


def test_every_ddp_option_is_accepted_or_refused_by_name():
    assert set(ddp_options()) - set(inspect.signature(DeepPoolStrategy.__init__).parameters) <= (
        set(ACCEPTED) | set(REFUSED)
    )


def test_every_ddp_option_at_its_default_is_accepted():
    strategy = DeepPoolStrategy(**ddp_options())
    assert strategy.session.options.comm_hook is None
    assert strategy.session.options.bucket_bytes == DEFAULT_BUCKET_BYTES


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_each_option_deeppool_honours_or_need_not_is_accepted(name):
    DeepPoolStrategy(**{name: ACCEPTED[name]})


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_option_deeppool_cannot_honour_raises_naming_it(name):
    with pytest.raises(ValueError, match=f"DeepPoolStrategy\\({name}="):
        DeepPoolStrategy(**{name: REFUSED[name]})


@pytest.mark.parametrize("name", ["device_ids", "no_such_option"])
def test_an_argument_ddp_does_not_take_from_users_raises_type_error(name):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        DeepPoolStrategy(**{name: [0]})


def test_bucket_cap_mb_sets_the_bucket_size():
    assert DeepPoolStrategy(bucket_cap_mb=10).session.options.bucket_bytes == 10 * 2**20
    assert DeepPoolStrategy(bucket_mb=10, bucket_cap_mb=10).session.options.bucket_bytes == 10 * 2**20


def test_bucket_mb_and_bucket_cap_mb_that_disagree_raise():
    with pytest.raises(ValueError, match="bucket_mb=4 and bucket_cap_mb=10"):
        DeepPoolStrategy(bucket_mb=4, bucket_cap_mb=10)


def test_gradient_as_bucket_view_false_keeps_each_gradient_its_own():
    assert DeepPoolStrategy().session.options.bucket_view is True
    assert DeepPoolStrategy(gradient_as_bucket_view=False).session.options.bucket_view is False


def test_a_comm_wrapper_wraps_the_hook():
    hook = DeepPoolStrategy(
        ddp_comm_hook=default_hooks.allreduce_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper
    ).session.options.comm_hook
    assert hook is not None and hook.hook.__name__ == "fp16_compress_wrapper_hook"


def test_post_local_sgd_raises():
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=10)
    with pytest.raises(ValueError, match="post-local SGD"):
        DeepPoolStrategy(
            ddp_comm_state=state, ddp_comm_hook=default_hooks.allreduce_hook, model_averaging_period=4
        )


def test_a_hook_that_is_not_callable_raises():
    with pytest.raises(TypeError, match="ddp_comm_hook"):
        DeepPoolStrategy(ddp_comm_hook="allreduce_hook")


# ------------------------------------------------------------------------------------- training
class MLPWithUnused(MLP):
    """The MLP with a parameter no step uses: DDP needs find_unused_parameters=True for it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unused = nn.Parameter(torch.ones(4))


def _model() -> MLPWithUnused:
    torch.manual_seed(0)
    return MLPWithUnused()


def _one_device(world_size: int) -> dict[str, torch.Tensor]:
    """The model's parameters after training on one device at the global batch of `world_size` ranks."""
    model = _model()
    reference_fit(model, images(4 * world_size * LOCAL_BATCH), world_size * LOCAL_BATCH, max_steps=STEPS)
    return parameters(model)


def _fit(
    rank: int, world_size: int, root: str, options: dict[str, Any], callbacks: list[pl.Callback]
) -> tuple[dict[str, torch.Tensor], DeepPoolStrategy]:
    """This rank's parameters after training under `DeepPoolStrategy(**options)`, and the strategy."""
    join_lightning_world(rank, world_size)
    model = _model()
    strategy = DeepPoolStrategy(cache_dir=False, profile_warmup=0, profile_repeats=1, **options)
    trainer = pl.Trainer(
        **trainer_kwargs(
            devices=world_size, strategy=strategy, default_root_dir=root, max_steps=STEPS, callbacks=callbacks
        )
    )
    trainer.fit(model, DataLoader(images(4 * world_size * LOCAL_BATCH), batch_size=LOCAL_BATCH))
    return parameters(model), strategy


class BucketStorages(pl.Callback):
    """Per step and bucket of this rank's plan: how many storages its gradients lie in."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        sync = trainer.strategy.session.installed.grad_sync
        for bucket in sync.buckets:
            grads = [sync.params[name].grad for name in bucket.params]
            self.counts.append(len({g.untyped_storage().data_ptr() for g in grads}))


def _fit_with_ddp_options(rank: int, root: str) -> dict[str, Any]:
    storages = BucketStorages()
    options = {
        "plan": {"": 2, "head": 1},
        "find_unused_parameters": True,
        "gradient_as_bucket_view": True,
        "static_graph": True,
    }
    params, strategy = _fit(rank, 2, root, options, [storages])
    assert strategy.plan is not None
    return {"params": params, "widths": strategy.plan.widths(), "storages": storages.counts}


@pytest.fixture(scope="module")
def ddp_options_fit(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("ddp-options"))
    return _one_device(2), run_distributed(_fit_with_ddp_options, 2, root)


@pytest.mark.slow
def test_training_with_ddp_options_and_mixed_widths_matches_one_device(ddp_options_fit):
    reference, ranks = ddp_options_fit
    assert ranks[0]["widths"]["head"] == 1 and ranks[0]["widths"]["body_0"] == 2
    assert max_param_diff(reference, ranks[0]["params"]) < TOLERANCE
    assert torch.equal(ranks[0]["params"]["unused"], torch.ones(4))


@pytest.mark.slow
def test_gradient_as_bucket_view_leaves_each_buckets_gradients_in_one_storage(ddp_options_fit):
    _, ranks = ddp_options_fit
    for result in ranks:
        assert result["storages"] and set(result["storages"]) == {1}


# ----------------------------------------------------------------------------- communication hooks
RECORDED: list[tuple[Any, list[nn.Parameter], bool]] = []  # per bucket a hook summed on this rank


def recording_hook(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce hook, noting the group and parameters of every bucket it sums, and which is
    the step's last."""
    assert isinstance(group, dist.ProcessGroup)
    RECORDED.append((tuple(dist.get_process_group_ranks(group)), bucket.parameters(), bucket.is_last()))
    return default_hooks.allreduce_hook(group, bucket)


class HookedBuckets(pl.Callback):
    """Per step: the buckets the hook summed, and the buckets of this rank's plan summed over more
    than one rank, each as (ranks, parameter names); and which the hook was told was the last."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[Any], list[Any]]] = []
        self.lasts: list[list[bool]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        sync = trainer.strategy.session.installed.grad_sync
        names = {id(p): name for name, p in sync.params.items()}
        hooked = [(ranks, [names[id(p)] for p in params]) for ranks, params, _ in RECORDED]
        planned = [(b.ranks, list(b.params)) for b in sync.buckets if len(b.ranks) > 1]
        self.steps.append((hooked, planned))
        self.lasts.append([last for _, _, last in RECORDED])
        RECORDED.clear()


def _fit_with_hook(rank: int, root: str) -> dict[str, Any]:
    buckets = HookedBuckets()
    options = {"plan": {"": 3, "body.2": 2, "head": 1}, "ddp_comm_hook": recording_hook}
    params, _ = _fit(rank, 3, root, options, [buckets])
    return {"params": params, "steps": buckets.steps, "lasts": buckets.lasts}


@pytest.fixture(scope="module")
def hooked_fit(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("comm-hook"))
    return _one_device(3), run_distributed(_fit_with_hook, 3, root)


@pytest.mark.slow
def test_every_bucket_of_the_plans_all_reduces_passes_through_the_hook_over_its_group(hooked_fit):
    _, ranks = hooked_fit
    for result in ranks:
        assert len(result["steps"]) == STEPS
        for hooked, planned in result["steps"]:
            assert planned and hooked == planned
    groups = {group for result in ranks for hooked, _ in result["steps"] for group, _ in hooked}
    assert groups == {(0, 1), (0, 1, 2)}


@pytest.mark.slow
def test_the_hook_is_told_the_last_bucket_of_each_step(hooked_fit):
    _, ranks = hooked_fit
    for result in ranks:
        assert all(lasts[-1] and sum(lasts) == 1 for lasts in result["lasts"])


@pytest.mark.slow
def test_training_through_a_comm_hook_matches_one_device(hooked_fit):
    reference, ranks = hooked_fit
    assert max_param_diff(reference, ranks[0]["params"]) < TOLERANCE


def recording_bytes(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce hook, noting the bytes it sums and those of the bucket's parameters."""
    buffer = bucket.buffer()
    held = sum(p.numel() * p.element_size() for p in bucket.parameters())
    RECORDED.append(((buffer.numel() * buffer.element_size(), held), bucket.parameters(), bucket.is_last()))
    return default_hooks.allreduce_hook(group, bucket)


def _fit_with_compression(rank: int, root: str) -> dict[str, Any]:
    options = {
        "plan": {"": 2, "head": 1},
        "ddp_comm_hook": recording_bytes,
        "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper,
    }
    params, _ = _fit(rank, 2, root, options, [])
    return {"params": params, "bytes": [sizes for sizes, _, _ in RECORDED]}


@pytest.mark.slow
def test_a_compression_hook_halves_the_bytes_each_bucket_all_reduces(tmp_path):
    ranks = run_distributed(_fit_with_compression, 2, str(tmp_path))
    for result in ranks:
        assert result["bytes"] and all(2 * summed == held for summed, held in result["bytes"])
    assert max_param_diff(_one_device(2), ranks[0]["params"]) < 1e-2  # fp16's precision
