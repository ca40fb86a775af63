"""What a captured forward depended on besides its tensors is checked at every call: values it reads
from the modules (a training flag, a switch, global_step), its non-tensor arguments (a task name) and
forward hooks. Where they change (a module put in eval() mid-training, a switch, two tasks a step, a
hook registered later), the forward is captured again, once per set of values, and trains as one
device (or DDP) does; layers the plan never saw (a block joining at step 2, a head per task) run at
full width; strings forward never reads (file names in a batch dict) need no capture; a forward hook
gets its submodule's output as the plan computed it. A joining layer that shares a weight only some
ranks hold, and a hook on a submodule forward calls twice, stop every rank naming it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, default_collate

import lightning_deeppool.install as install_module
from lightning_deeppool import DeepPoolStrategy
from lightning_deeppool.capture.state import record_state

from distributed import run_distributed
from models import (
    CLASSES,
    MLP,
    SEED,
    images,
    join_lightning_world,
    max_param_diff,
    parameters,
    reference_fit,
    trainer_kwargs,
)

TOLERANCE = 1e-5
LOCAL_BATCH = 4


class HalvesOnOddBatches(MLP):
    """`training_step` sets a switch that forward reads: two sets of values, alternating every step."""

    def __init__(self) -> None:
        super().__init__()
        self.halve = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x.flatten(1))
        if self.halve:
            h = h * 0.5
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.halve = batch_idx % 2 == 1
        return super().training_step(batch, batch_idx)


FROM = 1


class FreezesBatchNormFromEpochOne(MLP):
    """A fine-tuning recipe: BatchNorm layers in eval() (running statistics, no updates) from the
    second epoch on, set in on_train_epoch_start."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(192, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()
        )

    def on_train_epoch_start(self) -> None:
        if self.current_epoch >= FROM:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.eval()


class ExtraBlockFromStepTwo(MLP):
    """A warm-up: a residual block joins forward from step 2 on (Python control flow on progress)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x.flatten(1))
        if self.global_step >= 2:
            h = h + self.extra(h)
        return self.head(h)


class KeepsBodyOutput(MLP):
    """A forward hook keeps the body's output for a penalty in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, torch.Tensor] = {}
        self.body.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.kept["body"] = output

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y) + 0.1 * self.kept["body"].pow(2).mean()


class TwoTasksPerStep(MLP):
    """Multi-task training: forward takes a task name, and each step calls it for both tasks."""

    def forward(self, x: torch.Tensor, task: str = "plain") -> torch.Tensor:
        h = self.body(x.flatten(1))
        if task == "negated":
            h = -h
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x, "plain"), y) + 0.5 * F.cross_entropy(self(x, task="negated"), y)


class HeadPerTask(MLP):
    """A head per task, chosen by name: the second task's head is a layer the plan never saw."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.ModuleDict({"a": nn.Linear(32, CLASSES), "b": nn.Linear(32, CLASSES)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.head[task](self.body(x.flatten(1)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x, "a"), y) + F.cross_entropy(self(x, "b"), y)


class ReadsBatchDicts(MLP):
    """The batch is a dict that also holds each sample's file name, which forward never reads."""

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        return super().forward(batch["x"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch), batch["y"])


class NamedImages(Dataset):
    """`images` as dicts with a file name per sample."""

    def __init__(self, n: int) -> None:
        self.x, self.y = images(n, size=(8, 8)).tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "path": f"images/{i:05d}.png"}


class TiedLayerFromStepTwo(MLP):
    """From step 2 a layer joins whose weight is that of `tail`, which the plan runs on rank 0 alone."""

    def __init__(self) -> None:
        super().__init__()
        self.tail = nn.Linear(32, 32)
        self.extra = nn.Linear(32, 32)
        self.extra.weight = self.tail.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tail(self.body(x.flatten(1)))
        if self.global_step >= 2:
            h = h + self.extra(h)
        return self.head(h)


class NarrowsWideImages(MLP):
    """Images 10 pixels wide go through a convolution that makes them 8 wide: a layer only some input
    shapes have."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Conv2d(3, 3, (1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 10:
            x = self.narrow(x)
        return super().forward(x)


class WideEveryOtherBatch:
    """A collate function that pads every second batch it makes to 10 pixels wide."""

    def __init__(self) -> None:
        self.batches = 0

    def __call__(self, samples: list[Any]) -> Any:
        self.batches += 1
        x, y = default_collate(samples)
        return (F.pad(x, (1, 1)) if self.batches % 2 == 0 else x), y


class HookFromStepTwo(pl.Callback):
    """From step 2, a forward hook on the body keeps its output, and the loss adds a penalty on it:
    registered after the plan was captured without it."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 2:
            pl_module.body.register_forward_hook(pl_module._keep)


