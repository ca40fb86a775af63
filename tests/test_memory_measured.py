"""The plan's memory per rank against what each rank holds while training zoo models on CPU: the
storages of its parameters, gradients and optimizer state, and of the tensors autograd saved during a
step's forward (beyond those and the batch), counted once each. Within 20% on every rank."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader

from lightning_deeppool import DeepPoolStrategy

from distributed import run_distributed
from models import SEED, join_lightning_world, trainer_kwargs
from zoo import CASES

TOLERANCE = 0.2
AT_STEP = 2  # after the first optimizer step: a rank has released the weights it does not run
# split by height into uneven parts with a narrow head; BatchNorm with narrow blocks; a tied head
WORLDS = {
    3: ["cnn-pooled-head-block-split-by-height"],
    2: ["resnet-batchnorm-vs-ddp", "hf-gpt2-loss-in-forward-tied-head"],
}


def _storages(values: list[Any]) -> dict[int, int]:
    """Bytes of each distinct storage among the tensors in `values` (a gradient this rank does not
    hold, which raises on reading its storage, counts nothing)."""
    found = {}
    for value in values:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            try:
                storage = value.untyped_storage()
            except RuntimeError:
                continue
            found[storage.data_ptr()] = storage.nbytes()
    return found


class HeldBytes(pl.Callback):
    """What this rank holds at step `AT_STEP`: gradients before the optimizer step, parameters and
    optimizer state after it, and what autograd saved during the step's forward."""

    def __init__(self) -> None:
        self.held = 0
        self._hooks = ExitStack()
        self._saved: list[torch.Tensor] = []
        self._batch: dict[int, int] = {}
        self._grads: dict[int, int] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == AT_STEP:
            self._batch = _storages(pytree.tree_leaves(batch))
            self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._saved.append(tensor)
        return tensor

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        if trainer.global_step == AT_STEP:
            self._hooks.close()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == AT_STEP:
            self._grads = _storages([p.grad for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step != AT_STEP + 1:
            return
        states = [value for o in trainer.optimizers for state in o.state.values() for value in state.values()]
        held = {**_storages(list(pl_module.parameters())), **self._grads, **_storages(states)}
        saved = {k: v for k, v in _storages(self._saved).items() if k not in self._batch}
        self.held = sum({**saved, **held}.values())
        self._saved = []


def _fit(rank: int, world: int, names: list[str], root: str) -> dict[str, tuple[int, int]]:
    """Per case: this rank's estimated and held bytes."""
    join_lightning_world(rank, world)
    found = {}
    for name in names:
        case = CASES[name]
        pl.seed_everything(SEED, verbose=False)
        torch.manual_seed(0)
        probe = HeldBytes()
        strategy = DeepPoolStrategy(
            plan=case.pins[world], cache_dir=False, profile_warmup=0, profile_repeats=1, **case.strategy
        )
        trainer = pl.Trainer(
            **trainer_kwargs(
                devices=world,
                strategy=strategy,
                max_steps=AT_STEP + 2,
                callbacks=[probe],
                default_root_dir=root,
            )
        )
        data = case.data(4 * case.local_batch * world)
        trainer.fit(case.model(), DataLoader(data, batch_size=case.local_batch))
        assert trainer.strategy.plan is not None
        found[name] = (trainer.strategy.plan.memory_bytes[rank], probe.held)
    return found


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[tuple[int, int]]]:
    by_case: dict[str, list[tuple[int, int]]] = {}
    for world, names in WORLDS.items():
        ranks = run_distributed(_fit, world, world, names, str(tmp_path_factory.mktemp(f"world{world}")))
        for name in names:
            by_case[name] = [found[name] for found in ranks]
    return by_case


@pytest.mark.parametrize("name", [name for names in WORLDS.values() for name in names])
def test_the_plans_memory_per_rank_is_within_20_percent_of_what_each_rank_holds(measured, name):
    for rank, (estimated, held) in enumerate(measured[name]):
        assert held > 0
        assert abs(estimated - held) <= TOLERANCE * held, f"rank {rank}: estimated {estimated}, held {held}"