class PenaltyFromStepTwo(KeepsBodyOutput):
    """`KeepsBodyOutput` whose hook `HookFromStepTwo` registers at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.body._forward_hooks.clear()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if "body" in self.kept:
            return super().training_step(batch, batch_idx)
        return MLP.training_step(self, batch, batch_idx)


class HooksATwiceCalledBlock(MLP):
    """A forward hook on a block forward calls twice."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(32, 32)
        self.block.register_forward_hook(lambda module, args, output: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.body(x.flatten(1)))))


TRAINED: dict[str, tuple[type[MLP], Any, dict[str, Any]]] = {
    "switch-alternating-every-step": (HalvesOnOddBatches, list, {"max_steps": 6}),
    "two-tasks-per-step": (TwoTasksPerStep, list, {"max_steps": 4}),
    "batch-dicts-with-file-names": (ReadsBatchDicts, list, {"max_steps": 4}),
    "a-block-joining-at-step-two": (ExtraBlockFromStepTwo, list, {"max_steps": 4}),
    "a-head-per-task": (HeadPerTask, list, {"max_steps": 3}),
    "a-layer-only-wide-images-use": (NarrowsWideImages, list, {"max_steps": 4}),
    "a-forward-hook-keeping-an-activation": (KeepsBodyOutput, list, {"max_steps": 3}),
    "a-forward-hook-registered-at-step-two": (
        PenaltyFromStepTwo,
        lambda: [HookFromStepTwo()],
        {"max_steps": 4},
    ),
}
AGAINST_DDP: dict[str, tuple[type[MLP], Any, dict[str, Any]]] = {
    "batch-norm-in-eval-from-epoch-one": (FreezesBatchNormFromEpochOne, list, {"max_epochs": 3}),
}
REFUSED: dict[str, tuple[type[MLP], Any, dict[str, Any]]] = {
    "a-joining-layer-sharing-a-narrow-weight": (TiedLayerFromStepTwo, list, {"max_steps": 4}),
    "a-forward-hook-on-a-block-called-twice": (HooksATwiceCalledBlock, list, {"max_steps": 2}),
}
CASES = {**TRAINED, **AGAINST_DDP, **REFUSED}


def _pins(name: str, world: int) -> dict[str, int]:
    """Mixed widths: {"": world, "head": 1}, and `tail` at width 1 where the case has one."""
    return {
        "": world,
        "head": 1,
        **({"tail": 1} if name == "a-joining-layer-sharing-a-narrow-weight" else {}),
    }


def _data(world: int, name: str = "") -> Any:
    n = 4 * LOCAL_BATCH * world
    return NamedImages(n) if name == "batch-dicts-with-file-names" else images(n, size=(8, 8))


def _collate(name: str) -> Any:
    return WideEveryOtherBatch() if name == "a-layer-only-wide-images-use" else None


def _fit(name: str, world: int, root: str, strategy: Any) -> dict[str, Any]:
    cls, callbacks, steps = CASES[name]
    torch.manual_seed(0)
    model = cls()
    pl.seed_everything(SEED, verbose=False)
    trainer = pl.Trainer(
        **trainer_kwargs(
            devices=world, strategy=strategy, callbacks=callbacks(), default_root_dir=root, **steps
        )
    )
    trainer.fit(model, DataLoader(_data(world, name), batch_size=LOCAL_BATCH, collate_fn=_collate(name)))
    return {"params": parameters(model), "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _every_case(rank: int, world: int, root: str) -> dict[str, Any]:
    join_lightning_world(rank, world)
    captures: list[nn.Module] = []
    capture_graph = install_module.capture_graph

    def counted(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        captures.append(module)
        return capture_graph(module, *args, **kwargs)

    install_module.capture_graph = counted  # type: ignore[assignment]
    results: dict[str, Any] = {}
    for name in CASES:
        captures.clear()
        strategy = DeepPoolStrategy(
            plan=_pins(name, world),
            cache_dir=False,
            profile_warmup=0,
            profile_repeats=1,
        )
        try:
            results[name] = _fit(name, world, root, strategy)
            results[name]["captures"] = len(captures)
        except Exception as err:  # the refused cases: every rank's message
            results[name] = f"{type(err).__name__}: {err}"
        if name in AGAINST_DDP and isinstance(results[name], dict):
            results[name]["ddp"] = _fit(name, world, root, "ddp")
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def runs(request, tmp_path_factory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    world = request.param
    ranks = run_distributed(_every_case, world, world, str(tmp_path_factory.mktemp("state")), timeout_s=600)
    references = {}
    for name, (cls, callbacks, steps) in TRAINED.items():
        torch.manual_seed(0)
        model = cls()
        reference_fit(
            model,
            _data(world, name),
            LOCAL_BATCH * world,
            collate_fn=_collate(name),
            callbacks=callbacks(),
            **steps,
        )
        references[name] = parameters(model)
    return ranks, references


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "captures"),
    [
        ("switch-alternating-every-step", 2),
        ("two-tasks-per-step", 2),
        ("batch-dicts-with-file-names", 1),  # the file names are never read
        ("a-block-joining-at-step-two", 2),  # steps 0 and 2 of 4: where `global_step >= 2` turns
        ("a-head-per-task", 2),  # the second head runs at full width
        ("a-layer-only-wide-images-use", 2),  # the layer runs at full width
        ("a-forward-hook-keeping-an-activation", 1),  # the hook gets the body's output as computed
        ("a-forward-hook-registered-at-step-two", 2),
    ],
)
def test_trains_as_one_device_with_each_set_of_values_captured_once(runs, name, captures):
    ranks, references = runs
    for rank in ranks:
        assert max_param_diff(references[name], rank[name]["params"]) < TOLERANCE
        assert rank[name]["captures"] == captures


@pytest.mark.slow
def test_a_joining_layer_that_shares_a_weight_only_some_ranks_hold_stops_every_rank_naming_it(runs):
    ranks, _ = runs
    for rank in ranks:
        message = rank["a-joining-layer-sharing-a-narrow-weight"]
        assert isinstance(message, str) and "with global_step >= 2: False -> True" in message, message
        assert "['extra']" in message and "only some ranks hold" in message, message


@pytest.mark.slow
def test_batch_norm_put_in_eval_mid_training_trains_as_ddp(runs):
    ranks, _ = runs
    for rank in ranks:
        outcome = rank["batch-norm-in-eval-from-epoch-one"]
        ddp = outcome["ddp"]["state"]
        assert int(ddp["body.1.num_batches_tracked"]) == 4  # the first epoch's steps only
        assert max_param_diff(ddp, outcome["state"]) < TOLERANCE


@pytest.mark.slow
def test_a_forward_hook_on_a_block_forward_calls_twice_stops_every_rank_naming_it(runs):
    ranks, _ = runs
    for rank in ranks:
        message = rank["a-forward-hook-on-a-block-called-twice"]
        assert isinstance(message, str) and "'block', which forward calls 2 times" in message, message


def test_the_values_forward_read_are_recorded_and_their_changes_named():
    model = FreezesBatchNormFromEpochOne()
    with record_state(model) as recorded:
        model(torch.randn(3, 3, 8, 8))
    state = recorded[0]
    assert state.changes(state.current()) == []
    model.body[1].eval()
    model.body.register_forward_hook(lambda module, args, output: None)
    changes = state.changes(state.current())
    assert "body.1.training: True -> False" in changes
    assert any(line.startswith("forward hooks: [] -> [('body',") for line in changes)


def test_values_of_other_types_and_of_other_modules_are_not_guards():
    model, other = MLP(), nn.Linear(2, 2)
    with record_state(model) as recorded:
        model(torch.randn(2, 3, 8, 8))
        other(torch.randn(1, 2))
    state = recorded[0]
    assert all(isinstance(value, bool | int | float | str | type(None) | tuple) for value in state.values)
    assert all(m is not other for m in state.modules)
    assert state.values


class _Progress:
    """A stand-in trainer: the progress a LightningModule's global_step reads."""

    global_step = 0


class ScalesByProgress(ExtraBlockFromStepTwo):
    """Computes with global_step (a warm-up factor), besides comparing it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * min(1.0, (self.global_step + 1) / 10)


def _read_while_capturing(model: pl.LightningModule) -> Any:
    progress = _Progress()
    model._trainer = progress  # type: ignore[assignment]
    with record_state(model) as recorded:
        model(torch.randn(2, 3, 8, 8))
    return recorded[0], progress


def test_a_progress_counter_forward_only_compares_is_checked_by_the_comparisons_outcome():
    state, progress = _read_while_capturing(ExtraBlockFromStepTwo())
    progress.global_step = 1
    assert state.changes(state.current()) == []
    progress.global_step = 5
    assert state.changes(state.current()) == ["global_step >= 2: False -> True"]


def test_a_progress_counter_forward_computes_with_is_checked_by_its_value():
    state, progress = _read_while_capturing(ScalesByProgress())
    progress.global_step = 1
    assert state.changes(state.current()) == ["global_step: 0 -> 1"]
